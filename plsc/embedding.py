"""Embeddings by all ranks together, and verification on them (during training and by the
tools): each rank embeds a contiguous share of the images and the shares are gathered."""
import contextlib
import os

import numpy as np
import paddle

from .data import (DataError, DataLoader, PeerDataError, load_verification_arrays,
                   read_verification_bin)
from .distributed import failed_rank, gather_concat, get_rank, get_world_size
from .metrics import FOLDS, verification_report

__all__ = ["VerificationEvaluator", "extract_embeddings", "embed", "embedding_size", "rank_share",
           "gather_shares", "share_batches", "RankComm"]


def rank_share(n):
    """(start, stop) of this rank's contiguous share of `n` items, rank r taking
    [r·⌈n/k⌉, (r+1)·⌈n/k⌉) clipped to n, and the share size ⌈n/k⌉."""
    rank, world = get_rank(), get_world_size()
    share = -(-n // world)
    return min(n, rank * share), min(n, (rank + 1) * share), share


class RankComm:
    """The launched ranks as the `comm` of plsc.metrics.scan: `sum`, `max` (float64, element-
    wise) and `concat` (1-D arrays of any length, in rank order) over all ranks."""

    def __init__(self):
        self.rank, self.world = get_rank(), get_world_size()

    def _reduce(self, a, op):
        from .distributed import all_reduce_
        a = np.asarray(a)
        if self.world == 1:
            return a
        t = paddle.to_tensor(a.astype(np.float64).reshape(-1))
        return all_reduce_(t, op).numpy().reshape(a.shape).astype(a.dtype)

    def sum(self, a):
        return self._reduce(a, "sum")

    def max(self, a):
        return self._reduce(a, "max")

    def concat(self, a):
        a = np.asarray(a).reshape(-1)
        if self.world == 1:
            return a
        sizes = gather_concat(paddle.to_tensor(np.array([len(a)], np.int64))).numpy()
        padded = np.zeros(max(1, int(sizes.max())), a.dtype)
        padded[:len(a)] = a
        every = gather_concat(paddle.to_tensor(padded)).numpy().reshape(self.world, -1)
        return np.concatenate([every[r, :sizes[r]] for r in range(self.world)])


def share_batches(dataset, n, batch_size, num_workers=0):
    """The batches of this rank's share (see `rank_share`) of samples [0, n) of `dataset`, in
    order, loaded by `num_workers` processes. Every rank goes through the same number of rounds
    and after each load learns whether any rank failed: a DataError on one rank stops all of
    them there (`PeerDataError` on the others) instead of leaving them in the next collective."""
    start, stop, share = rank_share(n)
    loader = DataLoader.sequential(dataset, batch_size, start, stop, num_workers=num_workers)
    rank = get_rank()
    with contextlib.closing(iter(loader)) as batches:
        for _ in range(-(-share // batch_size)):
            batch, error = None, None
            try:
                batch = next(batches, None)
            except DataError as err:
                error = err
            failed = failed_rank(error is not None)
            if failed >= 0:
                raise error if error is not None else PeerDataError(rank, failed, "while loading "
                                                                    "its share of the images")
            if batch is not None:
                yield batch


def gather_shares(local, n, chunk_rows=1 << 16):
    """The `n` rows of all ranks' shares (`local`: this rank's rows, numpy, at most ⌈n/k⌉ of
    them; zero-padded to that) concatenated in rank order, on every rank, gathered
    `chunk_rows` rows a rank at a time."""
    world = get_world_size()
    if world == 1:
        return local[:n]
    share = rank_share(n)[2]
    padded = np.zeros((share,) + local.shape[1:], local.dtype)
    padded[:len(local)] = local
    out = np.empty((world, share) + local.shape[1:], local.dtype)
    for lo in range(0, share, chunk_rows):
        hi = min(lo + chunk_rows, share)
        part = gather_concat(paddle.to_tensor(padded[lo:hi])).numpy()
        out[:, lo:hi] = part.reshape((world, hi - lo) + local.shape[1:])
    return out.reshape((world * share,) + local.shape[1:])[:n]


def embedding_size(model, image_size):
    """The width of `model`'s embeddings of `image_size` images (one zero image through it)."""
    with paddle.no_grad():
        return int(model(paddle.zeros([1, 3] + [int(v) for v in image_size])).shape[1])


def embed(model, images, batch_size=128, flip=False):
    """Embeddings (float32 numpy) of a float32 [N, 3, H, W] array, batch by batch, in eval
    mode; with `flip`, plus those of the horizontal flips."""
    emb = _embed(model, images, batch_size)
    return emb + _embed(model, images[..., ::-1], batch_size) if flip else emb


def _embed(model, images, batch_size):
    was_training = model.training
    model.eval()
    outs = []
    with paddle.no_grad():
        for i in range(0, len(images), batch_size):
            x = paddle.to_tensor(np.ascontiguousarray(images[i:i + batch_size]))
            outs.append(model(x).astype("float32").numpy())
    if was_training:
        model.train()
    return np.concatenate(outs) if outs else np.zeros((0, 0), np.float32)


def extract_embeddings(model, data, batch_size):
    """Embeddings of `data` (N, 3, H, W) and of its horizontal flips, each rank doing
    a contiguous share; every rank returns all N rows of both."""
    n = len(data)
    start, stop, _ = rank_share(n)
    mine = data[start:stop]
    dim = _embed(model, data[:1], 1).shape[1]  # known even to a rank whose share is empty

    def collect(local):
        return gather_shares(local.reshape(-1, dim), n)

    return collect(_embed(model, mine, batch_size)), collect(_embed(model, mine[..., ::-1], batch_size))


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
            # before any step; read again (decoded) at the first evaluation: keeping the
            # encoded bytes instead would hold every pack (50-90 MB each) through training
            pairs = len(read_verification_bin(path, decode=False)[1])
            if pairs < FOLDS:
                raise DataError(f"{path}: {pairs} pairs, expected at least {FOLDS} (the "
                                f"verification accuracy is {FOLDS}-fold)")

    def path(self, target):
        return os.path.join(self.root, f"{target}.bin")

    def __call__(self, model, with_roc=False):
        """{target: report} (see plsc.metrics.verification_report), on every rank; a target
        whose embeddings (or their flips') are not all finite gets `{"accuracy": None,
        "nonfinite": rows not finite, "embeddings": rows}` instead."""
        reports = {}
        for target in self.targets:
            if target not in self._packs:
                self._packs[target] = load_verification_arrays(self.path(target), self.image_size)
            data, issame = self._packs[target]
            emb, flipped = extract_embeddings(model, data, self.batch_size)
            bad = int((~np.isfinite(emb)).any(axis=1).sum() + (~np.isfinite(flipped)).any(axis=1).sum())
            if bad:  # no accuracy of embeddings that are not numbers
                reports[target] = {"accuracy": None, "nonfinite": bad, "embeddings": 2 * len(emb)}
                continue
            reports[target] = verification_report(emb, issame, flipped, with_roc=with_roc)
        return reports
