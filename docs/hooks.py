"""mkdocs hook (mkdocs.yml `hooks:`): headings get GitHub's anchors, which the pages' links use.

GitHub lowers the heading's text, drops every character but letters, digits, spaces, `-` and
`_`, and makes each space a hyphen (no collapsing: "IJB-B / IJB-C" gives `ijb-b--ijb-c`).
Markdown's default slug collapses hyphens, and pymdownx's strips `<target>` in
`best_<target>/` as if it were an HTML tag; this one does neither.
"""
import re
import unicodedata


def github_slug(text, separator):
    """The anchor GitHub gives a heading whose text is `text`."""
    text = unicodedata.normalize("NFC", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", separator)


def on_config(config):
    """Every page's table of contents (the `toc` extension) uses `github_slug`."""
    config.mdx_configs.setdefault("toc", {})["slugify"] = github_slug
    return config
