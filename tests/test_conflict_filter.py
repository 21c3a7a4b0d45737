"""Inter-class filtering (`interclass_filtering_threshold`, arcface_torch's noisy-data recipe)
in one process against the float64 oracle (tests/oracles.py: the rule written from
arcface_torch's CombinedMarginLoss), the float32 comparison at the threshold, and the knob's
checks and wiring. The multi-rank cases run in tests/head_ranks.py's groups
(test_head_distributed.py)."""
import os

import plsc  # noqa: F401  (before Paddle: it sets MKL's code path)
import numpy as np
import paddle
import pytest

from head_cases.filtering import FILTER_THRESHOLD, check_filtered
from oracles import compare_oracle, filtered_mask, oracle_reference, published_margin
from plsc.config import ConfigError, load_config, validate
from plsc.loss import ArcFace, CosFace, Softmax
from plsc.nn import PartialFC
from plsc.nn.parallel_softmax import filter_bound, parallel_softmax_cross_entropy
from test_head_single import run_head

pytestmark = pytest.mark.usefixtures("kernels")  # every test on both kernel sets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARGIN_NAMES = ("arcface", "arcface_st", "cosface", "sphereface", "combined", "adaface")
SHAPES = {"dense": (1.0, 0), "chunked": (1.0, 3), "sampled": (0.5, 0),
          "sampled_chunked": (0.5, 2)}  # (sample ratio, chunk size)


def assert_errs(errs):
    for key, (err, allowed) in errs.items():
        assert err <= allowed, (key, err, allowed)


# ---- the comparison at the threshold


@pytest.mark.parametrize("s", [64.0, 30.0, 32.5, 7.3, 1.0])
@pytest.mark.parametrize("t", [0.4, 0.25, 0.6, 0.123456789, 0.999])
def test_filter_bound_is_the_float32_cosine_comparison(s, t):
    """`logit > filter_bound(t, s)` equals fl32(logit / fl32(s)) > fl32(t) (numpy's float32
    division, correctly rounded) for every float32 logit within 4,096 ulps of t·s."""
    s32, t32 = np.float32(s), np.float32(t)
    centre = np.float32(float(t32) * float(s32))
    ulp = np.spacing(centre)
    logits = (centre + ulp * np.arange(-4096, 4097, dtype="float64")).astype("float32")
    assert len(np.unique(logits)) == len(logits)  # consecutive float32 values
    bound = filter_bound(t, s)
    assert np.float32(bound) == bound  # a float32 value: Paddle's comparison is then exact
    np.testing.assert_array_equal(logits > bound, logits / s32 > t32)


@pytest.mark.parametrize("s,t", [(30.0, 0.49), (35.0, 0.41), (40.0, 0.3)])
def test_filter_bound_differs_from_the_scaled_threshold(s, t):
    """Why the bound is searched for: comparing the logit with the scaled threshold fl32(t·s)
    misclassifies a logit an ulp from it for some s that are not powers of two."""
    s32, t32 = np.float32(s), np.float32(t)
    centre = np.float32(float(t32) * float(s32))
    logits = (centre + np.spacing(centre) * np.arange(-8, 9)).astype("float32")
    naive, exact = logits > centre, logits / s32 > t32
    assert (naive != exact).any()
    np.testing.assert_array_equal(logits > filter_bound(t, s), exact)


@pytest.mark.parametrize("chunk", [0, 1])
def test_borderline_cosine_is_compared_in_float32(chunk):
    """A class whose cosine is exactly fl32(0.6) (x = (3, 4, 0…), |x| = 5; centre e0): with
    t = 0.6 it is not filtered (arcface_torch compares float32 cosines with t in float32:
    fl32(0.6) > fl32(0.6) is false, though fl32(0.6) > 0.6 in float64), with t one float32 ulp
    below it is. s = 64: every product and sum of these logits is exact."""
    d = 4
    x = np.zeros((1, d), dtype="float32")
    x[0, :2] = [3.0, 4.0]
    w = np.zeros((3, d), dtype="float32")
    w[0, 0] = 1.0                     # class 0: cosine fl32(0.6), the borderline one
    w[1, 1] = -1.0                    # class 1, the target: cosine −fl32(0.8)
    w[2, 2] = 1.0                     # class 2: cosine 0
    y = np.array([1])
    c06 = np.float32(0.6)
    assert float(c06) > 0.6           # the float64 comparison would filter it
    below = float(np.nextafter(c06, np.float32(0)))
    for t, filtered in ((0.6, False), (below, True)):
        got = run_head(published_margin("ArcFace"), x, y, w, chunk_size=chunk,
                       interclass_filtering_threshold=t)
        loss, g = got["loss"], got["dw"]
        assert (np.abs(g[0]).max() == 0) == filtered, (t, g[0])
        # the loss from its formula: logits s·cos(θ_t + m) for the target, s·c or 0 (filtered)
        s, m = 64.0, 0.5
        others = [0.0 if filtered else s * float(c06), 0.0]
        target = s * np.cos(np.arccos(-float(np.float32(0.8))) + m)
        expect = np.log(np.exp(target) + np.exp(others).sum()) - target
        assert abs(float(loss) - expect) <= 1e-6 * abs(expect), (t, float(loss), expect)


# ---- the head against the oracle


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("name", MARGIN_NAMES)
def test_head_matches_filtered_oracle(name, shape):
    """Loss, embedding and (sampled) weight gradients within the float32 tolerance of the
    oracle, on data with filtered entries, targets above the threshold, and a filter effect
    100 times the tolerance (see head_cases/filtering.py)."""
    ratio, chunk = SHAPES[shape]
    assert_errs(check_filtered(name, 23 if ratio == 1.0 else 101, ratio, chunk, n=12))


@pytest.mark.parametrize("name,k,ratio,chunk", [("arcface", 2, 1.0, 0), ("cosface", 3, 0.5, 2),
                                                ("adaface", 2, 1.0, 3), ("sphereface", 2, 0.5, 0)])
def test_head_with_subcentres_filters_on_the_class_cosine(name, k, ratio, chunk):
    """With K centres a class, the class's cosine (the largest of its centres') is compared."""
    assert_errs(check_filtered(name, 23 if ratio == 1.0 else 101, ratio, chunk, k, n=12))


def test_column_slabs(monkeypatch):
    """The wide-block backward (slabs of 7 classes) with filtering."""
    import plsc.nn.parallel_softmax as ps
    monkeypatch.setattr(ps, "_WGRAD_BLOCK_BYTES", 0)
    monkeypatch.setattr(ps, "_WGRAD_SLAB", 7)
    monkeypatch.setattr(ps, "_DEVICE_WGRAD_BYTES", 7 * 4 * 16)  # the device set's: 7 rows
    assert_errs(check_filtered("arcface", 101, 1.0, 0, n=12))


@pytest.mark.parametrize("chunk", [0, 2])
def test_filtered_classes_get_no_gradient_and_targets_are_kept(chunk):
    """One sample whose target (cosine 0.3) and another class (0.7) are above t = 0.25: the
    other class's weight gradient is exactly 0, the target's is not, and both are the
    oracle's; the loss counts the filtered class as exp(0 − max)."""
    rng = np.random.RandomState(0)
    d, c = 8, 5
    w = rng.normal(size=(c, d)).astype("float32")
    u = w[3] / np.linalg.norm(w[3])   # the target's direction
    v = w[1] / np.linalg.norm(w[1])   # the conflicting class's
    v_perp = v - (v @ u) * u
    beta = (0.7 - 0.3 * (v @ u)) / np.linalg.norm(v_perp)
    r = rng.normal(size=d)
    r -= (r @ u) * u + (r @ v_perp) * v_perp / (v_perp @ v_perp)
    unit = 0.3 * u + beta * v_perp / np.linalg.norm(v_perp)
    unit += np.sqrt(1.0 - unit @ unit) * r / np.linalg.norm(r)
    x = (2.0 * unit).astype("float32")[None]
    y = np.array([3])
    cos = (x / np.linalg.norm(x)) @ (w / np.linalg.norm(w, axis=1, keepdims=True)).T
    dirty = filtered_mask(x, y, w, FILTER_THRESHOLD)[0]
    assert abs(cos[0, 3] - 0.3) < 1e-6 and abs(cos[0, 1] - 0.7) < 1e-6, cos
    assert dirty[1] and not dirty[3], (cos, dirty)
    margin = published_margin("CosFace")
    got = run_head(margin, x, y, w, chunk_size=chunk,
                   interclass_filtering_threshold=FILTER_THRESHOLD)
    loss, g = got["loss"], got["dw"]
    assert np.all(np.abs(g[dirty]).max(axis=1) == 0), g[dirty]
    assert np.abs(g[3]).max() > 0 and np.all(np.abs(g[~dirty]).max(axis=1) > 0)
    assert_errs(compare_oracle(got, x, y, w, margin, filter_threshold=FILTER_THRESHOLD))
    # by hand: logits 64·(cos − 0.4) for the target, 0 for the filtered, 64·cos for the rest
    logits = np.where(dirty, 0.0, 64.0 * cos[0].astype("float64"))
    logits[3] = 64.0 * (cos[0, 3] - 0.4)
    expect = np.log(np.exp(logits - logits.max()).sum()) + logits.max() - logits[3]
    assert abs(float(loss) - expect) <= 1e-5 * expect


def test_off_is_the_unfiltered_head():
    """Threshold 0 is the plain head (the oracle without filtering), on data where filtering
    would matter."""
    from oracles import make_conflict_case
    x, y, w = make_conflict_case(seed=1, n=8, d=16, num_classes=23, threshold=0.25)
    margin = published_margin("ArcFace")
    got = run_head(margin, x, y, w, interclass_filtering_threshold=0)
    assert_errs(compare_oracle(got, x, y, w, margin))
    assert oracle_reference(x, y, w, margin, filter_threshold=0.25)["loss"] != got["loss"]


@pytest.mark.parametrize("ratio,chunk", [(1.0, 0), (0.5, 3)])
def test_bfloat16_centres(ratio, chunk):
    """bfloat16 centres with filtering against the oracle on the rounded centres (the logits
    and the filter are float32 either way)."""
    from oracles import make_conflict_case
    from head_cases.common import restricted, run_head_step
    from head_cases.dtypes import rounded
    x, y, w = make_conflict_case(seed=4, n=12, d=16, num_classes=23, threshold=FILTER_THRESHOLD)
    w = rounded(w, "bfloat16")
    margin = published_margin("ArcFace")
    w16 = paddle.to_tensor(w).astype("bfloat16")  # the rounded values, exactly
    head, got, used, _ = run_head_step(margin, 23, x, y, w16, ratio, chunk,
                                       param_dtype="bfloat16",
                                       interclass_filtering_threshold=FILTER_THRESHOLD)
    assert head.weight.dtype == paddle.bfloat16
    if ratio == 1.0:  # one process: the whole gradient, stored by Paddle as bfloat16
        got["dw"] = head.weight.grad.astype("float32").numpy()
    remapped, w_used = restricted(used, y, w, 1)
    errs = compare_oracle(got, x, remapped, w_used, margin, filter_threshold=FILTER_THRESHOLD)
    if ratio == 1.0:  # the dense weight gradient is stored in bfloat16: half an ulp off
        errs["dw"] = (errs["dw"][0], errs["dw"][1] + 2.0 ** -8)
    assert_errs(errs)


@pytest.mark.parametrize("ratio,chunk,dtype", [(1.0, 0, "float32"), (0.5, 7, "bfloat16")])
def test_fused_update_equals_separate(ratio, chunk, dtype):
    """The optimizer inside the backward == backward then step, bit for bit, with filtering
    (random centres and embeddings: at t = 0.1 about a third of the entries are filtered)."""
    from head_cases.fused import check_fused_vs_separate, fused_failures
    result = check_fused_vs_separate("momentum", published_margin("ArcFace"), 101, ratio, chunk,
                                     dtype, head_kw={"interclass_filtering_threshold": 0.1})
    assert not fused_failures(result), fused_failures(result)


@pytest.mark.parametrize("chunk,widths", [(0, [23]), (7, [7])])
def test_memory_is_one_bool_mask_of_the_widest_block(chunk, widths):
    """With filtering on, the head's step buffers grow by one `[N, width]` bool mask of the
    widest block (kept between steps, like the logits; the last block of 2 borrows it): N·23
    bytes dense, N·7 bytes in blocks of 7 (23 = 3·7 + 2), nothing else."""
    n = 12
    sizes = {}
    for t in (0.0, FILTER_THRESHOLD):
        head = PartialFC(16, 23, ArcFace(), chunk_size=chunk, interclass_filtering_threshold=t)
        for _ in range(2):
            x = paddle.randn([n, 16])
            x.stop_gradient = False
            head(x, paddle.randint(0, 23, [n])).backward()
        sizes[t] = head.workspace.nbytes
    assert sizes[FILTER_THRESHOLD] - sizes[0.0] == n * sum(widths), sizes


# ---- the knob


def test_softmax_margin_is_refused():
    with pytest.raises(ValueError, match=r"interclass_filtering_threshold=0.4 needs a normalised"):
        PartialFC(8, 10, Softmax(), interclass_filtering_threshold=0.4)
    with pytest.raises(ValueError, match=r"interclass_filtering_threshold=0.4 needs a normalised"):
        parallel_softmax_cross_entropy(paddle.randn([2, 8]), paddle.randn([10, 8]),
                                       paddle.zeros([10]), paddle.to_tensor([0, 1]), Softmax(),
                                       interclass_filtering_threshold=0.4)
    PartialFC(8, 10, Softmax(), interclass_filtering_threshold=0)  # off: allowed
    raw = {"Loss": {"num_classes": 10, "margin": "softmax",
                    "interclass_filtering_threshold": 0.4}, "Data": {"root": "/data"}}
    with pytest.raises(ConfigError, match=r"Loss.interclass_filtering_threshold=0.4 .*not softmax"):
        validate(raw)
    raw["Loss"]["margin"] = "cosface"
    assert validate(raw)["Loss"]["interclass_filtering_threshold"] == 0.4


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "0.4", float("nan")])
def test_bad_thresholds_are_refused(bad):
    with pytest.raises(ValueError, match="interclass_filtering_threshold must be a number in"):
        PartialFC(8, 10, ArcFace(), interclass_filtering_threshold=bad)
    raw = {"Loss": {"num_classes": 10, "interclass_filtering_threshold": bad},
           "Data": {"root": "/data"}}
    with pytest.raises(ConfigError, match="Loss.interclass_filtering_threshold must be"):
        validate(raw)


def test_wf12m_conflict_config_is_arcface_torchs_recipe():
    """configs/wf12m_conflict_r50_pfc03_filter04.yaml against arcface_torch's
    configs/wf12m_conflict_r50_pfc03_filter04.py (and base.py, train.py of that recipe):
    margin_list (1.0, 0.0, 0.4) = CosFace s = 64 (train.py's scale), r50, embedding 512,
    sample_rate 0.3, filter 0.4, SGD lr 0.1 momentum 0.9, weight decay 5e-4, 128 a GPU,
    20 epochs with 20 // 10 = 2 of warm-up, 1,017,970 classes, fp16, backbone clip 5."""
    cfg = load_config(os.path.join(ROOT, "configs", "wf12m_conflict_r50_pfc03_filter04.yaml"))
    loss, opt = cfg["Loss"], cfg["Optimizer"]
    assert (loss["margin"], loss["scale"], loss["m3"]) == ("cosface", 64.0, 0.4)
    assert loss["interclass_filtering_threshold"] == 0.4 and loss["sample_ratio"] == 0.3
    assert loss["num_classes"] == 1017970
    assert cfg["Model"]["name"] == "IResNet50" and cfg["Model"]["embedding_size"] == 512
    assert (opt["name"], opt["lr"], opt["momentum"], opt["weight_decay"]) == \
        ("sgd", 0.1, 0.9, 5e-4)
    assert opt["grad_clip"] == 5.0 and cfg["Data"]["batch_size"] == 128
    assert cfg["Global"]["epochs"] == 20 and cfg["LRScheduler"]["warmup_epochs"] == 2
    assert cfg["AMP"]["enable"] and cfg["AMP"]["dtype"] == "float16"


def test_trainer_builds_the_head_with_the_threshold(tmp_path):
    from trainer_common import config, make_backbone, make_data
    from plsc.train import Trainer
    root = make_data(str(tmp_path / "data"))
    cfg = config(root, str(tmp_path / "out"),
                 Loss={"margin": "cosface", "m3": 0.35, "interclass_filtering_threshold": 0.3})
    trainer = Trainer(cfg, backbone=make_backbone())
    assert trainer.head.interclass_filtering_threshold == 0.3
    assert isinstance(trainer.head.margin, CosFace)
