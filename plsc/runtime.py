"""What training (`plsc.train`) and the applications (`plsc.apps`) share: the device and
process group a run starts with (`start`), how plsc uses the CPU (BLAS code path, threads,
malloc), the backbone and the data set a config names (`build_backbone`, `open_dataset`), and
when a progress bar is drawn (`show_progress`, `progress`). Importing this module does not
import Paddle (`import plsc` runs `blas_dispatch` before Paddle loads MKL).

**BLAS dispatch.** Paddle's bundled MKL picks a generic code path on processors that are not
Intel's; with ``MKL_DEBUG_CPU_TYPE=5`` it takes its AVX2 kernels (measured on an AMD EPYC: a
head GEMM at 24 GFLOP/s without, 80 with). MKL reads the variable at its first matrix product,
so `blas_dispatch` runs at ``import plsc``, which does not import Paddle. Intel processors,
processors without AVX2, a variable the user set, and ``PLSC_MKL_DISPATCH=keep`` are left alone.

**Threads and malloc** (`plsc.cpu_setup`, the same for runs and for a user's own loop): threads
by one rule (Global.cpu_threads, else the user's OMP_NUM_THREADS, else the usable cores divided
by the ranks on the node), and malloc keeping freed blocks on the CPU.
"""
import os
import platform
import sys
import warnings

from .cpu_setup import apply as set_cpu_threads, choose as cpu_threads  # noqa: F401
from .cpu_setup import keep_freed_memory, usable_cores  # noqa: F401 (this module's API)

__all__ = ["blas_dispatch", "BLAS_NOTE", "cpu_description", "usable_cores",
           "cpu_threads", "kernel_threads", "set_cpu_threads", "keep_freed_memory",
           "select_device", "start", "build_backbone", "load_pretrained", "open_dataset", "DATA_HELP",
           "show_progress", "progress"]

BLAS_NOTE = None  # what blas_dispatch did, for the run's first log lines


def _cpu_info():
    """{"vendor_id", "model name", "flags"} of the first processor in /proc/cpuinfo (Linux;
    empty elsewhere)."""
    info = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("vendor_id", "model name", "flags") and key not in info:
                    info[key] = value.strip()
                if not line.strip() and info:  # the end of the first processor
                    break
    except OSError:
        pass
    return info


def _cpu_flags():
    info = _cpu_info()
    return info.get("vendor_id", ""), set(info.get("flags", "").split())


def cpu_description():
    """The processor's vendor and model and whether it has AVX2 / AVX-512, for logs."""
    info = _cpu_info()
    flags = set(info.get("flags", "").split())
    simd = [name for name, flag in (("AVX2", "avx2"), ("AVX-512", "avx512f")) if flag in flags]
    return " ".join([info.get("vendor_id", platform.processor() or "unknown"),
                     info.get("model name", "")] + (["(" + ", ".join(simd) + ")"] if simd else []))


def blas_dispatch(environ=os.environ, cpu=None):
    """Set ``MKL_DEBUG_CPU_TYPE=5`` on an AMD processor with AVX2 unless the user set it or
    ``PLSC_MKL_DISPATCH=keep``; returns (and keeps in `BLAS_NOTE`) a line saying what was done,
    or None. Warns when Paddle is imported already: then it helps only if no matrix product
    has run yet."""
    global BLAS_NOTE
    if environ.get("PLSC_MKL_DISPATCH", "").lower() == "keep" or "MKL_DEBUG_CPU_TYPE" in environ:
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    vendor, flags = _cpu_flags() if cpu is None else cpu
    if vendor != "AuthenticAMD" or "avx2" not in flags:
        return None
    environ["MKL_DEBUG_CPU_TYPE"] = "5"
    BLAS_NOTE = ("MKL_DEBUG_CPU_TYPE=5 set: MKL takes its AVX2 kernels on this AMD processor "
                 "(PLSC_MKL_DISPATCH=keep turns this off)")
    if "paddle" in sys.modules:
        warnings.warn("plsc set MKL_DEBUG_CPU_TYPE=5 after Paddle was imported: it takes effect "
                      "only if no matrix product has run yet; import plsc first", stacklevel=3)
    return BLAS_NOTE


def kernel_threads():
    """Threads of plsc's own CPU kernels (`plsc.cpu_kernels`, e.g. `plsc.models.prelu`'s):
    those `set_cpu_threads` gave Paddle, 1 before it is called (Paddle's own default)."""
    from . import cpu_kernels
    return cpu_kernels.threads()


def select_device(name, cpu_threads=None):
    """'auto' picks the GPU when Paddle has one, else the CPU. The threads of the CPU kernels
    follow `cpu_threads` (`cpu_threads`: Global.cpu_threads); on the CPU, malloc keeps freed
    memory for reuse (`keep_freed_memory`)."""
    import paddle
    from .config import ConfigError
    has_gpu = paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    if name == "gpu" and not has_gpu:
        raise ConfigError("Global.device is gpu but this Paddle build sees no GPU")
    if name == "gpu" or (name == "auto" and has_gpu):
        paddle.set_device(f"gpu:{int(os.environ.get('FLAGS_selected_gpus', '0').split(',')[0])}")
    else:
        paddle.set_device("cpu")
        keep_freed_memory()
    set_cpu_threads(cpu_threads)
    return paddle.get_device()


def start(cfg):
    """The preamble of every run of a config: its device (Global.device, Global.cpu_threads)
    and the process group of the launched ranks (one process: none). Returns the device."""
    from . import distributed
    device = select_device(cfg["Global"]["device"], cfg["Global"]["cpu_threads"])
    distributed.init()
    return device


def build_backbone(cfg):
    """The backbone of `cfg['Model']` for `cfg['Data']['image_size']` images. The keys only some
    backbones have (`Model.drop_path_rate`, `mask_ratio`, `patch_size`, `recompute`) override
    the name's values when set; set for a backbone without them, they are a ConfigError naming
    the key."""
    from .config import ConfigError
    from .models import build_model, model_options
    m = cfg["Model"]
    options = {key: m[key] for key in ("drop_path_rate", "mask_ratio", "patch_size", "recompute")
               if m.get(key) is not None}
    for key, value in options.items():
        if key not in model_options(m["name"]):
            raise ConfigError(f"Model.{key}={value!r}: {m['name']} has no {key} (only "
                              f"{'IResNets and ' if key == 'recompute' else ''}ViTs have it); "
                              "leave it null")
    return build_model(m["name"], embedding_size=m["embedding_size"],
                       input_size=tuple(cfg["Data"]["image_size"]), dropout=m["dropout"],
                       **options)


def load_pretrained(backbone, path):
    """Global.pretrained: set `backbone`'s weights from a plsc `.pdparams` file, or from an
    arcface_torch file (torch's format: a `.pt`/`.pth` name or a zip archive), read without
    torch by `plsc.models.from_insightface`, which checks every key and shape; a mismatch is a
    ConfigError of one line naming the keys. Returns `path`."""
    from .config import ConfigError
    from .models.insightface import from_insightface, is_torch_file
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Global.pretrained: no file {path}")
    if is_torch_file(path):
        try:
            from_insightface(backbone, path)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"Global.pretrained: {err}") from None
    else:
        from .checkpoint import load_paddle_file
        backbone.set_state_dict(load_paddle_file(path))
    return path


DATA_HELP = ("make a RecordIO set with `python tools/pack_rec.py --input IMAGE_DIR --output ROOT`, "
             "or try `configs/demo.yaml`, which generates synthetic identities")
_SOURCES = ("recordio", "folder", "list")


def _source_kind(root):
    """recordio, folder or list: what `root` is (a folder with train.idx, a folder, a file)."""
    if os.path.isdir(root):
        return "recordio" if os.path.isfile(os.path.join(root, "train.idx")) else "folder"
    if os.path.isfile(root):
        return "list"
    raise FileNotFoundError(f"{root} is neither a RecordIO folder, an image folder nor a list file")


def open_dataset(kind, root, image_size, train, what="Data.root", **options):
    """(dataset, kind) for the images at `root`: `kind` is Data.dataset (recordio, folder,
    list; synthetic, once generated, is read as recordio) or "auto" (from what `root` is).
    `train`: with the training transform (else the image alone, in order); `options` go to
    the dataset (num_classes, skip_bad). A missing `root` or RecordIO file is a ConfigError
    naming `what`."""
    from . import data
    from .config import ConfigError
    kind = _source_kind(root) if kind == "auto" else ("recordio" if kind == "synthetic" else kind)
    if kind not in _SOURCES:
        raise ConfigError(f"Data.dataset must be one of {_SOURCES + ('synthetic',)}, got {kind!r}")
    if not os.path.exists(root):
        raise ConfigError(f"{what} {root} does not exist; {DATA_HELP}")
    if kind == "recordio":
        for name in ("train.rec", "train.idx"):
            if not os.path.isfile(os.path.join(root, name)):
                raise ConfigError(f"{what} {root} has no {name}; {DATA_HELP}")
    cls = {"recordio": data.RecordIODataset, "folder": data.ImageFolderDataset,
           "list": data.ImageListDataset}[kind]
    return cls(root, image_size=tuple(image_size), train=train, **options), kind


def show_progress(requested=None, setting=True, rank=0, stream=None):
    """Whether this process draws a progress bar: on rank 0 only; `requested` (True/False)
    when given, else `setting` (Logging.progress_bar) and `stream` (default stderr) being a
    terminal."""
    if rank != 0:
        return False
    if requested is not None:
        return bool(requested)
    return bool(setting) and (stream or sys.stderr).isatty()


def progress(done, total, enabled, label=""):
    """Draw `done`/`total` as a one-line bar on stderr (ending the line when done >= total);
    nothing unless `enabled`."""
    if enabled:
        width = 30
        fill = width * done // max(total, 1)
        sys.stderr.write(f"\r{label}[{'#' * fill}{'.' * (width - fill)}] {done}/{total}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()
