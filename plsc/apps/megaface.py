"""The MegaFace protocol (the task behind tools/eval_megaface.py): a probe set of known identities
(FaceScrub layout: identity folders, a `path label` list, or embeddings .npy) against a
distractor set (a list of image paths, or embeddings .npy), noise lists dropped, the figures of
plsc.metrics.megaface. Images are embedded (image + mirror) by all ranks, each a contiguous
share; the distractor blocks are shared by the ranks. Rank 0 prints the table and writes
`megaface_result.json`, `megaface_cmc.png` (CMC by rank), `megaface_rank1.png` (rank-1 by
distractor count), `megaface_roc.png` (and, with Logging.visualdl, the
figures and both images) to Global.output_dir."""
import os
import sys
import time

import numpy as np
import paddle

from .. import distributed as pd
from ..process import runtime
from ..parts import open_dataset
from ..data import DataError, ImagePathsDataset
from ..embedding import RankComm, gather_shares, rank_share, share_batches
from ..fileio import atomic_write, write_image, write_json, write_npy
from ..metrics.megaface import MEGAFACE_COUNTS, megaface_report
from ..metrics.plot import curve_image, roc_image
from .arrays import load_embeddings, load_labels
from .tasks import evaluation_model

__all__ = ["read_noise_list", "drop_noise", "load_set", "format_megaface_table", "evaluate_megaface"]


def read_noise_list(path):
    """The entries of a noise list (insightface's format: one path per line)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"noise list {path} does not exist")
    with open(path, encoding="utf-8", errors="replace") as f:
        return [line.strip().replace(os.sep, "/") for line in f if line.strip()]


def drop_noise(paths, noise):
    """A keep-mask of `paths`: False where a path is a listed entry or ends with '/' + one."""
    listed = set(noise)
    keep = []
    for p in paths:
        parts = p.replace(os.sep, "/").split("/")
        keep.append(not any("/".join(parts[i:]) in listed for i in range(len(parts))))
    return np.array(keep, bool)


def _embed_dataset(model, ds, batch_size, num_workers):
    """[N, d] float32 embeddings (image + mirror) of `ds`, each rank a contiguous share, gathered."""
    n = len(ds)
    start, stop, _ = rank_share(n)
    parts = []
    with paddle.no_grad():
        for images, _ in share_batches(ds, n, int(batch_size), int(num_workers)):
            x = images if isinstance(images, paddle.Tensor) else paddle.to_tensor(images)
            parts.append((model(x) + model(paddle.flip(x, [3]))).astype("float32").numpy())
    dim = parts[0].shape[1] if parts else int(model(paddle.zeros([1] + list(ds[0][0].shape))).shape[1])
    local = np.concatenate(parts) if parts else np.zeros((0, dim), np.float32)
    return gather_shares(local, n)


def load_set(cfg, source, role, model_box):
    """(embeddings, labels or None, paths or None) of the probe (`role` 'probes') or distractor
    set `source`: a .npy (labels `<stem>_labels.npy`, needed for probes; paths `<stem>_paths.txt`
    when it exists), or images embedded by the model `model_box()` returns."""
    if source.endswith(".npy"):
        x = load_embeddings(source, what=f"{role[:-1]} embeddings")
        stem = source[:-4]
        labels = load_labels(stem + "_labels.npy", len(x)) if role == "probes" else None
        paths = None
        if os.path.isfile(stem + "_paths.txt"):
            with open(stem + "_paths.txt", encoding="utf-8") as f:
                paths = [line.rstrip("\n") for line in f]
            if len(paths) != len(x):
                raise DataError(f"{stem}_paths.txt: {len(paths)} paths for {len(x)} embeddings")
        return x, labels, paths
    if not os.path.exists(source):
        raise FileNotFoundError(f"{role} {source} does not exist (expected "
                                + ("an identity folder, a 'path label' list or a .npy)" if role == "probes"
                                   else "a list of image paths, one a line, or a .npy)"))
    cfg, model = model_box()
    size = tuple(cfg["Data"]["image_size"])
    if role == "probes":
        ds, _ = open_dataset("auto", source, size, train=False, what="--probes")
    else:
        ds = ImagePathsDataset(source, image_size=size)
    if len(ds) == 0:
        raise DataError(f"{source}: no images")
    x = _embed_dataset(model, ds, cfg["Eval"]["batch_size"], cfg["Data"]["num_workers"])
    return x, (np.asarray(ds.labels) if role == "probes" else None), list(ds.paths)


def format_megaface_table(result):
    """Rank-1 per distractor count, the CMC and TAR at FAR, in percent."""
    lines = [f"MegaFace: {result['num_probes']} probes ({result['searches']} searches), "
             f"{result['num_distractors']} distractors",
             f"{'distractors':<12}" + "".join(f"{c:>10}" for c in result["counts"]),
             f"{'rank-1 (%)':<12}" + "".join(f"{100 * v:>10.2f}" for v in result["counts"].values()),
             "CMC (%, all distractors): " + "  ".join(f"rank{r} {100 * v:.2f}" for r, v in result["cmc"].items()
                                                     if int(r) in (1, 2, 5, 10)),
             "verification: " + "  ".join(f"TAR@FAR={k} {100 * v['tar']:.2f}% (threshold {v['threshold']:.4f})"
                                         for k, v in result["tar_at_far"].items())]
    return "\n".join(lines)


def _png(path, rgb):
    write_image(path, np.ascontiguousarray(rgb[:, :, ::-1]), ext=".png")


def evaluate_megaface(cfg, probes, distractors, probe_noise=None, distractor_noise=None,
                      counts=MEGAFACE_COUNTS, fars=(1e-6,), save_embeddings=None, onnx=None,
                      onnx_input="rgb", out=None, step=0):
    """Run the protocol (see the module); returns the result on every rank."""
    out = sys.stdout if out is None else out
    runtime.start(cfg)
    (p, labels, p_paths), (d, d_paths), dropped = _load_sets(
        cfg, probes, distractors, probe_noise, distractor_noise, onnx, onnx_input)
    rank0 = pd.get_rank() == 0
    if save_embeddings and rank0:
        _save_embeddings(save_embeddings, p, labels, p_paths, d, d_paths)
    t0 = time.perf_counter()
    try:
        report = megaface_report(p, labels, d, counts, fars, comm=RankComm())
    except ValueError as err:
        raise DataError(f"{probes} / {distractors}: {err}") from None
    seconds = time.perf_counter() - t0
    far, tar = report.pop("roc")
    result = {"num_probes": len(p), "num_distractors": len(d), "dropped_as_noise": dropped,
              "searches": report["searches"], "genuine_pairs": report["genuine_pairs"],
              "impostor_pairs": report["impostor_pairs"],
              "counts": {str(c): v for c, v in report["counts"].items()},
              "cmc": {str(r): v for r, v in report["cmc"].items()},
              "tar_at_far": {format(f, "g"): v for f, v in report["tar_at_far"].items()},
              "scan_seconds": seconds, "world_size": pd.get_world_size()}
    if rank0:
        _write_outputs(cfg, result, far, tar, step, out)
    return result


def _load_sets(cfg, probes, distractors, probe_noise, distractor_noise, onnx, onnx_input):
    """((probe embeddings, labels, paths), (distractor embeddings, paths), {set: rows dropped})
    with the rows of the noise lists left out (paths None where unknown)."""
    holder = {}

    def model_box():
        if "m" not in holder:
            holder["m"] = evaluation_model(cfg, None, onnx, onnx_input)
        return holder["m"]

    p, labels, p_paths = load_set(cfg, probes, "probes", model_box)
    d, _, d_paths = load_set(cfg, distractors, "distractors", model_box)
    dropped = {}
    for name, noise, paths in (("probes", probe_noise, p_paths), ("distractors", distractor_noise, d_paths)):
        if noise:
            if paths is None:
                raise DataError(f"{probes if name == 'probes' else distractors}: a noise list needs the "
                                "paths of the rows (images, or <stem>_paths.txt beside the .npy)")
            keep = drop_noise(paths, read_noise_list(noise))
            dropped[name] = int((~keep).sum())
            if name == "probes":
                p, labels, p_paths = p[keep], labels[keep], [q for q, k in zip(p_paths, keep) if k]
            else:
                d, d_paths = d[keep], [q for q, k in zip(d_paths, keep) if k]
    return (p, labels, p_paths), (d, d_paths), dropped


def _save_embeddings(save_embeddings, p, labels, p_paths, d, d_paths):
    """`<save_embeddings>_{probes,distractors}.npy` (with their paths) and the probe labels."""
    for name, x, paths in (("probes", p, p_paths), ("distractors", d, d_paths)):
        write_npy(f"{save_embeddings}_{name}.npy", x)
        if paths is not None:
            atomic_write(f"{save_embeddings}_{name}_paths.txt", "".join(q + "\n" for q in paths))
    write_npy(f"{save_embeddings}_probes_labels.npy", labels)


def _write_outputs(cfg, result, far, tar, step, out):
    """Rank 0: the result's JSON, its CMC, rank-1 and ROC plots (also to VisualDL) and its
    table on `out`."""
    out_dir = cfg["Global"]["output_dir"]
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, "megaface")
    cmc_img = curve_image({"CMC": ([int(r) for r in result["cmc"]], list(result["cmc"].values()))},
                          "rank", "identification rate")
    rank1_img = curve_image({"rank-1": ([int(c) for c in result["counts"]],
                                        list(result["counts"].values()))},
                            "distractors", "rank-1", log_x=True)
    roc_img = roc_image({"MegaFace": (far, tar)}, far_min=10.0 ** np.floor(np.log10(far[far > 0].min()))
                        if (far > 0).any() else 1e-6)
    write_json(stem + "_result.json", result)
    _png(stem + "_cmc.png", cmc_img)
    _png(stem + "_rank1.png", rank1_img)
    _png(stem + "_roc.png", roc_img)
    if cfg["Logging"]["visualdl"]:
        from visualdl import LogWriter
        with LogWriter(logdir=os.path.join(out_dir, "vdl"), filename_suffix=f".megaface.{os.getpid()}") as w:
            for c, v in result["counts"].items():
                w.add_scalar(tag=f"megaface/rank1_at_{c}", value=float(v), step=int(step))
            for f, v in result["tar_at_far"].items():
                w.add_scalar(tag=f"megaface/tar_at_far_{f}", value=float(v["tar"]), step=int(step))
            w.add_image(tag="megaface/cmc", img=cmc_img, step=int(step))
            w.add_image(tag="megaface/rank1", img=rank1_img, step=int(step))
            w.add_image(tag="megaface/roc", img=roc_img, step=int(step))
    out.write(format_megaface_table(result) + f"\nresults: {stem}_result.json, {stem}_cmc.png, "
              f"{stem}_rank1.png, {stem}_roc.png\n")
