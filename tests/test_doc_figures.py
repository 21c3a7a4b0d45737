"""The user's guide states each headline figure once, with a link to its measurement, and
carries no issue numbers or commit hashes (docs/measurements/index.md).

The guide is README.md, docs/index.md and the pages of mkdocs.yml's "Guide" section; the
measurement pages (mkdocs.yml's "Measurements" section) are exempt: they keep per-sitting
detail. Each headline figure is found in README by a pattern (so a re-measured figure needs no
edit here), then counted, as written, across the whole guide.
"""
import os
import re

import pytest

from test_doc_examples import ROOT, guide_pages

# name: pattern finding the figure(s) in README (for the ratios: the bullet stating them)
HEADLINES = {
    "the demo's wall time": r"\b\d{3}-\d{3} s\b",
    "bytes a class with 4-bit state": r"4-bit\b.{0,120}?\b(\d{3} B)\b",
    "whole-run ratios against arcface_torch": r"\*\*Whole runs.*?\(\[",
}
RATIO = r"\b\d\.\d\d(?:-\d\.\d\d)?x"
MEASURED = re.compile(r"\]\(docs/(?:performance|memory_and_benchmarks|scaling|measurements/)")
ISSUE = re.compile(r"\b[Ii]ssues?\s+#?\d+|(?<![\w&/#])#\d+\b")
# a commit hash: 7-40 hex digits, a letter and a digit among them (a CRC-32 in an example
# message is named as one, and its "says" twin, and is left alone)
HASH = re.compile(r"(?<![\w-])(?<!CRC-32 )(?<!says )(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w-])")


def pages():
    return guide_pages()[:1] + ["docs/index.md"] + guide_pages()[1:]


def read(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def prose(text):
    """`text` as a reader sees it: without link targets and HTML comments (fenced blocks
    kept: an example may not cite a commit either)."""
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
    return re.sub(r"\]\([^)]*\)", "]", text)


def figures(readme):
    """{name: (the figures as README writes them, the 400 characters from the first)}."""
    unwrapped = " ".join(readme.split())
    found = {}
    for name, pattern in HEADLINES.items():
        matches = list(re.finditer(pattern, unwrapped))
        assert matches, f"README.md states no {name} (pattern {pattern!r})"
        if name.startswith("whole-run"):
            start = matches[0].start()
            stated = re.findall(RATIO, unwrapped[start:unwrapped.index("))", start)])
        else:
            stated = [m.group(m.lastindex or 0) for m in matches]
        found[name] = (stated, unwrapped[matches[0].start():matches[0].start() + 400])
    return found


def test_headline_figures_once_with_a_link():
    texts = {page: " ".join(prose(read(page)).split()) for page in pages()}
    for name, (stated, para) in figures(read("README.md")).items():
        assert stated, name
        for figure in stated:
            where = {p: len(re.findall(r"(?<![\d.,])" + re.escape(figure) + r"(?![\d])", t))
                     for p, t in texts.items()}
            where = {p: n for p, n in where.items() if n}
            assert sum(where.values()) == 1, (
                f"{name}: {figure!r} should be stated once in README and the guide, found "
                f"{where} (other mentions link to README or the measurement page instead)")
        assert MEASURED.search(para), f"{name}: no link to its measurement page near it"


@pytest.mark.parametrize("page", pages())
def test_no_issue_numbers_or_commit_hashes(page):
    for n, line in enumerate(prose(read(page)).split("\n"), 1):
        for regex, what in ((ISSUE, "an issue number"), (HASH, "a commit hash")):
            m = regex.search(line)
            assert not m, (f"{page}:{n}: {what} ({m.group(0)!r}) in a guide page: per-sitting "
                           f"detail belongs in docs/measurements/")


def test_the_checks_see_what_they_should():
    """The patterns themselves: positives found, negatives left alone."""
    assert ISSUE.search("fixed in issue 48") and ISSUE.search("see #59.")
    assert not ISSUE.search("exit 75, step 40, the `#` of a comment, &#39;")
    assert HASH.search("the checkout at 7fadd420 of") and HASH.search("commit ab27f4d6.")
    assert not HASH.search("1000000 classes, 20,000,000, facade, deadbeef-x, step_00000040, "
                          "CRC-32 d6fba498, the manifest says 1c9f6314")
    fig = figures("intro\n- **Whole runs against it**: plsc at 1.26-1.38x, R50 at\n1.18x "
                  "([whole runs](docs/performance.md)).\n It takes 163-174 s\n"
                  "([measured](docs/performance.md)). with 4-bit state 808 B at peak "
                  "([4-bit](docs/memory_and_benchmarks.md#x))")
    assert fig["whole-run ratios against arcface_torch"][0] == ["1.26-1.38x", "1.18x"]
    assert fig["the demo's wall time"][0] == ["163-174 s"]
    assert fig["bytes a class with 4-bit state"][0] == ["808 B"]
