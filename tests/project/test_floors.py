"""The import shape of the package: floors only go downward, and no cycles between packages or files.

Floors, bottom up: errors < models < plugins < export < runtime < serve < cli (docs/ARCHITECTURE.md).
Every import counts, the ones inside functions too: a lazy import that runs back up is still a
dependency on a higher floor, and a lazy cycle is still a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLOORS = ("errors", "models", "plugins", "export", "runtime", "tools", "serve", "cli")
NOT_PACKAGE = {"tests", "bench", "scripts", "docs", "build"}
TOP = {"decodert", "decodert.__main__"}  # the package itself and `python -m decodert` sit above every floor


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (tests, bench, scripts left out)."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = f.relative_to(root).with_suffix("").parts
        if parts[0] in NOT_PACKAGE or any(p.startswith(".") or p.endswith(".egg-info") for p in parts):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(("decodert", *parts))] = f
    return out


def imported_names(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in the tree; ``from a import b`` gives a.b (resolved later)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module a dotted import name lands in (the longest prefix that is a module)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """module -> {imported project module: first line}."""
    modules = module_files(root)
    graph: dict[str, dict[str, int]] = {}
    for mod, f in modules.items():
        tree = ast.parse(f.read_text(), str(f))
        edges = graph.setdefault(mod, {})
        for line, name in imported_names(tree, mod, f.name == "__init__.py"):
            target = resolve(name, modules)
            if target is not None and target != mod:
                edges.setdefault(target, line)
    return graph


def floor_of(module: str) -> str | None:
    """The top-level package (or root module, e.g. errors) a module belongs to; None for the package root."""
    return None if module in TOP else module.split(".")[1]


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    bad = []
    for mod, edges in graph.items():
        a = floor_of(mod)
        for target, line in edges.items():
            b = floor_of(target)
            if a is None or b is None or a == b:
                continue
            if a not in FLOORS or b not in FLOORS:
                bad.append(f"{mod}:{line} imports {target}: {a if a not in FLOORS else b} is not a known floor")
            elif FLOORS.index(b) > FLOORS.index(a):
                bad.append(f"{mod}:{line} ({a}) imports {target} ({b}), a higher floor")
    return bad


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of a directed graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        path.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state and (c := visit(n)):
            return c
    return None


def package_edges(graph: dict[str, dict[str, int]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for mod, edges in graph.items():
        a = floor_of(mod)
        for target in edges:
            b = floor_of(target)
            if a is not None and b is not None and a != b:
                out.setdefault(a, set()).add(b)
    return out


def test_no_import_runs_back_up():
    bad = upward_imports(import_graph())
    assert not bad, "imports that run back up a floor:\n" + "\n".join(bad)


def test_no_cycle_between_packages():
    cycle = find_cycle(package_edges(import_graph()))
    assert cycle is None, "packages import each other in a loop: " + " -> ".join(cycle or [])


def test_no_cycle_between_files():
    graph = import_graph()
    cycle = find_cycle({mod: set(edges) for mod, edges in graph.items()})
    assert cycle is None, "modules import each other in a loop (lazy imports count): " + " -> ".join(cycle or [])


def test_the_checker_sees_what_it_must(tmp_path):
    """The walker itself: a lazy upward import, a relative import and a two-file cycle are all found."""
    (tmp_path / "export").mkdir()
    (tmp_path / "runtime").mkdir()
    (tmp_path / "errors.py").write_text("")
    (tmp_path / "export" / "__init__.py").write_text("")
    (tmp_path / "runtime" / "__init__.py").write_text("")
    (tmp_path / "export" / "a.py").write_text("def f():\n    from decodert.runtime import b\n")
    (tmp_path / "runtime" / "b.py").write_text("from . import c\nfrom decodert.errors import X\n")
    (tmp_path / "runtime" / "c.py").write_text("import decodert.runtime.b\n")
    graph = import_graph(tmp_path)
    assert graph["decodert.runtime.b"] == {"decodert.runtime.c": 1, "decodert.errors": 2}
    assert upward_imports(graph) == ["decodert.export.a:2 (export) imports decodert.runtime.b (runtime), a higher floor"]
    assert find_cycle({m: set(e) for m, e in graph.items()}) == ["decodert.runtime.b", "decodert.runtime.c", "decodert.runtime.b"]
    assert find_cycle(package_edges(graph)) is None
    (tmp_path / "runtime" / "c.py").write_text("import decodert.export.a\n")
    assert find_cycle(package_edges(import_graph(tmp_path))) == ["export", "runtime", "export"]
