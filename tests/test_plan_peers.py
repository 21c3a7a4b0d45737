"""Published capacities from the planner's own path (`plan`, the capacity search of every plan):
PLSC's 92M (ResNet50) and 88M (ResNet100) with plsc's head in PLSC's layout, and the Partial FC
paper's 29M with arcface_torch's head (`--peer`) in its layout, each within 15 %; the peer's
head terms in the plan are its counted arrays, and the gap to plsc's own head in that layout is
the [N, S] float32 arrays of the peer's backward (docs/scaling.md)."""
import os

import pytest

from plsc.config import load_config
from plsc.train.plan import plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLSC = ["Loss.sample_ratio=0.1", "Loss.param_dtype=float16", "Data.batch_size=64"]
PFC = ["Loss.sample_ratio=0.1", "Data.batch_size=128", "AMP.enable=true"]


def _cfg(path, overrides):
    return load_config(os.path.join(ROOT, path), overrides)


@pytest.mark.parametrize("path,published", [("configs/arcface_r50.yaml", 92e6),
                                            ("configs/cosface_r100.yaml", 88e6)])
def test_plsc_published_capacity(path, published):
    # PLSC's README: 92M classes (ResNet50), 88M (ResNet100), 8 x V100 32 GB, float16 centres
    cap = plan(_cfg(path, PLSC), 8, "v100-32gb").capacity
    assert abs(cap / published - 1) <= 0.15, cap


def test_partial_fc_capacity_by_the_peer_head_in_the_planner():
    """arcface_torch (v1: the code of its published table) on 8 V100s at 128 a GPU: within 15 %
    of 29M; its rank at the capacity holds the arrays counted by hand here (float32 weight and
    momentum [C, d], three [S, d], ten [N, S], two [N/8, S]) beside the same backbone terms."""
    cfg = _cfg("configs/arcface_r50.yaml", PFC)
    p = plan(cfg, 8, "v100-32gb", peer="arcface_torch_v1")
    assert abs(p.capacity / 29e6 - 1) <= 0.15, p.capacity
    assert p.total <= p.limit
    C = -(-cfg["Loss"]["num_classes"] // 8)
    S, N, d = int(0.1 * C), 1024, 512
    head = sum(v for k, v in p.memory.items() if k.startswith("head (backward)"))
    assert head == 4 * (2 * C * d + 3 * S * d + 10 * N * S + 2 * (N // 8) * S)
    own = plan(cfg, 8, "v100-32gb")
    for term in ("backbone parameters", "backbone gradients", "backbone activations",
                 "process (CUDA context)"):
        assert p.memory[term] == own.memory[term]
    # plsc's own head in that layout fits far more: one [N, S] float32 logits array, not ten
    assert own.capacity > 1.5 * p.capacity


def test_peer_refused_on_the_cpu_profile():
    with pytest.raises(ValueError, match="GPU"):
        plan(_cfg("configs/arcface_r50.yaml", PFC), 8, "cpu", peer="arcface_torch_v1")
