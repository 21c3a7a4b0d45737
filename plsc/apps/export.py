"""Ship a trained backbone: a Paddle inference model and, with paddle2onnx installed, ONNX."""
import os
import shutil
import tempfile

import paddle

from ..fileio import commit_file
from ..checkpoint.layout import BACKBONE
from ..parts import load_pretrained

__all__ = ["export_backbone", "load_backbone_weights"]


def load_backbone_weights(backbone, path):
    """Load backbone weights from a checkpoint folder, a .pdparams file or an arcface_torch
    .pt/.pth file (`plsc.parts.load_pretrained`; a damaged .pdparams raises
    `CheckpointDamaged` naming it, arcface_torch weights that do not fit a ConfigError naming
    the keys)."""
    file = os.path.join(path, BACKBONE) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no backbone weights at {file} (expected a checkpoint folder, "
                                "a .pdparams file or arcface_torch's .pt/.pth)")
    load_pretrained(backbone, file)
    return file


def export_backbone(backbone, image_size, out_dir, onnx=True, opset=11):
    """Write `out_dir/inference.*` (paddle.jit.save, dynamic batch) and, when
    paddle2onnx is importable and `onnx`, `out_dir/model.onnx`. Returns the paths."""
    h, w = image_size
    os.makedirs(out_dir, exist_ok=True)
    was_training = backbone.training
    backbone.eval()
    spec = [paddle.static.InputSpec([None, 3, h, w], "float32", name="images")]
    prefix = os.path.join(out_dir, "inference")
    # Paddle and paddle2onnx write by path: into a temporary folder beside the output, then
    # each file is committed (fsync, rename) by plsc.fileio.
    staging = tempfile.mkdtemp(prefix=".export.", suffix=".part", dir=out_dir)
    try:
        staged = os.path.join(staging, "inference")
        paddle.jit.save(paddle.jit.to_static(backbone, input_spec=spec, full_graph=True), staged)
        if was_training:
            backbone.train()
        paths = {"paddle": prefix}
        if onnx:
            try:
                import paddle2onnx
            except ImportError:
                onnx = False
        if onnx:
            model = next(f for f in (staged + ".json", staged + ".pdmodel") if os.path.isfile(f))
            paddle2onnx.export(model, staged + ".pdiparams", os.path.join(staging, "model.onnx"),
                               opset_version=opset, auto_upgrade_opset=True, verbose=False,
                               enable_onnx_checker=True)
            paths["onnx"] = os.path.join(out_dir, "model.onnx")
        for name in sorted(os.listdir(staging)):
            commit_file(os.path.join(staging, name), os.path.join(out_dir, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return paths
