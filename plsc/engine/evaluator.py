"""Verification during and after training: embeddings (+ flips) of each pack, split across ranks."""
import os

import numpy as np
import paddle

from ..data import load_verification_arrays
from ..distributed import gather_concat, get_rank, get_world_size
from ..metrics import verification_report

__all__ = ["VerificationEvaluator", "extract_embeddings"]


def extract_embeddings(model, data, batch_size):
    """Embeddings of `data` (N, 3, H, W) and of its horizontal flips, each rank doing
    a contiguous share; every rank returns all N rows of both."""
    rank, world = get_rank(), get_world_size()
    n = len(data)
    share = -(-n // world)
    mine = data[rank * share:(rank + 1) * share]
    outs, flips = [], []
    was_training = model.training
    model.eval()
    with paddle.no_grad():
        dim = int(model(paddle.to_tensor(np.ascontiguousarray(data[:1]))).shape[1])
        for i in range(0, share, batch_size):
            batch = mine[i:i + batch_size]
            if len(batch) == 0:
                break
            x = paddle.to_tensor(np.ascontiguousarray(batch))
            outs.append(model(x).astype("float32").numpy())
            flips.append(model(paddle.flip(x, axis=[3])).astype("float32").numpy())
    if was_training:
        model.train()

    def collect(parts):
        local = np.concatenate(parts) if parts else np.zeros((0, dim), np.float32)
        if world == 1:
            return local
        padded = np.zeros((share, dim), np.float32)
        padded[:len(local)] = local
        return gather_concat(paddle.to_tensor(padded)).numpy()[:n]

    return collect(outs), collect(flips)


class VerificationEvaluator:
    """Evaluates `<root>/<target>.bin` for each target; packs are decoded once."""

    def __init__(self, root, targets, image_size, batch_size):
        self.root, self.targets = root, list(targets)
        self.image_size, self.batch_size = tuple(image_size), int(batch_size)
        self._packs = {}
        for target in self.targets:
            path = self.path(target)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"verification pack {path} does not exist (Eval.root="
                                        f"{root}, target {target!r})")

    def path(self, target):
        return os.path.join(self.root, f"{target}.bin")

    def __call__(self, model, with_roc=False):
        """{target: report} (see plsc.metrics.verification_report), on every rank."""
        reports = {}
        for target in self.targets:
            if target not in self._packs:
                self._packs[target] = load_verification_arrays(self.path(target), self.image_size)
            data, issame = self._packs[target]
            emb, flipped = extract_embeddings(model, data, self.batch_size)
            reports[target] = verification_report(emb, issame, flipped, with_roc=with_roc)
        return reports
