"""What the planner takes from measurements on this machine (2-core AMD EPYC, 24 GiB, Paddle
3.3.1 CPU), each with the command that measured it. Nothing here is computed by plsc's code.

`PROCESS_RSS`: an idle process that imported Paddle and plsc's training package (VmHWM):

    python -c "import paddle, plsc, plsc.train; print(open('/proc/self/status').read())"

`LAUNCHER_RSS`: `paddle.distributed.launch`'s own process (benchmarks/peak_rss.py of the
demo's launch).

`BACKBONES`: per (model name, height, width, recompute), the rows that
`python benchmarks/measure_backbone_memory.py --write-table` measures and writes into
`measured_table.json` (generated, each row with its arguments, machine and date; no figure in it
is typed by hand). Each point is one process (one kernel thread, as a rank of a 2-rank run on 2
cores, malloc keeping freed blocks and given back after each step as the trainer does after its
first steps): at each measured batch size, a training step's peak resident memory above the
parameters, gradients and optimizer state (`train_rss`), the same for Paddle's allocator
(`train_alloc`: what a device allocates, float32), both as the trainer runs (the gradients
freed after each step: where the activations are smaller than the gradients these are the
floor the step holds beside all its gradients, not activations), the same two with the
gradients kept allocated between steps (`act_rss`, `act_alloc`: the activations, whatever the
gradients' size; `model.step_beyond_gradients` combines the two), and where measured an
evaluation's (`eval_rss`, `eval_alloc`: the forwards of the demo's evaluation, 1,000 images
and their flips a rank; the median of three processes, since where malloc places the batches
moves it by up to a quarter). Between measured batches the planner interpolates linearly,
beyond them it extends the last segment (the resident set is not linear in the batch: malloc
keeps freed blocks below 1 GiB and returns larger ones). The large backbones (ViT-H,
IResNet200) are measured at 56 x 56 and scaled by the pixels to other sizes; IResNet100 and
ViT-L are measured at both sizes, which checks that rule (tests/test_plan_measured.py,
docs/scaling.md). Each training point is measured after a warm-up step (the optimizer's state
made, the peaks reset before the measured step).

With AMP on a GPU the planner takes half the float32 allocator figures: an assumption, not
measured (Paddle's CPU kernels run float32): O1 keeps the convolutions' and matmuls' outputs,
most of what the backward keeps, in 16 bits, as in Micikevicius et al., "Mixed Precision
Training" (ICLR 2018), whose activations halve while the float32 master weights stay.
"""
import json
import os

__all__ = ["PROCESS_RSS", "LAUNCHER_RSS", "BACKBONES", "activation_row", "at_batch", "read_table"]

TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "measured_table.json")


def read_table(path=TABLE):
    """{(name, height, width, recompute): row} of the JSON `path`, each row's {batch: bytes}
    points keyed by int batch sizes."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    out = {}
    for row in rows:
        key = (row.pop("backbone"), row.pop("height"), row.pop("width"), row.pop("recompute"))
        out[key] = {k: {int(b): v for b, v in value.items()} if isinstance(value, dict) else value
                    for k, value in row.items()}
    return out


BACKBONES = read_table()

PROCESS_RSS = 332_452 * 1024
LAUNCHER_RSS = 333_475_840


def at_batch(points, batch):
    """Bytes at `batch` from {batch: bytes}: linear between the measured batches, the nearest
    segment's line beyond them (one point: proportional)."""
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]] * batch / xs[0]
    i = 1
    while i < len(xs) - 1 and xs[i] < batch:
        i += 1
    (x0, x1) = xs[i - 1], xs[i]
    y0, y1 = points[x0], points[x1]
    return y0 + (y1 - y0) * (batch - x0) / (x1 - x0)


def activation_row(name, image_size, recompute):
    """The measured row of backbone `name` at `image_size` ([H, W]) with `recompute`; else the
    same backbone's row at the nearest size measured, scaled by the pixels; KeyError naming what
    is measured when there is none. A ViT variant with drop path or masking (`ViT_T_DP005_Mask0`) takes its
    base's row (the same tensors in training, masking aside)."""
    from ...models.registry import resolve_name
    h, w = image_size
    name = resolve_name(name)
    if not any(k[0] == name for k in BACKBONES):  # a face ViT's variant: drop path, masking
        name = name.split("_DP")[0]
    key = (name, h, w, bool(recompute))
    if key in BACKBONES:
        return dict(BACKBONES[key], scaled_from=None)
    same = [k for k in BACKBONES if k[0] == name and k[3] == bool(recompute)]
    if not same:
        known = ", ".join(f"{k[0]} {k[1]}x{k[2]}{' recompute' if k[3] else ''}" for k in BACKBONES)
        raise KeyError(f"no measured activations for Model.name={name} (recompute={bool(recompute)}); "
                       f"measured: {known}. Measure it with benchmarks/measure_backbone_memory.py "
                       f"(--write-table, after adding it to its TABLE)")
    base = min(same, key=lambda k: abs(k[1] * k[2] - h * w))  # the nearest size measured
    ratio = (h * w) / (base[1] * base[2])
    row = {k: {b: v * ratio for b, v in points.items()} for k, points in BACKBONES[base].items()
           if isinstance(points, dict)}
    return dict(row, scaled_from=f"{base[1]}x{base[2]}")
