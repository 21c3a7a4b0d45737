"""Cleaning a noisy training set with a sub-centre head (Deng et al., "Sub-center ArcFace", ECCV 2020).

A head trained with `Loss.sub_centers: K` keeps K centres per class; clean samples gather
around one of them (the class's *dominant* centre) while mislabeled samples and outliers
sit on the others or far from all. `clean_subcenters` reads such a checkpoint and the
training set and:

1. embeds every training image with the checkpoint's backbone, read without augmentation
   (`train=False`: no random flip, the image alone; not the image + flip sum the
   verification uses: a sample is judged in the view its class centre was trained on),
   each rank a contiguous share of the set, batched (`Eval.batch_size`) through a
   DataLoader (`Data.num_workers`);
2. for each sample, the cosine to each of its labelled class's K centres: each rank streams
   the centres of the classes its share holds a slab of classes at a time (memory-mapped
   `load_head_rows`), and for each sample gathers only its own class's K rows;
3. on rank 0 (the `[N, K]` cosines gathered there): each sample *picks* the centre of largest
   cosine; a class's dominant centre is the one most of its samples pick (ties: the lowest
   index; a class without samples keeps centre 0); a sample's angle is the arccos of its
   cosine to its class's dominant centre (L2-normalised embedding and centre), in degrees;
   it is kept when the angle is at most `threshold`;
4. writes to `out_dir`:
   - `train_clean.lst`, the kept samples: for a list or folder source `path label` lines
     (absolute paths), read by `Data.dataset: list` and by `tools/pack_rec.py`; for a
     RecordIO source `key label` lines (the records' keys in the source `.rec`, with a `#`
     header naming it) and, unless `write_rec=False`, the kept records copied (bytes as
     they are, no re-encoding) into `out_dir/rec/train.rec`, `.idx` and `property`
     (`Data.dataset: recordio`, same classes);
   - `dropped.lst`, the dropped samples, the same lines plus a third column, the angle;
   - `summary.json`: samples and classes kept/dropped, the threshold, dominance statistics
     of the centres, the angle histogram (2-degree bins);
   - `angles.png`, the histogram with the threshold marked (and, with `Logging.visualdl`,
     the histogram and the image in VisualDL under `out_dir/vdl`);
   - `checkpoint_k1/`, a checkpoint with one centre per class, the dominant one (as stored:
     the same dtype and bits), the head optimizer's state of the weight zeroed, the backbone,
     its optimizer and LR schedule as they were; meta.json `sub_centers: 1` and
     `config.Loss.sub_centers: 1`. Training continues from it with
     `-o Global.checkpoint=<out>/checkpoint_k1 -o Loss.sub_centers=1 -o Data.dataset=list
     -o Data.root=<out>/train_clean.lst` (and a `Global.max_steps` beyond its step: the step
     count and LR schedule go on). Its position in the data restarts at the beginning of an
     epoch (the next one when the source checkpoint was mid-epoch): the cleaned set is a new
     set, a position in the old one means nothing in it. It is written to a temporary
     folder and renamed. RNG states are not carried over (the resumed run seeds anew).

When `out_dir` lies in the run's folder (`Global.output_dir`, the default), that folder is
locked for the whole cleaning (`plsc.checkpoint.lock`): it is refused (`FolderInUse`, exit
status 73) while a training job or another cleaning uses the folder.
"""
import contextlib
import copy
import os
import sys

import numpy as np
import paddle

from .. import distributed as pd
from ..process import runtime
from ..parts import open_dataset
from ..checkpoint import (agree_checkpoint, head_dtype, load_head_rows, read_meta, rows_as_float32,
                          write_k1_checkpoint)
from ..checkpoint.lock import claim_folder
from ..config import ConfigError
from ..data import irheader
from ..data.facerec import read_property, write_face_rec
from ..embedding import gather_shares, rank_share, share_batches
from ..fileio import AtomicWriter, commit_folder, temp_folder, write_json
from ..metrics import angle_histogram_image, save_angle_histogram_png
from ..kernels.numerics import SLAB_BYTES
from ..process.progress import progress as draw_progress, show_progress

__all__ = ["clean_subcenters", "source_dataset", "subcenter_cosines", "dominant_centres",
           "angles_to_dominant", "HIST_BIN_DEGREES"]

HIST_BIN_DEGREES = 2.0
_SAMPLE_CHUNK = 4096  # samples whose [chunk, K, d] class rows are gathered at once


def source_dataset(cfg):
    """The config's training set (Data.dataset, Data.root) read without augmentation, in
    order, as normalised float32 images: (dataset, kind) with kind recordio, folder or list."""
    d = cfg["Data"]
    return open_dataset(d["dataset"], d["root"], d["image_size"], train=False,
                                num_classes=cfg["Loss"]["num_classes"])


def _embed_share(model, ds, n, batch_size, num_workers, progress):
    """Embeddings (float32) and labels of this rank's share of samples [0, n) of `ds`."""
    start, stop, _ = rank_share(n)
    embeddings, labels = [], []
    with paddle.no_grad():
        for images, batch_labels in share_batches(ds, n, batch_size, num_workers):
            embeddings.append(model(images).astype("float32").numpy())
            labels.append(batch_labels.numpy().reshape(-1).astype(np.int64))
            draw_progress(sum(map(len, labels)), stop - start, progress, "embedding ")
    if not embeddings:
        return None, np.zeros([0], np.int64)
    return np.concatenate(embeddings), np.concatenate(labels)


def _normalize(x, axis=-1):
    return x / np.maximum(np.linalg.norm(x, axis=axis, keepdims=True), 1e-12)


def subcenter_cosines(path, meta, embeddings, labels):
    """`[n, K]` cosines of each embedding to the K centres of its labelled class, read from
    checkpoint `path` a slab of classes at a time (only the class ranges `labels` span).
    `embeddings` (float32) are L2-normalised in place."""
    k = int(meta.get("sub_centers", 1))
    dtype = head_dtype(path, "weight", meta)
    out = np.zeros((len(labels), k), np.float32)
    if not len(labels):
        return out
    x = embeddings.astype(np.float32, copy=False)
    x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    order = np.argsort(labels, kind="stable")
    ordered = labels[order]
    per_class = k * int(meta["embedding_size"]) * 4
    window = max(1, SLAB_BYTES // per_class)
    i = 0
    while i < len(order):
        lo = int(ordered[i])
        hi = min(lo + window, int(ordered[-1]) + 1)
        j = int(np.searchsorted(ordered, hi, side="left"))
        rows = rows_as_float32(load_head_rows(path, "weight", lo, hi - lo, meta), dtype)
        centres = _normalize(rows.reshape(hi - lo, k, -1))
        for a in range(i, j, _SAMPLE_CHUNK):
            idx = order[a:min(a + _SAMPLE_CHUNK, j)]
            out[idx] = np.einsum("nd,nkd->nk", x[idx], centres[labels[idx] - lo])
        i = j
    return np.clip(out, -1.0, 1.0)


def dominant_centres(labels, picks, num_classes, k):
    """`(dominant [C], counts [C, K])`: how many of each class's samples pick each centre, and
    the centre most pick (ties and classes without samples: the lowest index)."""
    counts = np.bincount(labels * k + picks, minlength=num_classes * k).reshape(num_classes, k)
    return counts.argmax(axis=1), counts


def angles_to_dominant(cosines, labels, dominant):
    """Degrees between each sample and its class's dominant centre."""
    cos = cosines[np.arange(len(labels)), dominant[labels]]
    return np.degrees(np.arccos(np.clip(cos, -1.0, 1.0)))


def _write_lists(out_dir, ds, kind, labels, angles, kept):
    """train_clean.lst and dropped.lst; returns their paths."""
    if kind == "recordio":
        names = [str(int(key)) for key in ds.keys]
        header = f"# keys of the records of {os.path.abspath(ds.reader.rec_path)} (key label)\n"
    else:
        names = [os.path.abspath(p) for p in ds.paths]
        header = ""
    clean, dropped = os.path.join(out_dir, "train_clean.lst"), os.path.join(out_dir, "dropped.lst")
    for path, select, with_angle in ((clean, kept, False), (dropped, ~kept, True)):
        with AtomicWriter(path) as f:
            f.write(header)
            for i in np.flatnonzero(select):
                extra = f" {angles[i]:.2f}" if with_angle else ""
                f.write(f"{names[i]} {labels[i]}{extra}\n")
    return clean, dropped


def _write_clean_rec(out_dir, ds, labels, kept, num_classes, image_size):
    """The kept records of a RecordIO source, copied as they are into `out_dir` (`property`:
    the source's image size when it has one, else `image_size`)."""
    keys = ds.keys[kept]
    prop = os.path.join(os.path.dirname(ds.reader.rec_path), "property")
    if os.path.isfile(prop):
        image_size = read_property(prop)[1:]

    def images():
        for key in keys:
            yield bytes(irheader.unpack(ds.reader.read(int(key)))[1])

    tmp = temp_folder(out_dir)
    write_face_rec(tmp, labels[kept], images(), tuple(image_size), num_classes=num_classes)
    return commit_folder(tmp, out_dir)


def _summary(path, meta, threshold, labels, picks, counts, dominant, angles, kept, kind, root):
    n, num_classes = len(labels), counts.shape[0]
    k = counts.shape[1]
    per_class = counts.sum(axis=1)
    kept_per_class = np.bincount(labels[kept], minlength=num_classes)
    has = per_class > 0
    on_dominant = picks == dominant[labels]
    share = counts[np.arange(num_classes), dominant][has] / per_class[has]
    edges = np.arange(0.0, 180.0 + HIST_BIN_DEGREES, HIST_BIN_DEGREES)

    def stats(a):
        return ({"mean": float(a.mean()), "median": float(np.median(a)), "min": float(a.min()),
                 "max": float(a.max())} if len(a) else None)

    return {
        "checkpoint": os.path.abspath(path), "step": meta.get("step"), "sub_centers": k,
        "threshold_degrees": float(threshold), "source": {"dataset": kind, "root": root},
        "samples": n, "samples_kept": int(kept.sum()), "samples_dropped": int(n - kept.sum()),
        "kept_fraction": float(kept.mean()) if n else 0.0,
        "classes": int(num_classes), "classes_with_samples": int(has.sum()),
        "classes_kept": int((kept_per_class > 0).sum()),
        "classes_dropped": int((has & (kept_per_class == 0)).sum()),
        "dominance": {
            "classes_by_dominant_centre": np.bincount(dominant[has], minlength=k).tolist(),
            "samples_by_picked_centre_rank": _picked_rank_counts(counts[has]),
            "samples_picking_dominant": int(on_dominant.sum()),
            "samples_picking_other": int(n - on_dominant.sum()),
            "class_dominant_share": stats(share),
            "angles_picking_dominant": stats(angles[on_dominant]),
            "angles_picking_other": stats(angles[~on_dominant]),
        },
        "angles": {"all": stats(angles), "kept": stats(angles[kept]), "dropped": stats(angles[~kept])},
        "angle_histogram": {"bin_edges_degrees": edges.tolist(),
                            "counts": np.histogram(angles, edges)[0].tolist()},
    }


def _picked_rank_counts(counts):
    """Samples on each class's most, second most, ... picked centre (summed over classes)."""
    return np.sort(counts, axis=1)[:, ::-1].sum(axis=0).astype(int).tolist()


def clean_subcenters(cfg, checkpoint=None, threshold=75.0, out_dir=None, progress=None,
                     write_rec=True, backbone=None):
    """Clean the config's training set with the K-centre checkpoint `checkpoint` ('latest',
    'auto' or a folder; default Global.checkpoint, else 'latest'); see the module's
    docstring. Rank 0 writes the outputs and returns the summary (summary.json's content and,
    under "arrays", the per-sample labels, picked centres, angles and kept mask and the
    per-class dominant centres); the other ranks return None."""
    bad = f"the threshold must be an angle in degrees in (0, 180), got {threshold!r}"
    try:
        threshold = float(threshold)
    except (TypeError, ValueError):
        raise ConfigError(bad) from None
    if not 0.0 < threshold < 180.0:  # NaN too
        raise ConfigError(f"the threshold must be an angle in degrees in (0, 180), got {threshold:g}")
    runtime.start(cfg)
    run = cfg["Global"]["output_dir"]
    out_dir = out_dir or os.path.join(run, "cleaned")
    inside = os.path.commonpath([os.path.abspath(p) for p in (out_dir, run)]) == os.path.abspath(run)
    with claim_folder(run) if inside else contextlib.nullcontext() as lock:  # one job in the folder
        for note in getattr(lock, "notes", ()) if pd.get_rank() == 0 else ():
            print(f"plsc: {note}", file=sys.stderr)
        return _clean(cfg, checkpoint, threshold, out_dir, progress, write_rec, backbone)


def _clean(cfg, checkpoint, threshold, out_dir, progress, write_rec, backbone):
    rank = pd.get_rank()
    path, meta, k, num_classes = _checkpoint_to_clean(cfg, checkpoint)
    progress = show_progress(progress, cfg["Logging"]["progress_bar"], rank)
    ds, kind, cos, labels = _cosines(cfg, path, meta, k, backbone, progress)
    n = len(ds)
    if rank != 0:  # rank 0 writes everything; no collective follows
        return None

    picks = cos.argmax(axis=1)
    dominant, counts = dominant_centres(labels, picks, num_classes, k)
    angles = angles_to_dominant(cos, labels, dominant)
    kept = angles <= threshold
    os.makedirs(out_dir, exist_ok=True)
    summary = _summary(path, meta, threshold, labels, picks, counts, dominant, angles, kept,
                       kind, cfg["Data"]["root"])
    clean_list, dropped_list = _write_lists(out_dir, ds, kind, labels, angles, kept)
    outputs = {"train_clean": clean_list, "dropped": dropped_list}
    if kind == "recordio" and write_rec:
        outputs["rec"] = _write_clean_rec(os.path.join(out_dir, "rec"), ds, labels, kept, num_classes,
                                          cfg["Data"]["image_size"])
    title = (f"kept {summary['samples_kept']} / {n} samples, {summary['classes_kept']} / "
             f"{summary['classes_with_samples']} classes (K={k})")
    png = os.path.join(out_dir, "angles.png")
    plot = dict(bin_degrees=HIST_BIN_DEGREES, title=title)
    outputs["angles_png"] = save_angle_histogram_png(angles, kept, threshold, png, **plot)
    if cfg["Logging"]["visualdl"]:
        outputs["visualdl"] = _log_visualdl(out_dir, meta, angles, kept, threshold, plot, summary)
    outputs["checkpoint_k1"] = write_k1_checkpoint(path, os.path.join(out_dir, "checkpoint_k1"),
                                                   dominant, cfg, meta)
    summary["outputs"] = outputs
    write_json(os.path.join(out_dir, "summary.json"), summary)
    summary["arrays"] = {"labels": labels, "picks": picks, "dominant": dominant, "angles": angles,
                         "kept": kept, "cosines": cos}
    return summary


def _checkpoint_to_clean(cfg, checkpoint):
    """(path, meta, K, classes) of the K-centre checkpoint every rank agreed on, checked
    against the config."""
    g = cfg["Global"]
    value = checkpoint or g["checkpoint"] or "latest"
    value = "latest" if value == "auto" else value
    try:
        path = agree_checkpoint(value, g["output_dir"], cfg["Checkpoint"]["verify"],
                                warn=lambda msg: print(f"plsc: {msg}", file=sys.stderr))
    except FileNotFoundError as err:
        raise FileNotFoundError(f"no checkpoint to clean with (checkpoint={value!r}): {err}") from None
    meta = read_meta(path)
    k = int(meta.get("sub_centers", 1))
    if k == 1:
        raise ConfigError(f"checkpoint {path} has sub_centers=1 (one centre per class): nothing to "
                          "clean; train with -o Loss.sub_centers=3 (K > 1) first")
    num_classes, dim = int(meta["num_classes"]), int(meta["embedding_size"])
    first = rows_as_float32(load_head_rows(path, "weight", 0, 1, meta),
                            head_dtype(path, "weight", meta))
    if first.shape[1:] != (k, dim):
        raise ValueError(f"checkpoint {path}: head weight rows have shape {first.shape[1:]}, "
                         f"expected ({k}, {dim}) for sub_centers={k}")
    if cfg["Loss"]["num_classes"] != num_classes:
        raise ConfigError(f"checkpoint {path} has {num_classes} classes, Loss.num_classes is "
                          f"{cfg['Loss']['num_classes']}")
    return path, meta, k, num_classes


def _cosines(cfg, path, meta, k, backbone, progress):
    """(the training set, its kind, the [N, K] cosines of each sample to its class's K centres,
    the labels), the last two on every rank in data order."""
    from .tasks import trained_backbone
    world = pd.get_world_size()
    run_cfg = copy.deepcopy(cfg)
    run_cfg["Global"]["checkpoint"] = path
    model = trained_backbone(run_cfg, backbone)
    ds, kind = source_dataset(cfg)
    n = len(ds)
    emb, labels = _embed_share(model, ds, n, cfg["Eval"]["batch_size"], cfg["Data"]["num_workers"],
                               progress)
    cos = subcenter_cosines(path, meta, emb, labels) if emb is not None else np.zeros((0, k), np.float32)
    if world > 1:  # the [N, K] cosines and the labels, in data order, on every rank
        # labels travel exactly in float64 (< 2^53)
        both = gather_shares(np.concatenate([cos, labels[:, None]], axis=1).astype(np.float64), n)
        cos, labels = both[:, :k].astype(np.float32), both[:, k].astype(np.int64)
    return ds, kind, cos, labels


def _log_visualdl(out_dir, meta, angles, kept, threshold, plot, summary):
    """The angles' histogram, its plot and the kept fraction to VisualDL; returns its folder."""
    from visualdl import LogWriter  # imported lazily: it is slow to import
    step = int(meta.get("step", 0))
    with LogWriter(logdir=os.path.join(out_dir, "vdl")) as writer:
        writer.add_histogram("cleaning/angle_to_dominant_centre", angles, step,
                             buckets=int(180 / HIST_BIN_DEGREES))
        writer.add_image("cleaning/angles", angle_histogram_image(angles, kept, threshold, **plot),
                         step)
        writer.add_scalar("cleaning/kept_fraction", summary["kept_fraction"], step)
    return os.path.join(out_dir, "vdl")
