"""Ship a trained backbone: a Paddle inference model and, with paddle2onnx installed, ONNX."""
import os

import paddle

__all__ = ["export_backbone", "load_backbone_weights"]


def load_backbone_weights(backbone, path):
    """Load backbone weights from a checkpoint folder or a .pdparams file."""
    file = os.path.join(path, "backbone.pdparams") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no backbone weights at {file} (expected a checkpoint folder "
                                "or a .pdparams file)")
    backbone.set_state_dict(paddle.load(file))
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
    paddle.jit.save(paddle.jit.to_static(backbone, input_spec=spec, full_graph=True), prefix)
    if was_training:
        backbone.train()
    paths = {"paddle": prefix}
    if onnx:
        try:
            import paddle2onnx
        except ImportError:
            return paths
        model_file = next(f for f in (prefix + ".json", prefix + ".pdmodel") if os.path.isfile(f))
        onnx_path = os.path.join(out_dir, "model.onnx")
        paddle2onnx.export(model_file, prefix + ".pdiparams", onnx_path, opset_version=opset,
                           auto_upgrade_opset=True, verbose=False, enable_onnx_checker=True)
        paths["onnx"] = onnx_path
    return paths
