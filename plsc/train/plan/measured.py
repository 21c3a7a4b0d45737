"""What the planner takes from measurements on this machine (2-core AMD EPYC, 24 GiB, Paddle
3.3.1 CPU), each with the command that measured it. Nothing here is computed by plsc's code.

`PROCESS_RSS`: an idle process that imported Paddle and plsc's training package (VmHWM):

    python -c "import paddle, plsc, plsc.train; print(open('/proc/self/status').read())"

`LAUNCHER_RSS`: `paddle.distributed.launch`'s own process (benchmarks/peak_rss.py of the
demo's launch).

`BACKBONES` (re-measured 2026-11-27 after issue 48's memory changes: the oneDNN convolutions'
shared scratch, the trainer's release of malloc's free pages, an evaluation's convolutions in
pieces of the batch): per (model name, height, width, recompute), from
`benchmarks/measure_backbone_memory.py --backbone NAME --image-size H W --embedding-size D
--batch B... --eval-batch E...` (one kernel thread, malloc keeping freed blocks and given back
after each step as the trainer does after its first steps, the optimizer named): at each
measured batch size, a training step's peak resident memory above the parameters, gradients and
optimizer state (`train_rss`), the same for Paddle's allocator (`train_alloc`: what a device
allocates, float32), and an evaluation's (`eval_rss`: `--steps 10`, the forwards of the demo's
evaluation, 1,000 images and their flips a rank; the median of three processes, since where
malloc places the batches moves it by up to a quarter: 428-669 MB for IResNetTiny at 200).
Between measured batches the planner interpolates linearly, beyond them it extends the last
segment (the resident set is not linear in the batch: malloc keeps freed blocks below 1 GiB
and returns larger ones). The allocator figures are float32; with AMP on a GPU the planner
takes half of them (16-bit activations), an assumption.
"""

__all__ = ["PROCESS_RSS", "LAUNCHER_RSS", "BACKBONES", "activation_row", "at_batch"]

PROCESS_RSS = 332_452 * 1024
LAUNCHER_RSS = 333_475_840

BACKBONES = {
    # --backbone IResNetTiny --image-size 56 56 --embedding-size 128 --batch 32 64 128 256;
    # eval: --batch 64 --eval-batch 100 200 --steps 10 (three processes, the median)
    ("IResNetTiny", 56, 56, False): dict(
        train_rss={32: 137_055_360, 64: 262_757_504, 128: 513_334_400, 256: 945_089_664},
        train_alloc={32: 74_955_848, 64: 150_543_432, 128: 301_718_600, 256: 604_068_936},
        eval_rss={100: 219_852_800, 200: 485_941_248}),
    # --backbone ViT_T --image-size 56 56 --embedding-size 512 --optimizer adamw --batch 32 64;
    # eval: --batch 32 --eval-batch 100 200 --steps 10 (three processes, the median)
    ("ViT_T", 56, 56, False): dict(
        train_rss={32: 260_580_352, 64: 505_914_368},
        train_alloc={32: 160_154_504, 64: 358_469_256},
        eval_rss={100: 130_473_984, 200: 215_154_688}),
    # --backbone IResNet18 --image-size 112 112 --batch 16 32; eval: --batch 16 --eval-batch
    # 64 128 --steps 10 (one process)
    ("IResNet18", 112, 112, False): dict(
        train_rss={16: 1_089_556_480, 32: 2_174_324_736},
        train_alloc={16: 715_574_280, 32: 1_446_939_656},
        eval_rss={64: 1_983_115_264, 128: 4_273_094_656}),
    # --backbone IResNet50 --image-size 112 112 --batch 8 16 --steps 2
    ("IResNet50", 112, 112, False): dict(
        train_rss={8: 698_870_272, 16: 1_443_273_216},
        train_alloc={8: 483_357_960, 16: 1_041_716_488}),
    # --backbone ViT_T --image-size 112 112 --optimizer adamw --batch 16 32 --steps 2
    ("ViT_T", 112, 112, False): dict(
        train_rss={16: 595_645_440, 32: 1_176_359_936},
        train_alloc={16: 438_153_864, 32: 914_578_568}),
    # --backbone IResNet50 --image-size 112 112 --batch 8 16 --steps 2 --recompute (2026-11-28)
    ("IResNet50", 112, 112, True): dict(
        train_rss={8: 413_927_936, 16: 736_283_136},
        train_alloc={8: 180_879_880, 16: 361_914_888}),
    # --backbone ViT_T --image-size 112 112 --optimizer adamw --batch 16 32 --steps 2 --recompute
    # (2026-11-28)
    ("ViT_T", 112, 112, True): dict(
        train_rss={16: 214_975_488, 32: 329_528_320},
        train_alloc={16: 79_266_760, 32: 159_983_368}),
    # --backbone ViTDemo --image-size 56 56 --embedding-size 128 --optimizer adamw --batch 32 64
    # --eval-batch 100 200 --steps 10 (2026-11-28, one process)
    ("ViTDemo", 56, 56, False): dict(
        train_rss={32: 88_771_072, 64: 164_985_344},
        train_alloc={32: 54_944_320, 64: 112_652_992},
        eval_rss={100: 126_406_656, 200: 299_290_624}),
    # --backbone ViT_S --image-size 112 112 --optimizer adamw --batch 8 16 --steps 2 (2026-11-28)
    ("ViT_S", 112, 112, False): dict(
        train_rss={8: 362_375_168, 16: 852_051_968},
        train_alloc={8: 234_376_872, 16: 612_389_064}),
    # --backbone ViT_B --image-size 112 112 --optimizer adamw --batch 4 8 --steps 2 (2026-11-28;
    # ViT_B recomputes unless told not to, as arcface_torch's does)
    ("ViT_B", 112, 112, True): dict(
        train_rss={4: 165_197_824, 8: 201_746_432},
        train_alloc={4: 45_300_088, 8: 95_597_128}),
    # --backbone ViT_L_DP005_Mask005 --image-size 112 112 --optimizer adamw --batch 4 8 --steps 2
    # (2026-11-28; the recipe's own backbone, 5 % of the tokens masked, recomputing as it does)
    ("ViT_L_DP005_Mask005", 112, 112, True): dict(
        train_rss={4: 287_185_920, 8: 430_808_064},
        train_alloc={4: 67_540_776, 8: 145_723_816}),
    # --backbone IResNet100 --image-size 112 112 --batch 8 16 --steps 2
    ("IResNet100", 112, 112, False): dict(
        train_rss={8: 1_007_803_904, 16: 2_121_657_856},
        train_alloc={8: 724_897_544, 16: 1_610_805_000}),
    # --backbone IResNet100 --image-size 112 112 --batch 8 16 --steps 2 --recompute (2026-11-28;
    # the allocator's peak equals IResNet50's to the byte, the resident set does not)
    ("IResNet100", 112, 112, True): dict(
        train_rss={8: 478_178_816, 16: 859_991_552},
        train_alloc={8: 180_879_880, 16: 361_914_888}),
}


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
    """The measured row of backbone `name` at `image_size` ([H, W]) with `recompute`; a row of
    the same backbone at another size scaled by the pixels; KeyError naming what is measured
    when there is none. A ViT variant with drop path or masking (`ViT_T_DP005_Mask0`) takes its
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
                       f"and add the row to plsc/train/plan/measured.py")
    base = same[0]
    ratio = (h * w) / (base[1] * base[2])
    row = {k: {b: v * ratio for b, v in points.items()} for k, points in BACKBONES[base].items()
           if isinstance(points, dict)}
    return dict(row, scaled_from=f"{base[1]}x{base[2]}")
