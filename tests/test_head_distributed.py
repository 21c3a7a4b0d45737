"""The head on 2, 3 and 4 real gloo ranks against the dense and PLSC-literal oracles
(with Partial FC sampling: the dense oracle restricted to the sampled classes).

Each world size is one group of launched ranks (tests/head_ranks.py) that runs every
case; the tests below read its report.
"""
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD_SIZES = (2, 3, 4)


@pytest.fixture(scope="module")
def head_report(tmp_path_factory, run_ranks):
    """`head_report(world_size)`: rank 0's report of a group of that many ranks, run once."""
    reports = {}

    def report(world_size):
        if world_size not in reports:
            out = str(tmp_path_factory.mktemp(f"ranks{world_size}"))
            done = run_ranks(os.path.join(HERE, "head_ranks.py"), world_size, cwd=out)
            if done.status != 0 or not done.reports[0]:
                pytest.fail(f"{world_size} ranks failed ({done.status}):\n{done.tail(5000)}")
            reports[world_size] = done.reports[0]
        return reports[world_size]
    return report


KERNEL_SETS = ("cpu", "device")  # the device set's cases: head_ranks.DEVICE + name


def case(head_report, world_size, name, kernels="cpu"):
    from head_ranks import DEVICE
    result = head_report(world_size)[(DEVICE if kernels == "device" else "") + name]
    assert result is not None
    if "error" in result:
        pytest.fail(result["error"])
    return result


def _oracle_cases():
    from head_cases.common import case_name
    from head_cases.oracle import oracle_cases
    return [case_name(name, c, r, k) for name, _, c, r, k in oracle_cases()]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", _oracle_cases())
@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_head_matches_oracles(world_size, name, kernels, head_report):
    errs = case(head_report, world_size, name, kernels)
    for key, (err, allowed) in errs.items():
        assert err <= allowed, (key, err, allowed)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_collectives(world_size, head_report):
    result = case(head_report, world_size, "collectives")
    checks = ("all_gather_forward", "all_gather_backward", "reduce_scatter_forward",
              "reduce_scatter_backward")
    assert set(result) == {f"rank{r}.{c}" for r in range(world_size) for c in checks}, result
    assert all(result.values()), sorted(key for key, ok in result.items() if not ok)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bad_input_raises_on_every_rank(world_size, head_report):
    result = case(head_report, world_size, "bad_input")
    assert result["bad_label"].startswith("label 23 on rank 1 is outside [0, 23)")
    assert result["deferred_bad_label"].startswith("label 23 on rank 1 is outside [0, 23)")
    assert result["deferred_good_equals_float"] is True
    assert result["negative_label"].startswith("label -4 on rank 0 is outside [0, 23)")
    assert "local batch sizes differ across ranks: [5, 4" in result["uneven_batch"]
    assert result["same_on_all_ranks"] and result["after_errors_ok"]


def test_backend_is_gloo_on_cpu(head_report):
    assert head_report(2)["backend"] == "GLOO"


def _dtype_cases():
    from head_cases.dtypes import dtype_case_name, dtype_cases
    return [dtype_case_name(*c) for c in dtype_cases()]


def _fused_cases():
    from head_cases.fused import fused_case_name, fused_cases
    return [fused_case_name(*c) for c in fused_cases()]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", _dtype_cases())
@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_narrow_head_matches_float32_head(world_size, name, kernels, head_report):
    """bfloat16/float16 storage vs the float32 head on the same rounded values (and vs the
    float64 oracle on them): loss, embedding and sampled-row gradients within 1e-5."""
    errs = case(head_report, world_size, name, kernels)
    for key, (err, allowed) in errs.items():
        assert err <= allowed, (key, err, allowed)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", _fused_cases())
def test_fused_update_equals_separate_bit_for_bit(world_size, name, head_report):
    """The optimizer applied inside the backward == backward then `opt.step`, on every rank's
    shard (counts of differing elements per rank), and the fused backward leaves no gradient."""
    from head_cases.fused import fused_failures
    result = case(head_report, world_size, name)
    assert "weight" in result and "fused_left_a_gradient" in result
    assert len(result["weight"]) == world_size
    assert not fused_failures(result), fused_failures(result)


def _issue13_cases():
    from head_cases.adaface_subcenters import (ADAFACE_CASES, SUBCENTER_CASES,
                                               adaface_case_name, subcenter_case_name)
    names = [subcenter_case_name(m, c, r, ch, k) for m, c, r, ch, k, _ in SUBCENTER_CASES]
    names += [adaface_case_name(*c) for c in ADAFACE_CASES]
    return names + ["adaface-steps"]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", _issue13_cases())
@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_adaface_and_subcenters_match_oracle(world_size, name, kernels, head_report):
    """AdaFace on data hitting every clamp (dense, chunked, Partial FC; the running statistics
    after one and after three steps, then eval mode) and sub-centres (K = 2 ArcFace dense and
    chunked, K = 3 CosFace with Partial FC; ties between centres) on uneven class splits,
    against the float64 oracle on rank 0."""
    errs = case(head_report, world_size, name, kernels)
    for key, (err, allowed) in errs.items():
        assert err <= allowed, (key, err, allowed)


def _filter_cases():
    from head_cases.filtering import FILTER_CASES, filter_case_name
    return [filter_case_name(*c) for c in FILTER_CASES]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", _filter_cases())
@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_interclass_filtering_matches_oracle(world_size, name, kernels, head_report):
    """Inter-class filtering (Partial FC 0.5 ArcFace; chunked CosFace with K = 2 sub-centres;
    AdaFace, whose clamp shares the mask) against the float64 oracle on rank 0, every rank's
    (sampled) classes holding filtered entries, targets above the threshold, and the filter
    moving loss and gradients 100 times beyond the tolerance (head_cases/filtering.py)."""
    errs = case(head_report, world_size, name, kernels)
    for key, (err, allowed) in errs.items():
        assert err <= allowed, (key, err, allowed)
