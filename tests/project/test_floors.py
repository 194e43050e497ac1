"""The import shape of the package: floors only go downward, and no cycles between packages, parts or files.

Floors, bottom up: errors < models < plugins < artifact < export | runtime < api < tools < serve < cli
(docs/ARCHITECTURE.md). export and runtime stand side by side on one floor: neither imports the other, what both
need (the artifact contract) is the floor below them, and api.py, the façade that exports a checkpoint before
the runtime opens it, the floor above. Every import counts, the ones inside functions too: a lazy import that
runs back up is still a dependency on a higher floor, and a lazy cycle is still a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLOORS: tuple[tuple[str, ...], ...] = (("errors",), ("models",), ("plugins",), ("artifact",), ("export", "runtime"),
                                       ("api",), ("tools",), ("serve",), ("cli",))
NOT_PACKAGE = {"tests", "bench", "scripts", "docs", "build"}
TOP = {"decodert", "decodert.__main__"}  # the package itself and `python -m decodert` sit above every floor
# Cycles between parts (sub-packages, and the root modules of a folder that has sub-packages) tolerated while they are
# being removed: none today. The test fails when a listed cycle no longer exists, so the list cannot outlive it.
ALLOWED_CYCLES: frozenset[tuple[str, ...]] = frozenset()


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


def level_of(package: str) -> int | None:
    """The floor a top-level package stands on (0 = the lowest), None when it is on none."""
    return next((i for i, floor in enumerate(FLOORS) if package in floor), None)


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every import of a higher floor, or of another package on the same floor (sideways)."""
    bad = []
    for mod, edges in graph.items():
        a = floor_of(mod)
        for target, line in edges.items():
            b = floor_of(target)
            if a is None or b is None or a == b:
                continue
            la, lb = level_of(a), level_of(b)
            if la is None or lb is None:
                bad.append(f"{mod}:{line} imports {target}: {a if la is None else b} is not a known floor")
            elif lb > la:
                bad.append(f"{mod}:{line} ({a}) imports {target} ({b}), a higher floor")
            elif lb == la:
                bad.append(f"{mod}:{line} ({a}) imports {target} ({b}), a package beside it on its floor (sideways)")
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


def part_of(module: str, packages: set[str]) -> str:
    """The part a module belongs to, without the ``decodert.`` prefix: inside a folder that has sub-packages each
    sub-package is one part and each module directly in it a part of its own (runtime/llm.py -> runtime.llm,
    runtime/chat/turn.py -> runtime.chat, runtime/backends/ort/backend.py -> runtime.backends.ort); a folder
    without sub-packages is one part (artifact/manifest.py -> artifact)."""
    parts = module.split(".")
    with_subpackages = {p.rsplit(".", 1)[0] for p in packages if "." in p}
    n = 2
    while n < len(parts) and ".".join(parts[:n]) in with_subpackages:
        n += 1
    return ".".join(parts[1:n]) or parts[0]


def part_cycles(graph: dict[str, dict[str, int]], packages: set[str]) -> set[tuple[str, ...]]:
    """Every set of parts that import each other in a loop (the strongly connected components of more than one
    part), each as a sorted tuple."""
    edges: dict[str, set[str]] = {}
    for mod, targets in graph.items():
        a = part_of(mod, packages)
        edges.setdefault(a, set()).update(b for b in (part_of(t, packages) for t in targets) if b != a)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[tuple[str, ...]] = set()

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.add(tuple(sorted([v, *component])))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def cycle_problems(found: set[tuple[str, ...]], allowed: frozenset[tuple[str, ...]]) -> list[str]:
    """A line per cycle that is not allowed, and per allowed cycle that no longer exists (the list is stale)."""
    return ([f"parts import each other in a loop (lazy imports count): {' <-> '.join(c)}" for c in sorted(found - allowed)]
            + [f"ALLOWED_CYCLES lists {' <-> '.join(c)}, which no longer exists: take it off" for c in sorted(allowed - found)])


def packages_of(root: Path = ROOT) -> set[str]:
    return {m for m, f in module_files(root).items() if f.name == "__init__.py"}


def test_no_import_runs_back_up():
    bad = upward_imports(import_graph())
    assert not bad, "imports that run back up a floor or sideways:\n" + "\n".join(bad)


def test_no_cycle_between_packages():
    cycle = find_cycle(package_edges(import_graph()))
    assert cycle is None, "packages import each other in a loop: " + " -> ".join(cycle or [])


def test_no_cycle_between_parts():
    problems = cycle_problems(part_cycles(import_graph(), packages_of()), ALLOWED_CYCLES)
    assert not problems, "\n".join(problems)


def test_no_cycle_between_files():
    graph = import_graph()
    cycle = find_cycle({mod: set(edges) for mod, edges in graph.items()})
    assert cycle is None, "modules import each other in a loop (lazy imports count): " + " -> ".join(cycle or [])


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_floor_checker_sees_what_it_must(tmp_path):
    """The walker itself: a lazy sideways import, a relative import, an artifact import that runs up and a two-file
    cycle are all found; export and runtime importing the artifact floor is fine."""
    _tree(tmp_path, {"errors.py": "", "artifact/__init__.py": "", "export/__init__.py": "", "runtime/__init__.py": "",
                     "artifact/m.py": "from decodert.errors import X\n",
                     "export/a.py": "import decodert.artifact.m\ndef f():\n    from decodert.runtime import b\n",
                     "runtime/b.py": "from . import c\nfrom decodert.artifact.m import X\n",
                     "runtime/c.py": "import decodert.runtime.b\n"})
    graph = import_graph(tmp_path)
    assert graph["decodert.runtime.b"] == {"decodert.runtime.c": 1, "decodert.artifact.m": 2}
    assert upward_imports(graph) == ["decodert.export.a:3 (export) imports decodert.runtime.b (runtime), "
                                     "a package beside it on its floor (sideways)"]
    assert find_cycle({m: set(e) for m, e in graph.items()}) == ["decodert.runtime.b", "decodert.runtime.c", "decodert.runtime.b"]
    assert find_cycle(package_edges(graph)) is None
    _tree(tmp_path, {"export/a.py": "", "runtime/c.py": "import decodert.export.a\n",
                     "artifact/m.py": "def f():\n    from decodert.export.a import g\n"})
    graph = import_graph(tmp_path)
    assert upward_imports(graph) == [
        "decodert.artifact.m:2 (artifact) imports decodert.export.a (export), a higher floor",
        "decodert.runtime.c:1 (runtime) imports decodert.export.a (export), a package beside it on its floor (sideways)"]


def test_the_part_checker_sees_what_it_must(tmp_path):
    """Parts: a root module beside sub-packages is a node of its own, a sub-package one node; a lazy import that
    closes a loop between two of them is a cycle, a loop inside one part is not; a stale allowed cycle is named."""
    _tree(tmp_path, {"runtime/__init__.py": "", "runtime/llm.py": "from decodert.runtime.chat import a\n",
                     "runtime/chat/__init__.py": "", "runtime/chat/a.py": "from . import b\n",
                     "runtime/chat/b.py": "import decodert.runtime.chat.a\n",
                     "runtime/decoding/__init__.py": "", "runtime/decoding/d.py": "from decodert.runtime.llm import LLM\n",
                     "runtime/backends/__init__.py": "", "runtime/backends/ort/__init__.py": "",
                     "runtime/backends/ort/o.py": "", "runtime/backends/feeds.py": "", "artifact/__init__.py": "",
                     "artifact/m.py": ""})
    packages = packages_of(tmp_path)
    parts = {m: part_of(m, packages) for m in module_files(tmp_path)}
    assert parts["decodert.runtime.llm"] == "runtime.llm" and parts["decodert.runtime.chat.b"] == "runtime.chat"
    assert parts["decodert.runtime.backends.ort.o"] == "runtime.backends.ort"
    assert parts["decodert.runtime.backends.feeds"] == "runtime.backends.feeds"
    assert parts["decodert.runtime.backends"] == "runtime.backends" and parts["decodert.artifact.m"] == "artifact"
    assert part_cycles(import_graph(tmp_path), packages) == set()  # chat.a <-> chat.b: inside one part
    _tree(tmp_path, {"runtime/chat/b.py": "def f():\n    from decodert.runtime.decoding.d import g\n"})
    found = part_cycles(import_graph(tmp_path), packages)
    assert found == {("runtime.chat", "runtime.decoding", "runtime.llm")}
    assert cycle_problems(found, frozenset(found)) == []
    assert cycle_problems(found, frozenset({("runtime.chat", "runtime.llm")})) == [
        "parts import each other in a loop (lazy imports count): runtime.chat <-> runtime.decoding <-> runtime.llm",
        "ALLOWED_CYCLES lists runtime.chat <-> runtime.llm, which no longer exists: take it off"]
