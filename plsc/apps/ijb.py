"""IJB-B / IJB-C template verification of a trained backbone (the task behind tools/eval_ijb.py).

Images are read, aligned and embedded (plus their mirror images) a batch at a time,
each rank doing a contiguous share; only the [num_images, d] features are kept
and gathered. Rank 0 prints TAR@FAR and AUC and writes, under Global.output_dir,
`<target>_result.json`, `<target>_scores.npy`, `<target>_roc.png` with the target in
lower case (`ijbc_result.json`, ...) and (with Logging.visualdl) the ROC image and the figures to `vdl/`.
"""
import os
import sys

import numpy as np
import paddle

from .. import distributed as pd
from ..data import DataError, FaceTransform, IJBFaceDataset, check_ijb_images, read_ijb_meta
from ..metrics import FAR_TARGETS, ijb_report, roc_image, save_roc_png
from ..embedding import embedding_size, gather_shares, rank_share, share_batches
from ..fileio import write_json, write_npy
from ..process import runtime
from ..process.progress import progress as draw_progress, show_progress
from .arrays import load_npy
from .tasks import evaluation_model

__all__ = ["extract_ijb_features", "load_ijb_features", "save_ijb_features", "ijb_features",
           "format_ijb_table", "evaluate_ijb"]


def extract_ijb_features(model, meta, image_size, batch_size, num_workers=0, progress=False):
    """[N, d] float32 features of the images of `meta` (in name_5pts_score order) on every
    rank: embedding of the aligned face + that of its mirror image, not normalised.

    Each rank reads, aligns (in `num_workers` DataLoader workers) and embeds the
    contiguous share ``[r·⌈N/k⌉, (r+1)·⌈N/k⌉)`` one batch at a time; the shares are
    all-gathered. `progress` draws a bar of this rank's share.
    """
    rank, n = pd.get_rank(), meta.num_images
    start, stop, _ = rank_share(n)
    was_training = model.training
    model.eval()
    dim = embedding_size(model, image_size)
    local = np.zeros((stop - start, dim), np.float32)
    dataset = IJBFaceDataset(meta, image_size, 0, n)
    transform = FaceTransform(image_size, train=False, output="uint8")
    done = 0
    with paddle.no_grad():
        for images, index in share_batches(dataset, n, int(batch_size), int(num_workers)):
            x = transform.normalize(images)
            emb = model(x) + model(paddle.flip(x, [3]))
            local[index.numpy().reshape(-1) - start] = emb.astype("float32").numpy()
            done += int(index.shape[0])
            draw_progress(done, stop - start, progress, f"{meta.target} rank {rank}: ")
    if was_training:
        model.train()
    return gather_shares(local, n)


def load_ijb_features(path, meta):
    """Features saved by `save_ijb_features` ([N, d] float32, N = the images of `meta`)."""
    feats = load_npy(path, "features")
    if feats.ndim != 2 or len(feats) != meta.num_images or not np.issubdtype(feats.dtype, np.floating):
        raise DataError(f"{path}: features of shape {feats.shape} ({feats.dtype}), expected "
                        f"[{meta.num_images}, d] floats: one row per line of "
                        f"{meta.paths['name_5pts_score']}")
    return feats.astype(np.float32, copy=False)


def save_ijb_features(path, features):
    """Write [N, d] float32 features to `path` (.npy) under a temporary name, then rename."""
    write_npy(path, np.asarray(features, np.float32))
    return path


def ijb_features(cfg, meta, features=None, save_features=None, backbone=None, progress=None,
                 onnx=None, onnx_input="rgb"):
    """The [N, d] image features of `meta` on every rank: read from `features` (.npy), or
    extracted by all ranks (see `evaluate_ijb`); rank 0 saves them to `save_features`."""
    if features is not None:
        feats = load_ijb_features(features, meta)
    else:
        check_ijb_images(meta)
        cfg, model = evaluation_model(cfg, backbone, onnx, onnx_input)
        show = show_progress(progress, cfg["Logging"]["progress_bar"], pd.get_rank())
        feats = extract_ijb_features(model, meta, cfg["Data"]["image_size"], cfg["Eval"]["batch_size"],
                                     cfg["Data"]["num_workers"], progress=show)
    if save_features and pd.get_rank() == 0:
        save_ijb_features(save_features, feats)
    return feats


def format_ijb_table(result):
    """The TAR at each FAR and the AUC of a result (see `evaluate_ijb`), in percent."""
    fars = list(result["tar_at_far"])
    head = f"{'FAR':<10}" + "".join(f"{format(float(f), 'g'):>9}" for f in fars) + f"{'AUC':>9}"
    row = f"{'TAR (%)':<10}" + "".join(f"{100 * result['tar_at_far'][f]:>9.2f}" for f in fars) + \
        f"{100 * result['auc']:>9.2f}"
    return "\n".join([f"{result['target']}: {result['num_images']} images, {result['num_templates']} "
                      f"templates, {result['num_pairs']} pairs", head, row])


def _log_visualdl(logdir, result, image, step):
    from visualdl import LogWriter  # imported lazily: it is slow to import
    t = result["target"].lower()
    # its own record file (VisualDL names files by the second): a run may be training there
    with LogWriter(logdir=logdir, filename_suffix=f".ijb.{os.getpid()}") as writer:
        for far, tar in result["tar_at_far"].items():
            writer.add_scalar(tag=f"ijb/{t}/tar_at_far_{far}", value=float(tar), step=step)
        writer.add_scalar(tag=f"ijb/{t}/auc", value=float(result["auc"]), step=step)
        writer.add_image(tag=f"ijb/{t}/roc", img=image, step=step)


def evaluate_ijb(cfg, root, target, features=None, save_features=None, detector_score=True,
                 normalize_images=False, backbone=None, out=None, progress=None, step=0, onnx=None,
                 onnx_input="rgb"):
    """1:1 template verification of `target` ('IJBC' or 'IJBB') under `root` (the folder
    with meta/ and loose_crop/).

    Image features come from `features` (a .npy written by `save_features`) or from
    the config's trained backbone (Global.checkpoint / Global.pretrained) at
    Data.image_size, Eval.batch_size, Data.num_workers, or from the ONNX file `onnx` fed as
    `onnx_input` says (`plsc.apps.onnx_backbone`; its fixed input size replaces
    Data.image_size). `detector_score` weights each image by its detector score,
    `normalize_images` L2-normalises image features first. `progress`: a bar of rank 0's
    share on stderr (default: Logging.progress_bar and stderr is a terminal); `step`: the
    VisualDL step. Returns (on every rank) the result: target, num_images, num_templates,
    num_pairs, tar_at_far {str(FAR): TAR}, auc, the options, and the arrays scores, far, tar.
    """
    out = sys.stdout if out is None else out
    runtime.start(cfg)
    meta = read_ijb_meta(root, target)
    rank0 = pd.get_rank() == 0
    feats = ijb_features(cfg, meta, features, save_features, backbone, progress, onnx, onnx_input)
    report = ijb_report(feats, meta.templates, meta.medias, meta.pairs, meta.labels,
                        meta.det_scores if detector_score else None, normalize_images, FAR_TARGETS)
    result = {"target": meta.target.upper(), "num_images": meta.num_images,
              "num_templates": report["num_templates"], "num_pairs": meta.num_pairs,
              "tar_at_far": {str(float(k)): v for k, v in report["tar_at_far"].items()},
              "auc": report["auc"], "detector_score": bool(detector_score),
              "normalize_images": bool(normalize_images)}
    if rank0:
        out_dir = cfg["Global"]["output_dir"]
        os.makedirs(out_dir, exist_ok=True)
        stem = os.path.join(out_dir, meta.target.lower())
        curves = {meta.target.upper(): (report["far"], report["tar"])}
        write_json(stem + "_result.json", result)
        write_npy(stem + "_scores.npy", report["scores"])
        save_roc_png(curves, stem + "_roc.png", far_min=1e-6)
        if cfg["Logging"]["visualdl"]:
            _log_visualdl(os.path.join(out_dir, "vdl"), result, roc_image(curves, far_min=1e-6), int(step))
        out.write(format_ijb_table(result) + "\n")
        out.write(f"results: {stem}_result.json, {stem}_scores.npy, {stem}_roc.png\n")
        if save_features:
            out.write(f"features: {save_features}\n")
    return dict(result, scores=report["scores"], far=report["far"], tar=report["tar"])
