"""Ship a trained backbone: a Paddle inference model and, with paddle2onnx installed, ONNX."""
import os
import shutil
import tempfile

import paddle

from ..fileio import commit_file
from ..checkpoint.layout import BACKBONE, read_meta
from ..loading import check_meta

__all__ = ["ONNX_MISSING", "checked_weights", "export_backbone"]


def checked_weights(path, cfg=None, by_name=True):
    """(the weights file of `path`, the checkpoint's step or None): `path` is a checkpoint
    folder, whose meta.json is compared with `cfg` first (`plsc.loading.check_meta`: the model
    name when `by_name`, the embedding size and the image size; a difference is a ConfigError
    naming the `-o` that matches), or a .pdparams or arcface_torch .pt/.pth file."""
    step = None
    file = path
    if os.path.isdir(path):
        meta = read_meta(path)
        if cfg is not None:
            check_meta(path, meta, cfg, by_name)
        step = meta.get("step")
        file = os.path.join(path, BACKBONE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no backbone weights at {file} (expected a checkpoint folder, "
                                "a .pdparams file or arcface_torch's .pt/.pth)")
    return file, step


ONNX_MISSING = 'paddle2onnx is not installed (pip install -e ".[onnx]")'


def _quiet_onnx_info(paddle2onnx):
    """paddle2onnx's own info lines off (its warnings and errors stay): they name the staging
    folder ("ONNX model saved in .../.export.XXXX.part/model.onnx"), not where the file ends."""
    log = getattr(getattr(paddle2onnx, "utils", None), "logging", None)
    if log is not None and getattr(log, "log_level", 0) > 1:
        log.log_level = 1


def export_backbone(backbone, image_size, out_dir, onnx=True, opset=11):
    """Write `out_dir/inference.*` (paddle.jit.save, dynamic batch) and, when `onnx` and
    paddle2onnx is importable, `out_dir/model.onnx`. Returns {"paddle": the inference prefix,
    "onnx": the ONNX path or None, "onnx_skipped": why it was not written (`onnx` False:
    "not asked for"; `ONNX_MISSING`) or None}."""
    h, w = image_size
    os.makedirs(out_dir, exist_ok=True)
    was_training = backbone.training
    backbone.eval()
    spec = [paddle.static.InputSpec([None, 3, h, w], "float32", name="images")]
    prefix = os.path.join(out_dir, "inference")
    paths = {"paddle": prefix, "onnx": None, "onnx_skipped": None if onnx else "not asked for"}
    if onnx:
        try:
            import paddle2onnx
        except ImportError:
            paths["onnx_skipped"] = ONNX_MISSING
    # Paddle and paddle2onnx write by path: into a temporary folder beside the output, then
    # each file is committed (fsync, rename) by plsc.fileio.
    staging = tempfile.mkdtemp(prefix=".export.", suffix=".part", dir=out_dir)
    try:
        staged = os.path.join(staging, "inference")
        paddle.jit.save(paddle.jit.to_static(backbone, input_spec=spec, full_graph=True), staged)
        if was_training:
            backbone.train()
        if paths["onnx_skipped"] is None:
            model = next(f for f in (staged + ".json", staged + ".pdmodel") if os.path.isfile(f))
            _quiet_onnx_info(paddle2onnx)
            paddle2onnx.export(model, staged + ".pdiparams", os.path.join(staging, "model.onnx"),
                               opset_version=opset, auto_upgrade_opset=True, verbose=False,
                               enable_onnx_checker=True)
            paths["onnx"] = os.path.join(out_dir, "model.onnx")
        for name in sorted(os.listdir(staging)):
            commit_file(os.path.join(staging, name), os.path.join(out_dir, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return paths
