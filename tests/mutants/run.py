"""Run the curated mutants: each deliberate bug must make its named tests fail.

    python tests/mutants/run.py [NAME ...] [--list] [--keep] [--jobs N]

Every `tests/mutants/*.patch` is a unified diff (as `git diff` writes it) preceded by a
header of `# key: value` lines:

    # mutant: arcface-default-m
    # bug: ArcFace() defaults to m = 0.45 instead of the published 0.5
    # run: tests/test_margins.py -k defaults

For each mutant this script copies the working tree (without .git, .venv and caches) to a
scratch directory, applies the patch there with `git apply` (a patch that no longer applies
is a failure, so drift of the code under it is noticed), checks that Python imports the
scratch copy's `plsc` (PYTHONPATH first, ahead of the editable install of the venv), then
runs each `run:` line as `python -m pytest -q -x <line>` in the scratch copy. The mutant is
killed when every run line fails (pytest exit code 1: each line is a claim, "these tests
catch it"); it survives when a run line passes. Any other outcome (nothing collected, a
usage error, a timeout) is an error, not a kill. The script exits non-zero if any mutant
survives or errs. The run lines are trusted to pass without the mutant (CI runs the whole
suite too); `--baseline` checks that as well, at twice the time. `--jobs N` runs N mutants at
once, each in its own scratch copy (results print as they end, the summary last).
"""
import argparse
import concurrent.futures
import glob
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
IGNORE = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", ".pytest_cache",
                                "output", "log", "build", "dist")
TIMEOUT = 600  # seconds per run line


def read_header(path):
    """The `# key: value` lines before the diff: {key: [values]}."""
    header = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("diff --git") or line.startswith("--- "):
                break
            if line.startswith("#") and ":" in line:
                key, value = line[1:].split(":", 1)
                header.setdefault(key.strip(), []).append(value.strip())
    for key in ("mutant", "bug", "run"):
        if key not in header:
            raise SystemExit(f"{path}: header has no '# {key}:' line")
    return header


def run_mutant(path, keep=False, baseline=False):
    """('killed' | 'survived' | 'error', detail, seconds). With `baseline`, the run lines
    first run on the unpatched copy and must pass there (else 'error')."""
    header = read_header(path)
    start = time.time()
    scratch = tempfile.mkdtemp(prefix=f"plsc-mutant-{header['mutant'][0]}-")
    try:
        tree = os.path.join(scratch, "plsc")
        shutil.copytree(REPO, tree, ignore=IGNORE)
        if baseline:
            outcome, detail, _ = _run_lines(header, tree)
            if outcome != "survived":
                return "error", f"fails without the mutant: {detail}", time.time() - start
        applied = subprocess.run(["git", "apply", "--whitespace=nowarn", path], cwd=tree,
                                 capture_output=True, text=True)
        if applied.returncode != 0:
            return "error", f"patch does not apply:\n{applied.stderr.strip()}", time.time() - start
        outcome, detail, _ = _run_lines(header, tree)
        return outcome, detail, time.time() - start
    finally:
        if keep:
            print(f"  scratch copy kept: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


def _run_lines(header, tree):
    """Run the header's run lines in `tree`: ('killed' | 'survived' | 'error', detail, None)."""
    env = dict(os.environ, PYTHONPATH=tree + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONDONTWRITEBYTECODE="1")
    where = subprocess.run([sys.executable, "-c", "import plsc; print(plsc.__file__)"],
                           cwd=tree, env=env, capture_output=True, text=True)
    if not where.stdout.strip().startswith(tree + os.sep):
        return "error", f"plsc imported from {where.stdout.strip() or where.stderr}, not the " \
                        f"scratch copy {tree}", None
    caught = []
    for line in header["run"]:
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
               *shlex.split(line)]
        try:
            proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                                  timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            return "error", f"timed out: {line}", None
        if proc.returncode == 0:
            return "survived", f"passed: {line}", None
        if proc.returncode != 1:
            return "error", f"{line}: pytest exit code {proc.returncode}\n" \
                            f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}", None
        failed = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAILED")]
        caught.append(f"{line} -> {failed[0] if failed else 'failed'}")
    return "killed", "; ".join(caught), None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", help="mutant names (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copies")
    ap.add_argument("--jobs", type=int, default=1, metavar="N",
                    help="mutants run at once (default 1; CI: 2, one per core)")
    ap.add_argument("--baseline", action="store_true",
                    help="first run each mutant's tests without it: they must pass (CI runs the "
                         "whole suite before this step instead)")
    args = ap.parse_args()
    paths = sorted(glob.glob(os.path.join(HERE, "*.patch")))
    if args.names:
        paths = [p for p in paths if read_header(p)["mutant"][0] in args.names
                 or os.path.basename(p)[:-len(".patch")] in args.names]
        if not paths:
            raise SystemExit(f"no mutant named {args.names}")
    if args.list:
        for p in paths:
            h = read_header(p)
            print(f"{h['mutant'][0]}: {h['bug'][0]}\n    run: " + "\n    run: ".join(h["run"]))
        return 0
    start, bad = time.time(), []
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        runs = {pool.submit(run_mutant, p, args.keep, args.baseline): read_header(p)["mutant"][0]
                for p in paths}
        for run in concurrent.futures.as_completed(runs):
            name = runs[run]
            outcome, detail, secs = run.result()
            print(f"{outcome.upper():8s} {name} ({secs:.0f} s): {detail}", flush=True)
            if outcome != "killed":
                bad.append(name)
    print(f"{len(paths) - len(bad)}/{len(paths)} mutants killed in {time.time() - start:.0f} s")
    if bad:
        print("not killed: " + ", ".join(sorted(bad)), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
