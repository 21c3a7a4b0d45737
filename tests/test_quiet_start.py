"""A first run without Paddle's noise: `import plsc` (and so every tool) hides the "No ccache
found" UserWarning Paddle 3.3 gives at import, and only that one (plsc.process.runtime)."""
import functools
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CCACHE = "No ccache found"


ENV = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}  # Python's default filters


def _python(code):
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


@functools.lru_cache(maxsize=1)
def _paddle_warns():
    """Whether a bare `import paddle` gives the warning here (not with a ccache on PATH)."""
    return CCACHE in _python("import paddle")


def test_import_plsc_hides_paddles_ccache_warning_and_no_other():
    if not _paddle_warns():
        pytest.skip("this Paddle does not warn about ccache (a ccache on PATH, or another version)")
    out = _python(
        "import warnings\n"
        "import plsc, paddle\n"
        "warnings.warn('No ccache found, said by the user')\n"  # the same words, another module
        "warnings.warn_explicit('another warning', UserWarning, 'extension_utils.py', 1,\n"
        "                      module='paddle.utils.cpp_extension.extension_utils')\n"
        "warnings.warn('a DeprecationWarning of the user', DeprecationWarning)\n")
    assert "No ccache found. Please" not in out, out
    assert "No ccache found, said by the user" in out, out
    assert "another warning" in out, out
    assert "a DeprecationWarning of the user" in out, out


def test_one_training_step_of_the_demo_prints_no_ccache_line(tmp_path):
    if not _paddle_warns():
        pytest.skip("this Paddle does not warn about ccache")
    data = tmp_path / "data"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "train.py"), "-c",
           os.path.join(ROOT, "configs", "demo.yaml"),
           "-o", f"Global.output_dir={tmp_path / 'run'}", "-o", "Global.max_steps=1",
           "-o", f"Data.root={data}", "-o", f"Eval.root={data}", "-o", "Eval.targets=[]",
           "-o", "Loss.num_classes=20", "-o", "Data.image_size=[32, 32]", "-o", "Data.batch_size=8",
           "-o", "Data.synthetic={num_identities: 20, images_per_identity: 2, "
                 "num_val_identities: 4, num_pairs: 10}"]
    done = subprocess.run(cmd, cwd=str(tmp_path), env=ENV, capture_output=True, text=True,
                          timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "step 1/1" in out, out
    assert "ccache" not in out, out
