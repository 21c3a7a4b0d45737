"""What the tools and `Entry` do with a trained backbone: evaluate, export, extract."""
import os
import sys

import numpy as np

from .. import data as plsc_data
from .. import distributed as pd
from ..checkpoint import find_checkpoint
from ..checkpoint.layout import BACKBONE
from ..config import ConfigError
from ..embedding import VerificationEvaluator, embed
from ..fileio import write_npy
from ..metrics import save_roc_png
from ..parts import build_backbone, load_pretrained, open_dataset
from ..process.progress import progress as draw_progress, show_progress
from ..process.runtime import select_device, start
from .export import checked_weights, export_backbone
from .onnx_backbone import onnx_backbone

__all__ = ["trained_backbone", "trained_weights", "evaluation_model", "evaluate", "format_table", "export", "extract"]


def trained_backbone(cfg, backbone=None):
    """The config's backbone with the weights of Global.checkpoint ('latest' or a folder)
    or else Global.pretrained (.pdparams, or arcface_torch's .pt/.pth), in eval mode."""
    return trained_weights(cfg, backbone)[0]


def trained_weights(cfg, backbone=None):
    """(`trained_backbone`, the checkpoint folder or file its weights came from, the
    checkpoint's step or None), by plsc's one rule (`checked_weights`, `load_pretrained`): a
    checkpoint's model name (unless `backbone` is given), embedding size and image size must
    be the config's, every tensor must fit."""
    select_device(cfg["Global"]["device"], cfg["Global"]["cpu_threads"])
    g = cfg["Global"]
    path = None
    if g["checkpoint"]:  # only the backbone is read: only it is verified
        path = find_checkpoint(g["checkpoint"], g["output_dir"], cfg["Checkpoint"]["verify"],
                               warn=lambda msg: print(f"plsc: {msg}", file=sys.stderr),
                               only=(BACKBONE,))
    if path is None and not g["pretrained"]:
        found = (f" (Global.checkpoint=auto found none under {g['output_dir']})"
                 if g["checkpoint"] == "auto" else "")
        raise ConfigError(f"no weights to use{found}: set Global.checkpoint (a checkpoint folder "
                          "or 'latest') or Global.pretrained (a .pdparams file or "
                          "arcface_torch's .pt/.pth)")
    source = path or g["pretrained"]
    file, step = checked_weights(source, cfg, by_name=backbone is None)  # before building
    backbone = backbone if backbone is not None else build_backbone(cfg)
    load_pretrained(backbone, file)
    backbone.eval()
    return backbone, source, step


def evaluation_model(cfg, backbone=None, onnx=None, onnx_input="rgb"):
    """(cfg, model) for the tools: the ONNX file `onnx` fed as `onnx_input` says, with the
    file's fixed input size as Data.image_size (`plsc.apps.onnx_backbone`), or else the
    config's trained backbone (`trained_backbone`) and the config as it is."""
    if onnx:
        return onnx_backbone(cfg, onnx, onnx_input)
    return cfg, trained_backbone(cfg, backbone)


def format_table(reports):
    head = f"{'target':<12} {'accuracy':>17} {'threshold':>9} {'norm':>8} " \
           f"{'TAR@1e-2':>9} {'TAR@1e-3':>9} {'TAR@1e-4':>9}"
    rows = [head, "-" * len(head)]
    for target, r in reports.items():
        if r["accuracy"] is None:
            rows.append(f"{target:<12} not finite: {r['nonfinite']} of {r['embeddings']} embeddings")
            continue
        far = [r["tar_at_far"][k] for k in sorted(r["tar_at_far"], reverse=True)]
        rows.append(f"{target:<12} {r['accuracy']:>8.4f} ± {r['accuracy_std']:.4f} "
                    f"{r['threshold']:>9.3f} {r['embedding_norm']:>8.2f} "
                    + " ".join(f"{v:>9.4f}" for v in far))
    return "\n".join(rows)


def evaluate(cfg, backbone=None, out=None, onnx=None, onnx_input="rgb"):
    """Verify every Eval target; rank 0 prints a table (to `out`, default stdout) and writes
    roc.png to output_dir. `onnx`: an ONNX file used instead of the config's backbone (see
    `evaluation_model`)."""
    out = sys.stdout if out is None else out
    start(cfg)
    e = cfg["Eval"]
    if not e["targets"]:
        raise ConfigError("Eval.targets is empty: name the packs to verify, e.g. -o Eval.targets=[lfw]")
    if not e["root"]:
        raise ConfigError("Eval.root is not set: the folder holding <target>.bin")
    cfg, model = evaluation_model(cfg, backbone, onnx, onnx_input)
    reports = VerificationEvaluator(e["root"], e["targets"], cfg["Data"]["image_size"],
                                    e["batch_size"])(model, with_roc=True)
    if pd.get_rank() == 0:
        out.write(format_table(reports) + "\n")
        os.makedirs(cfg["Global"]["output_dir"], exist_ok=True)
        path = os.path.join(cfg["Global"]["output_dir"], "roc.png")
        save_roc_png({t: (r["far"], r["tar"]) for t, r in reports.items() if "far" in r}, path)
        out.write(f"ROC curve: {path}\n")
    return reports


def export(cfg, out_dir=None, onnx=True, backbone=None):
    """The trained backbone as a Paddle inference model (+ ONNX): `export_backbone`'s
    {"paddle", "onnx", "onnx_skipped"} plus "source" (the checkpoint folder or weights file
    exported) and "step" (the checkpoint's step, None for a weights file)."""
    model, source, step = trained_weights(cfg, backbone)
    out_dir = out_dir or os.path.join(cfg["Global"]["output_dir"], "export")
    paths = export_backbone(model, cfg["Data"]["image_size"], out_dir, onnx=onnx)
    return {**paths, "source": source, "step": step}


def extract(cfg, source, output, flip=False, batch_size=None, backbone=None, progress=None, onnx=None,
            onnx_input="rgb"):
    """Embeddings of every image of `source` (a folder with train.rec, a list file, or an
    image folder) to `output` (.npy) and their labels to `<output stem>_labels.npy`.
    `onnx`: an ONNX file used instead of the config's backbone (see `evaluation_model`)."""
    cfg, model = evaluation_model(cfg, backbone, onnx, onnx_input)
    size = tuple(cfg["Data"]["image_size"])
    ds, _ = open_dataset("auto", source, size, train=False, what="the source")
    batch_size = batch_size or cfg["Eval"]["batch_size"]
    progress = show_progress(progress, cfg["Logging"]["progress_bar"], pd.get_rank())
    loader = plsc_data.DataLoader.sequential(ds, batch_size, num_workers=cfg["Data"]["num_workers"])
    embeddings, labels, done = [], [], 0
    for images, batch_labels in loader:
        embeddings.append(embed(model, images.numpy(), batch_size, flip))
        labels.append(batch_labels.numpy().reshape(-1))
        done += len(batch_labels)
        draw_progress(done, len(ds), progress)
    emb = np.concatenate(embeddings)
    stem = output[:-4] if output.endswith(".npy") else output
    write_npy(stem + ".npy", emb)
    write_npy(stem + "_labels.npy", np.concatenate(labels))
    return stem + ".npy", stem + "_labels.npy"
