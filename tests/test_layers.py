"""plsc's imports point down. Every import of a plsc module (read with `ast`, those inside
functions too) goes to the importer's own layer or one below, in the layer table of
docs/design.md; no modules import each other in a circle, and neither do the rooms of `plsc/`
(its packages and top-level modules)."""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def layer_table(design_text):
    """{prefix: layer} from the ```text block after `<!-- layers -->` in docs/design.md: one line
    a layer, its number first, then the dotted names it holds, then an optional `:` and prose."""
    m = re.search(r"<!-- layers -->\s*```text\n(.*?)```", design_text, re.S)
    if m is None:
        raise AssertionError("docs/design.md has no layer table (`<!-- layers -->` and a text block)")
    table = {}
    for line in m.group(1).splitlines():
        head = line.split(":", 1)[0].split()
        if not head:
            continue
        number, names = int(head[0]), head[1:]
        for name in names:
            assert name not in table, f"{name} is in two layers of docs/design.md"
            table[name] = number
    return table


def modules(package_dir):
    """{dotted name: path} of the package's Python files (a package is its `__init__`)."""
    out = {}
    base = package_dir.parent
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(name, path, known):
    """The plsc modules `name` (at `path`) imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            bases = [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            bases = [(base, [a.name for a in node.names])]
        else:
            continue
        for base, names in bases:
            subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in known]
            targets = subs if subs and len(subs) == len(names) else [base] + subs
            for t in targets:
                while t and t not in known:  # `import plsc.a.b` names plsc.a.b's module
                    t = t.rpartition(".")[0]
                if t and t != name:
                    found.add(t)
    return found


def layer_of(name, table):
    best = max((p for p in table if name == p or name.startswith(p + ".")), key=len, default=None)
    if best is None:
        raise AssertionError(f"{name} is in no layer of docs/design.md's layer table")
    return table[best]


def cycles(edges):
    """The strongly connected sets of more than one node (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    nodes = set(edges) | {t for ts in edges.values() for t in ts}
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def room(name, top):
    """The room of `plsc/` a module stands in: its package below `top`, or itself."""
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and parts[0] == top else name


def problems(package_dir, design_text):
    """Every upward import, circle of modules and circle of rooms, as lines."""
    table = layer_table(design_text)
    known = modules(package_dir)
    top = package_dir.name
    graph, out = {}, []
    for name, path in known.items():
        graph[name] = imports(name, path, known)
        for target in sorted(graph[name]):
            if top in (name, target):
                continue  # the package's own __init__: above all (its lazy `Entry`), read by none
            if layer_of(target, table) > layer_of(name, table):
                out.append(f"{name} (layer {layer_of(name, table)}) imports {target} "
                           f"(layer {layer_of(target, table)})")
    graph = {n: {t for t in ts if t != top} for n, ts in graph.items() if n != top}
    for comp in cycles(graph):
        out.append("modules in a circle: " + ", ".join(comp))
    rooms = {}
    for name, targets in graph.items():
        rooms.setdefault(room(name, top), set()).update(
            room(t, top) for t in targets if room(t, top) != room(name, top))
    for comp in cycles(rooms):
        out.append("rooms of plsc/ in a circle: " + ", ".join(comp))
    return out


def test_plsc_imports_point_down():
    design = (ROOT / "docs" / "design.md").read_text()
    assert problems(ROOT / "plsc", design) == []


def _tree(tmp_path, files):
    for rel, text in files.items():
        p = tmp_path / "pkg" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path / "pkg"


TABLE = "<!-- layers -->\n```text\n3  pkg.top\n2  pkg.mid: middle\n1  pkg.low\n```\n"


@pytest.mark.parametrize("files, expected", [
    ({"mid/__init__.py": "from ..low import f\n", "low.py": ""}, []),
    ({"mid/__init__.py": "", "low.py": "def f():\n    from .mid import g\n"},
     ["pkg.low (layer 1) imports pkg.mid (layer 2)"]),
    ({"mid/__init__.py": "", "mid/a.py": "from . import b\n", "mid/b.py": "from .a import x\n"},
     ["modules in a circle: pkg.mid.a, pkg.mid.b"]),
    ({"top/__init__.py": "", "top/a.py": "import pkg.top2.b\n", "top2/__init__.py": "",
      "top2/b.py": "from ..top import c\n", "top/c.py": ""}, None),
])
def test_the_check_finds_upward_imports_and_circles(tmp_path, files, expected):
    pkg = _tree(tmp_path, {"__init__.py": "", **files})
    table = TABLE.replace("pkg.top\n", "pkg.top pkg.top2\n")
    found = problems(pkg, table)
    if expected is None:  # two rooms of one layer importing each other: no module circle
        assert found == ["rooms of plsc/ in a circle: pkg.top, pkg.top2"]
    else:
        assert found == expected


def test_a_module_outside_the_table_is_named(tmp_path):
    pkg = _tree(tmp_path, {"__init__.py": "", "stray.py": "from . import low\n", "low.py": ""})
    with pytest.raises(AssertionError, match="pkg.stray is in no layer"):
        problems(pkg, TABLE)
