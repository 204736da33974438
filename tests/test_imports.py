"""The import arrows run one way: models -> ops -> kernels; no module of tfjax or pallas_kernels imports itself back.

Read from the source (ast), every import anywhere in a module (function-level ones too, which only hide a circle)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tfjax", "pallas_kernels")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules `name` imports (`from a import b` names a.b when that is a module)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in known:
                    found.add(sub)
                elif base in known:
                    found.add(base)
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_of_tfjax_or_pallas_kernels_is_part_of_an_import_circle():
    assert _cycles(_graph()) == []


def test_kernel_modules_import_only_jax_numpy_and_their_own_package():
    allowed = {"jax", "jaxlib", "numpy", "pallas_kernels", "__future__", "dataclasses", "functools", "math"}
    bad = {}
    for path in (ROOT / "pallas_kernels").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad.setdefault(path.name, set()).update(n for n in names if n.split(".")[0] not in allowed)
    assert {k: v for k, v in bad.items() if v} == {}


def test_models_reach_kernels_only_through_ops():
    graph = _graph()
    direct = {m: sorted(d for d in deps if d.startswith("pallas_kernels")) for m, deps in graph.items()
              if m.startswith("tfjax.models")}
    assert {m: d for m, d in direct.items() if d} == {}


def test_the_checker_finds_a_circle_it_is_given():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
