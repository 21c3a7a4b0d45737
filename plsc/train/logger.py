"""Training log on rank 0: console lines, a progress bar, a log file, VisualDL scalars and images."""
import datetime
import logging
import os
import sys
import time

from ..metrics import roc_image
from ..process.progress import show_progress

__all__ = ["TrainLogger", "visualdl_dir"]


def visualdl_dir(output_dir):
    """Where the VisualDL scalars and images of a run in `output_dir` go."""
    return os.path.join(output_dir, "vdl")


class TrainLogger:
    """Averages the loss over `interval` steps and reports global throughput and ETA.

    Only the rank that is `enabled` writes anything. VisualDL scalars go to
    `<output_dir>/vdl` (tags `train/loss`, `train/lr`, `train/throughput`,
    `eval/<target>/accuracy`, ...) and, for a verification report with its ROC,
    the curve as the image `eval/<target>/roc`.
    """

    def __init__(self, output_dir, total_steps, interval, enabled=True, visualdl=True,
                 progress_bar=True):
        self.enabled, self.total, self.interval = enabled, int(total_steps), int(interval)
        self.bar = enabled and show_progress(setting=progress_bar, stream=sys.stdout)
        self._losses, self._samples = [], 0
        self._t0 = self._start = time.perf_counter()
        self._start_step = None
        self.writer = None
        self.log = logging.getLogger("plsc.train")
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        for handler in list(self.log.handlers):  # an earlier run of this process: its own file
            self.log.removeHandler(handler)
            handler.close()
        self.log.setLevel(logging.INFO)
        fmt = logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S")
        for handler in (logging.StreamHandler(sys.stdout),
                        logging.FileHandler(os.path.join(output_dir, "train.log"))):
            handler.setFormatter(fmt)
            self.log.addHandler(handler)
        self.log.propagate = False
        if visualdl:
            from visualdl import LogWriter  # imported lazily: it is slow to import
            self.writer = LogWriter(logdir=visualdl_dir(output_dir))

    def begin(self, total_steps):
        """The run will take `total_steps` steps; throughput and ETA are measured from now
        (the log may be opened earlier, to log the start-up)."""
        self.total = int(total_steps)
        self._t0 = self._start = time.perf_counter()

    def info(self, msg):
        if self.enabled:
            if self.bar:
                sys.stdout.write("\r\033[K")
            self.log.info(msg)

    def file_only(self, msg):
        """`msg` in train.log alone (a line the console already has, e.g. the tool's error)."""
        if not self.enabled:
            return
        record = self.log.makeRecord(self.log.name, logging.INFO, __file__, 0, msg, None, None)
        for handler in self.log.handlers:
            if isinstance(handler, logging.FileHandler):
                handler.handle(record)

    def warning(self, msg):
        """`msg` in the log (the rank that is enabled) or on stderr (every other rank)."""
        if self.enabled:
            self.info(msg)
        else:
            sys.stderr.write(f"plsc: {msg}\n")
            sys.stderr.flush()

    def scalar(self, tag, value, step):
        if self.writer is not None:
            self.writer.add_scalar(tag=tag, value=float(value), step=int(step))

    def step(self, step, loss, lr, samples, epoch):
        """Record optimizer step `step` (1-based) that consumed `samples` (global)."""
        if not self.enabled:
            return
        if self._start_step is None:
            self._start_step = step - 1
        self._losses.append(float(loss))
        self._samples += samples
        if self.bar:
            done = int(30 * step / self.total)
            sys.stdout.write(f"\r[{'#' * done}{'.' * (30 - done)}] {step}/{self.total} "
                             f"loss {float(loss):.4f}")
            sys.stdout.flush()
        if step % self.interval and step != self.total:
            return
        now = time.perf_counter()
        throughput = self._samples / max(now - self._t0, 1e-9)
        per_step = (now - self._start) / max(step - self._start_step, 1)
        eta = datetime.timedelta(seconds=int(per_step * (self.total - step)))
        mean_loss = sum(self._losses) / len(self._losses)
        self.info(f"step {step}/{self.total} epoch {epoch} loss {mean_loss:.4f} lr {lr:.6f} "
                  f"{throughput:.1f} samples/s eta {eta}")
        self.scalar("train/loss", mean_loss, step)
        self.scalar("train/lr", lr, step)
        self.scalar("train/throughput", throughput, step)
        self._losses, self._samples, self._t0 = [], 0, now

    def evaluation(self, step, target, report):
        if not self.enabled:
            return
        if report["accuracy"] is None:
            self.warning(f"[{target}] step {step}: {report['nonfinite']} of {report['embeddings']} "
                         "embeddings are not finite; no accuracy")
            return
        far = ", ".join(f"TAR@FAR={k:g}: {v:.4f}" for k, v in report["tar_at_far"].items())
        self.info(f"[{target}] step {step} accuracy {report['accuracy']:.4f} "
                  f"± {report['accuracy_std']:.4f} threshold {report['threshold']:.3f} "
                  f"norm {report['embedding_norm']:.2f} {far}")
        self.scalar(f"eval/{target}/accuracy", report["accuracy"], step)
        self.scalar(f"eval/{target}/embedding_norm", report["embedding_norm"], step)
        if self.writer is not None and "far" in report:
            self.log_image(f"eval/{target}/roc", roc_image({target: (report["far"], report["tar"])}), step)

    def log_image(self, tag, image, step):
        """An HWC uint8 RGB array as a VisualDL image."""
        if self.writer is not None:
            self.writer.add_image(tag=tag, img=image, step=int(step))

    def close(self):
        if self.writer is not None:
            self.writer.close()
            self.writer = None
