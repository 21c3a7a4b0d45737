"""Runs the head's multi-rank cases (tests/head_cases/, one module per family) in one group
of real gloo ranks.

    conftest.run_ranks(tests/head_ranks.py, K)

Every rank builds the same global data; rank 0 reports one JSON object with, per case, the
relative errors against the oracles (or the error raised).
"""
import os
import traceback

import rank_report
from plsc.process import ending
from head_cases.adaface_subcenters import (ADAFACE_CASES, SUBCENTER_CASES, adaface_case_name,
                                           check_adaface_clamps, check_adaface_steps,
                                           check_subcenters, subcenter_case_name)
from head_cases.common import case_name, margins
from head_cases.dtypes import check_dtype_vs_float32, dtype_case_name, dtype_cases
from head_cases.filtering import FILTER_CASES, check_filtered, filter_case_name
from head_cases.fused import check_fused_vs_separate, fused_case_name, fused_cases
from head_cases.group import check_bad_input, check_collectives
from head_cases.oracle import check_against_oracles, oracle_cases

DEVICE = "device:"  # the report's prefix of the cases run on the device kernel set


def run():
    import paddle
    import plsc.distributed as pd
    paddle.set_device("cpu")
    pd.init()
    results = {"world_size": pd.get_world_size(), "backend": pd.get_backend()}
    cases = [("collectives", check_collectives), ("bad_input", check_bad_input)]
    for name, margin, c, ratio, chunk in oracle_cases():
        cases.append((case_name(name, c, ratio, chunk),
                      lambda m=margin, c=c, r=ratio, k=chunk: check_against_oracles(m, c, r, k)))
    ms = margins()
    for dt, name, c, ratio, chunk in dtype_cases():
        cases.append((dtype_case_name(dt, name, c, ratio, chunk),
                      lambda m=ms[name], c=c, r=ratio, k=chunk, dt=dt:
                      check_dtype_vs_float32(m, c, r, k, dt)))
    for opt, name, c, ratio, chunk, dt in fused_cases():
        cases.append((fused_case_name(opt, name, c, ratio, chunk, dt),
                      lambda o=opt, m=ms[name], c=c, r=ratio, k=chunk, dt=dt:
                      check_fused_vs_separate(o, m, c, r, k, dt)))
    for name, c, ratio, chunk, kk, ties in SUBCENTER_CASES:
        cases.append((subcenter_case_name(name, c, ratio, chunk, kk),
                      lambda m=ms[name], c=c, r=ratio, ch=chunk, kk=kk, t=ties:
                      check_subcenters(m, c, r, ch, kk, t)))
    for c, ratio, chunk, s in ADAFACE_CASES:
        cases.append((adaface_case_name(c, ratio, chunk, s),
                      lambda c=c, r=ratio, ch=chunk, s=s: check_adaface_clamps(c, r, ch, s)))
    cases.append(("adaface-steps", check_adaface_steps))
    for name, c, ratio, chunk, kk in FILTER_CASES:
        cases.append((filter_case_name(name, c, ratio, chunk, kk),
                      lambda m=name, c=c, r=ratio, ch=chunk, kk=kk:
                      check_filtered(m, c, r, ch, kk)))
    # The head's oracle cases again on the device kernel set (Paddle ops only, what a GPU
    # runs), in the same ranks: reported as DEVICE + name.
    device = [(DEVICE + name, fn) for name, fn in cases
              if not name.startswith(("collectives", "bad_input"))
              and not name.startswith("fused")]
    outer = os.environ.get("PLSC_KERNELS")
    for name, fn in cases + device:
        if name.startswith(DEVICE):
            os.environ["PLSC_KERNELS"] = "device"
        try:
            results[name] = fn()
        except Exception:  # recorded, so one failing case does not hide the others
            results[name] = {"error": traceback.format_exc()}
        finally:
            if outer is None:
                os.environ.pop("PLSC_KERNELS", None)
            else:
                os.environ["PLSC_KERNELS"] = outer
    if pd.get_rank() == 0:
        rank_report.write(results)


if __name__ == "__main__":
    run()
    ending.end(0)
