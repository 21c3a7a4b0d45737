"""The API reference (docs/api/, built by mkdocs + mkdocstrings, mkdocs.yml): every public name
of the documented modules has a docstring, and the built pages show every one of them.

Public names: each module's `__all__`; for each class among them, the methods and properties
defined in it or in a plsc base class whose names do not start with `_`. Functions, classes and
properties are read by import (their own `__doc__`, not an inherited one); a constant's
docstring is the string literal after its assignment (the form mkdocstrings shows) in the
module that assigns it.
"""
import ast
import importlib
import inspect
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = ("plsc.nn", "plsc.loss", "plsc.optim", "plsc.data", "plsc.search", "plsc.entry")


def constant_doc(obj, name, package):
    """(docstring or None, module) of constant `obj`: the string literal after the top-level
    `name = ...` of the module of `package` that assigns it."""
    for module_name, module in list(sys.modules.items()):
        if module_name.split(".")[0] != package or vars(module).get(name, None) is not obj:
            continue
        with open(module.__file__, encoding="utf-8") as f:
            body = ast.parse(f.read()).body
        for node, after in zip(body, body[1:] + [None]):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, ast.AnnAssign) else [])
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                if (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                        and isinstance(after.value.value, str) and after.value.value.strip()):
                    return after.value.value, module_name
                return None, module_name
    return None, None


def _own_doc(obj):
    """obj's own docstring (None or blank: none), not one inherited from a base class."""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        obj = obj.fget
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    return doc if doc and doc.strip() else None


def _is_documentable(obj):
    return (inspect.isclass(obj) or inspect.isfunction(obj) or isinstance(obj, property)
            or isinstance(obj, (staticmethod, classmethod)))


def public_names(module_name):
    """[(qualified name, docstring or None, the ids the built page may give it)] of the module
    and its public names: its own path, or the path where the object (or the plsc base class
    a method comes from) is defined, for a lazily exported name or an inherited method."""
    module = importlib.import_module(module_name)
    package = module_name.split(".")[0]
    rows = [(module_name, _own_doc(module), {module_name})]
    for name in module.__all__:
        obj = getattr(module, name)
        qual = f"{module_name}.{name}"
        if not _is_documentable(obj):
            doc, home = constant_doc(obj, name, package)
            rows.append((qual, doc, {qual, f"{home}.{name}"}))
            continue
        rows.append((qual, _own_doc(obj), {qual, f"{obj.__module__}.{obj.__qualname__}"}))
        if not inspect.isclass(obj):
            continue
        seen = set()
        for klass in obj.__mro__:  # plsc's own bases: their public methods are this class's API
            if klass.__module__.split(".")[0] != package:
                continue
            for member, value in vars(klass).items():
                if member.startswith("_") or member in seen or not _is_documentable(value):
                    continue
                seen.add(member)
                ids = {f"{qual}.{member}", f"{klass.__module__}.{klass.__qualname__}.{member}",
                       f"{module_name}.{klass.__qualname__}.{member}"}
                rows.append((f"{qual}.{member}", _own_doc(value), ids))
    return rows


def test_every_public_name_has_a_docstring():
    rows = [row for module in MODULES for row in public_names(module)]
    missing = [name for name, doc, _ in rows if doc is None]
    assert not missing, f"{len(missing)} public names without a docstring: {', '.join(missing)}"
    # The walk reaches what it must: classes' methods and properties, constants, lazy exports.
    names = {name for name, _, _ in rows}
    assert {"plsc.nn.PartialFC.row_gradient", "plsc.entry.Entry.set_model_name",
            "plsc.optim.SparseMomentum", "plsc.search.KINDS", "plsc.loss.ArcFace",
            "plsc.data.ARCFACE_POINTS"} <= names


def test_the_walk_finds_a_missing_docstring(tmp_path, monkeypatch):
    """The checker itself: an undocumented function, method and constant are reported."""
    (tmp_path / "apidoc_probe").mkdir()
    (tmp_path / "apidoc_probe" / "__init__.py").write_text(
        '"""Probe."""\nfrom .inner import LIMIT, Thing, bare\n__all__ = ["LIMIT", "Thing", "bare"]\n')
    (tmp_path / "apidoc_probe" / "inner.py").write_text(
        'LIMIT = 3\n\nclass Thing:\n    """A thing."""\n    def go(self):\n        pass\n'
        '    @property\n    def size(self):\n        """Its size."""\n\ndef bare():\n    pass\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = {name: doc for name, doc, _ in public_names("apidoc_probe")}
    assert sorted(name for name, doc in rows.items() if doc is None) == [
        "apidoc_probe.LIMIT", "apidoc_probe.Thing.go", "apidoc_probe.bare"]
    assert rows["apidoc_probe.Thing.size"] == "Its size."


def test_each_module_has_its_api_page():
    """docs/api/<name>.md renders the module (`::: plsc.<name>`) and is in mkdocs.yml's nav."""
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        nav = f.read()
    for module in MODULES:
        page = f"api/{module.split('.')[1]}.md"
        with open(os.path.join(ROOT, "docs", page), encoding="utf-8") as f:
            assert re.search(rf"^::: {re.escape(module)}$", f.read(), re.M), page
        assert re.search(rf"^\s+- {re.escape(module)}: {re.escape(page)}$", nav, re.M), page


@pytest.mark.skipif(not os.environ.get("PLSC_DOCS_SITE"),
                    reason="PLSC_DOCS_SITE (a built site: .ci/run's docs step sets it) not set")
def test_the_built_pages_show_every_public_name():
    """Every public name has an anchor on its module's page of the built site (mkdocstrings
    gives each rendered object the id of its path; a lazily exported name, as plsc.loss's
    margins, is shown under the module that defines it)."""
    site = os.environ["PLSC_DOCS_SITE"]
    absent = []
    for module in MODULES:
        with open(os.path.join(site, "api", module.split(".")[1], "index.html"),
                  encoding="utf-8") as f:
            shown = set(re.findall(r'id="([\w.]+)"', f.read()))
        absent += [name for name, _, ids in public_names(module) if not ids & shown]
    assert not absent, f"public names not on the API pages: {', '.join(absent)}"
