"""The planner's images/s against published throughputs (plsc/train/plan/speed.py: CALIBRATION,
the runs its efficiency factors are fitted to, and HELD_OUT, runs they were not): fits the factors
again from the planner's own FLOPs and wire bytes, and prints one JSON line per run (published,
predicted, error, the step's bound) and a last line with the fit. No GPU needed; docs/scaling.md
shows the output.

    python benchmarks/calibrate_speed.py
"""
import json

from plsc.process import startup

startup.hold()

from plsc.config import load_config  # noqa: E402
from plsc.train.plan import plan, speed  # noqa: E402


def main():
    plans = [(pub, plan(load_config(pub.config, list(pub.overrides)), pub.ranks, pub.device))
             for pub in speed.CALIBRATION + speed.HELD_OUT]
    fitted = speed.fit([(p, pub.images_per_s) for pub, p in plans[:len(speed.CALIBRATION)]])
    worst = 0.0
    for i, (pub, p) in enumerate(plans):
        s = speed.speed(p, efficiency=fitted)
        err = s["images_per_s"] / pub.images_per_s - 1
        worst = max(worst, abs(err))
        print(json.dumps({"run": pub.label, "used": i < len(speed.CALIBRATION),
                          "command": f"-c {pub.config} " + " ".join(f"-o {o}" for o in pub.overrides)
                          + f" --device {pub.device} --ranks {pub.ranks}",
                          "published": pub.images_per_s, "predicted": round(s["images_per_s"]),
                          "error": round(err, 4), "bound": s["bound"],
                          "terms_ms": {k: round(1000 * v, 2) for k, v in s["terms_s"].items()},
                          "source": pub.source}))
    print(json.dumps({"fitted": {k: float(f"{v:.4g}") for k, v in fitted.items()},
                      "in_code": speed.EFFICIENCY, "worst_error": round(worst, 4)}))


if __name__ == "__main__":
    main()
