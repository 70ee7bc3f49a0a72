"""The packages of sfcl import one way: the graph of imports between packages (``sfcl.X``; module
level and function-local imports alike, read from the source with ``ast``) has no cycle, and no
domain package imports the command line (``sfcl.cli``)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import sfcl

ROOT = Path(sfcl.__file__).parent
SURFACES = {"sfcl.cli"}  # nothing below may import these


def package_edges(root: Path) -> dict[str, dict[str, list[str]]]:
    """{package: {imported package: ["file:line", ...]}} over every ``import``/``from`` statement
    of every module under ``root`` (a package directory), packages being ``<root>.X`` for each
    subpackage or top-level module X; imports within one package are left out."""
    top = root.name
    edges: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))

    def package(module: str) -> str | None:
        parts = module.split(".")
        if parts[0] != top or len(parts) < 2:
            return None
        return f"{top}.{parts[1]}" if (root / parts[1]).is_dir() or (root / f"{parts[1]}.py").is_file() else None

    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root.parent).with_suffix("").parts
        is_init = rel[-1] == "__init__"
        module = ".".join(rel[:-1] if is_init else rel)
        here = package(module)
        if here is None:
            continue
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against this module's package
                    base = module.split(".") if is_init else module.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                names = [mod] + [f"{mod}.{a.name}" for a in node.names]
            else:
                continue
            for other in {p for p in map(package, names) if p and p != here}:
                edges[here][other].append(f"{f.relative_to(root.parent)}:{node.lineno}")
    return edges


def cycles(edges: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """Strongly connected components of more than one package (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
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

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def _explain(edges, comp) -> str:
    return "\n".join(f"  {a} -> {b}: {', '.join(edges[a][b][:3])}" for a in comp for b in edges[a] if b in comp)


def test_the_packages_of_sfcl_import_without_a_cycle():
    edges = package_edges(ROOT)
    assert "sfcl.engine" in edges and "sfcl.snapshot" in edges["sfcl.engine"]  # the walk sees real imports
    found = cycles(edges)
    assert not found, "import cycles between packages:\n" + "\n".join(_explain(edges, c) for c in found)


def test_no_domain_package_imports_the_command_line():
    edges = package_edges(ROOT)
    bad = {a: edges[a][b] for a in edges for b in edges[a] if b in SURFACES}
    assert not bad, f"domain packages import the CLI: {bad}"


def test_the_walk_finds_a_cycle_through_a_function_local_import(tmp_path):
    pkg = tmp_path / "demo"
    for sub in ("a", "b", "c"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from demo.b.y import f\n")
    (pkg / "b" / "y.py").write_text("def f():\n    from ..c import z\n    return z\n")  # relative, in a function
    (pkg / "c" / "z.py").write_text("import demo.a.x\n")
    edges = package_edges(pkg)
    assert cycles(edges) == [["demo.a", "demo.b", "demo.c"]]
    (pkg / "c" / "z.py").write_text("import os\n")
    assert cycles(package_edges(pkg)) == []
