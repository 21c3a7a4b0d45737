"""The examples of README.md and the user's guide (the pages of mkdocs.yml's "Guide" section)
run as written.

Every fenced shell or Python block there carries a mark on the line before its fence:

    <!-- run -->                  run as written
    <!-- run: small -->           run with SMALL's overrides appended to each `tools/train.py`
    <!-- not run: PHRASE -->      not run; PHRASE, the reason, must be visible prose next to the
                                  block (the paragraph before the mark or the one after the block)

The runnable blocks run in page order (README first, then the guide in nav order) and in order
within a page, all in one temporary folder, so a later block reads what an earlier one wrote
(the demo's `output/demo`). The folder has links to the repository's `configs/`, `demo/` and
`tools/`; PYTHONPATH holds this tree and `python` is this interpreter. Shell blocks run with
`bash -e -o pipefail`, Python blocks as a script.
"""
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHELL, PYTHON = {"bash", "sh", "shell", "console"}, {"python", "py"}
FENCE = re.compile(r"^( *)```(\S*)\s*$")
MARK = re.compile(r"^\s*<!-- (run|run: small|not run: (.+?)) -->\s*$")
# `run: small`: the demo at a size that trains in seconds (16 identities, 2 steps); the
# launcher's start-up is most of its 15 s
SMALL = ["-o", "Global.max_steps=2", "-o", "Loss.num_classes=16", "-o", "Data.batch_size=4",
         "-o", "Data.synthetic={num_identities: 16, images_per_identity: 2, "
               "num_val_identities: 4, num_pairs: 20}", "-o", "Eval.batch_size=8"]
LINKED = ("configs", "demo", "tools")


def guide_pages():
    """README.md and the pages of mkdocs.yml's "Guide" section, as paths under ROOT."""
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        nav = yaml.safe_load(f)["nav"]
    guide = next(item["Guide"] for item in nav if isinstance(item, dict) and "Guide" in item)
    return ["README.md"] + ["docs/" + next(iter(p.values())) for p in guide]


def paragraph(lines, edge, way):
    """The lines of the paragraph next to line `edge` (excluded): before it (`way` -1) or from
    it on (1), blank lines between skipped."""
    at = edge - 1 if way < 0 else edge
    while 0 <= at < len(lines) and not lines[at].strip():
        at += way
    found = []
    while 0 <= at < len(lines) and lines[at].strip() and not FENCE.match(lines[at]):
        found.append(lines[at])
        at += way
    return found[::way]


def blocks(page):
    """Each fenced block of `page`: dict(line, lang, body, mark, reason, near)."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        lines = f.read().split("\n")
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = i + 1
        while not re.match(r"^ *```\s*$", lines[end]):
            end += 1
        indent = len(m.group(1))
        mark = MARK.match(lines[i - 1]) if i else None
        near = " ".join(paragraph(lines, i - 1 if mark else i, -1) + paragraph(lines, end + 1, 1))
        found.append(dict(line=i + 1, lang=m.group(2), mark=mark and mark.group(1),
                          reason=mark and mark.group(2),
                          near=" ".join(re.sub(r"<!--.*?-->", " ", near).split()),
                          body="\n".join(l[indent:] for l in lines[i + 1:end])))
        i = end + 1
    return found


def test_every_shell_and_python_block_is_marked():
    pages, problems, runnable = guide_pages(), [], 0
    assert "docs/training.md" in pages and "docs/faults.md" in pages, pages
    for page in pages:
        for b in blocks(page):
            if b["lang"] not in SHELL | PYTHON:
                continue
            where = f"{page}:{b['line']}"
            if b["mark"] is None:
                problems.append(f"{where}: no <!-- run --> or <!-- not run: REASON --> mark")
            elif b["reason"] and " ".join(b["reason"].split()).lower() not in b["near"].lower():
                problems.append(f"{where}: the reason {b['reason']!r} is not in the prose "
                                "next to the block")
            runnable += b["mark"] in ("run", "run: small")
    assert not problems, "\n".join(problems)
    assert runnable >= 3, runnable  # README's demo, its loop and demo/partial_fc_demo.py


def test_a_missing_mark_and_an_absent_reason_are_found(tmp_path, monkeypatch):
    """The check above on a page with one block of each kind of fault (and one good block)."""
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text("Needs a GPU:\n<!-- not run: needs a GPU -->\n```bash\nx\n```\n\n"
                    "Text.\n<!-- not run: needs MS1MV3 -->\n```bash\ny\n```\n\n"
                    "```python\nz\n```\n", encoding="utf-8")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    monkeypatch.setattr(sys.modules[__name__], "guide_pages",
                        lambda: ["docs/page.md", "docs/training.md", "docs/faults.md"])
    for name in ("training", "faults"):
        (tmp_path / "docs" / f"{name}.md").write_text("", encoding="utf-8")
    with pytest.raises(AssertionError) as err:
        test_every_shell_and_python_block_is_marked()
    assert "page.md:3" not in str(err.value)
    assert "page.md:9: the reason 'needs MS1MV3'" in str(err.value)
    assert "page.md:13: no <!-- run -->" in str(err.value)


def with_small(body):
    """`body` with SMALL appended to each line that runs tools/train.py (before a comment)."""
    extra = " " + " ".join(shlex.quote(a) for a in SMALL)
    out = []
    for line in body.split("\n"):
        if "tools/train.py" in line:
            code, hash_, comment = line.partition("  #")
            line = code.rstrip() + extra + ("  " + hash_.strip() + comment if hash_ else "")
        out.append(line)
    return "\n".join(out)


def test_runnable_blocks_run_as_written(tmp_path):
    for name in LINKED:
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    runnable = [(page, b) for page in guide_pages() for b in blocks(page)
                if b["mark"] in ("run", "run: small")]
    assert runnable
    for index, (page, b) in enumerate(runnable):
        body = with_small(b["body"]) if b["mark"] == "run: small" else b["body"]
        if b["lang"] in PYTHON:
            script = tmp_path / f"example_{index}.py"
            script.write_text(body + "\n", encoding="utf-8")
            cmd = [sys.executable, str(script)]
        else:
            cmd = ["bash", "-e", "-o", "pipefail", "-c", body]
        done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, (f"{page}:{b['line']} exited {done.returncode}\n{body}\n"
                                      f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
