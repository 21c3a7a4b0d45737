"""The planner's predicted peak memory against the measured peak RSS of real runs on this
machine: for each run, the plan of its config on the "cpu" profile (its ranks: 2 unless the run
says) beside the VmHWM of the largest rank of the launched run (`benchmarks/peak_rss.py`'s exact
maximum over the run's processes, and the rank's as polled every 0.5 s). One JSON line per run.

    python benchmarks/benchmark_plan.py --out /tmp/plan_runs                  # every run
    python benchmarks/benchmark_plan.py --out /tmp/plan_runs --runs demo vit_t_adamw
    python benchmarks/benchmark_plan.py --predict-only                        # no runs

The runs (few steps each; the demo's synthetic data, generated on first use under OUT):
demo (configs/demo.yaml), int8_3m (3M classes, int8 centres and momentum, the run of
docs/memory_and_benchmarks.md), pfc_10m (10M classes, Partial FC 0.1, int8 centres, 4-bit
momentum), vit_t_adamw (configs/demo_vit.yaml with ViT-T and AdamW); and runs no test uses, for
the terms of issue 61: accum_bf16 (2 micro-batches a step, bfloat16 centres and AdamW, 3 ranks),
accum_int8 (2 micro-batches, int8 centres and momentum), pfc_accum_bf16 (Partial FC 0.3 over
bfloat16 centres, 2 micro-batches), unfused_f32 (float32 centres updated after the backward,
`Optimizer.fused_head_update=false`), vit_s (ViT-S at 112 x 112, AdamW), demo_vit
(configs/demo_vit.yaml as shipped, its evaluation included); and the four runs issue 61 names as
checked before it: r50_int8_int4 (IResNet50 at 112 x 112, a dense int8 head, 4-bit state, 1
rank), pfc03_4m_f32 (Partial FC 0.3 over 4M float32 classes), f16_1rank and f16_3ranks (float16
centres, 1M classes, on 1 and on 3 ranks). Memory is what they measure, so
other work on the machine slows them without moving the figures much.
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

RUNS = {
    "demo": ("configs/demo.yaml", ["Global.max_steps=3"]),
    "int8_3m": ("configs/demo.yaml", [
        "Loss.num_classes=3000000", "Loss.param_dtype=int8", "Loss.chunk_size=16384",
        "Model.embedding_size=512", "Data.batch_size=256", "Global.max_steps=3",
        "Eval.targets=[]"]),
    "pfc_10m": ("configs/demo.yaml", [
        "Loss.num_classes=10000000", "Loss.sample_ratio=0.1", "Loss.param_dtype=int8",
        "Optimizer.head_state_dtype=int4", "Loss.chunk_size=16384", "Model.embedding_size=512",
        "Data.batch_size=128", "Global.max_steps=3", "Eval.targets=[]"]),
    "vit_t_adamw": ("configs/demo_vit.yaml", [
        "Model.name=ViT_T", "Model.embedding_size=512", "Global.max_steps=3"]),
    "accum_bf16": ("configs/demo.yaml", [
        "Loss.num_classes=600000", "Loss.param_dtype=bfloat16", "Optimizer.name=adamw",
        "Optimizer.lr=0.001", "Optimizer.accumulate_steps=2", "Model.embedding_size=512",
        "Global.max_steps=3", "Eval.targets=[]"], 3),
    "accum_int8": ("configs/demo.yaml", [
        "Loss.num_classes=1000000", "Loss.param_dtype=int8", "Optimizer.accumulate_steps=2",
        "Model.embedding_size=512", "Global.max_steps=3", "Eval.targets=[]"]),
    "pfc_accum_bf16": ("configs/demo.yaml", [
        "Loss.num_classes=1000000", "Loss.sample_ratio=0.3", "Loss.param_dtype=bfloat16",
        "Optimizer.accumulate_steps=2", "Model.embedding_size=512", "Global.max_steps=3",
        "Eval.targets=[]"]),
    "unfused_f32": ("configs/demo.yaml", [
        "Loss.num_classes=500000", "Optimizer.fused_head_update=false",
        "Model.embedding_size=512", "Global.max_steps=3", "Eval.targets=[]"]),
    "vit_s": ("configs/demo_vit.yaml", [
        "Model.name=ViT_S", "Model.embedding_size=512", "Data.image_size=[112,112]",
        "Data.batch_size=16", "Global.max_steps=3", "Eval.targets=[]"]),
    "demo_vit": ("configs/demo_vit.yaml", ["Global.max_steps=3"]),
    "r50_int8_int4": ("configs/demo.yaml", [
        "Model.name=IResNet50", "Data.image_size=[112,112]", "Data.batch_size=8",
        "Loss.num_classes=500000", "Loss.param_dtype=int8", "Optimizer.head_state_dtype=int4",
        "Model.embedding_size=512", "Global.max_steps=3", "Eval.targets=[]"], 1),
    "pfc03_4m_f32": ("configs/demo.yaml", [
        "Loss.num_classes=4000000", "Loss.sample_ratio=0.3", "Model.embedding_size=64",
        "Global.max_steps=3", "Eval.targets=[]"]),
    "f16_1rank": ("configs/demo.yaml", [
        "Loss.num_classes=1000000", "Loss.param_dtype=float16", "Model.embedding_size=256",
        "Global.max_steps=3", "Eval.targets=[]"], 1),
    "f16_3ranks": ("configs/demo.yaml", [
        "Loss.num_classes=1000000", "Loss.param_dtype=float16", "Model.embedding_size=256",
        "Global.max_steps=3", "Eval.targets=[]"], 3),
}


def ranks(name):
    return RUNS[name][2] if len(RUNS[name]) > 2 else 2


def overrides(name, out):
    config, extra = RUNS[name][:2]
    data = os.path.join(out, "demo_data")
    return config, extra + [f"Global.output_dir={os.path.join(out, name)}", f"Data.root={data}",
                            f"Eval.root={data}", "Global.checkpoint=null"]


def predict(name, out):
    from plsc.config import load_config
    from plsc.train.plan import plan
    config, over = overrides(name, out)
    p = plan(load_config(os.path.join(ROOT, config), over), ranks(name), "cpu")
    return p.total, p.memory


def measure(name, out):
    """(peak RSS of the largest rank, the largest rank's peak as polled, the command) of the
    launched run. The first is the tree's exact maximum (peak_rss.py's `tree_peak_rss_bytes`:
    the ranks are its largest processes), which also holds a peak after the last poll."""
    config, over = overrides(name, out)
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--log_dir",
           os.path.join(out, f"log_{name}"), "--nproc_per_node", str(ranks(name)), "tools/train.py", "-c", config]
    for o in over:
        cmd += ["-o", o]
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "peak_rss.py"), "--"]
                          + cmd, cwd=ROOT, capture_output=True, text=True)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if report["returncode"] != 0:
        raise RuntimeError(f"{name}: the run failed (exit {report['returncode']}): {done.stderr[-2000:]}")
    peaks = [v for pid, v in report["peak_rss_bytes"].items()
             if "tools/train.py" in report["commands"][pid] and "distributed.launch" not in
             report["commands"][pid]]
    return max(max(peaks), report["tree_peak_rss_bytes"]), max(peaks), " ".join(cmd[1:])


def prepare_data(out):
    """The demo's synthetic data under OUT, made once here (as configs/demo.yaml's first run
    makes it), so that no launched run waits for it at start-up."""
    from plsc.config import load_config
    from plsc.data.synthetic import generate
    data = os.path.join(out, "demo_data")
    if not os.path.isfile(os.path.join(data, "train.idx")):
        d = load_config(os.path.join(ROOT, "configs/demo.yaml"))["Data"]
        generate(data, image_size=d["image_size"][0], **d["synthetic"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="/tmp/plan_runs", help="output folders and the demo's data")
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--predict-only", action="store_true", help="print the predictions, run nothing")
    args = p.parse_args(argv)
    if not args.predict_only:
        prepare_data(args.out)
    for name in args.runs:
        predicted, terms = predict(name, args.out)
        line = {"run": name, "ranks": ranks(name), "predicted_bytes": predicted,
                "terms": {k: v for k, v in terms.items() if v}}
        if not args.predict_only:
            measured, polled, cmd = measure(name, args.out)
            line.update(measured_bytes=measured, polled_bytes=polled,
                        error=round(predicted / measured - 1, 4),
                        command="python " + cmd)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    sys.exit(main())
