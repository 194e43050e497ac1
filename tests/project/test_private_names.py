"""No module reaches into another's private names: ``obj._name`` (obj not self / cls) is allowed only where the
same file defines ``_name`` (a module's own objects, a class's other instances). A collaborator needs a public verb.
Tests, benchmarks and scripts are outside the rule (a test may look into the module it tests)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUTSIDE = {"tests", "bench", "scripts", "docs", "build"}


def own_names(tree: ast.AST) -> set[str]:
    """Names a file defines: functions, classes, assigned names, attributes it sets on self / cls."""
    names: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
            names.add(n.attr)
        elif isinstance(n, ast.arg):
            names.add(n.arg)
    return names


def foreign_private_uses(source: str, where: str) -> list[str]:
    tree = ast.parse(source, where)
    own = own_names(tree)
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
            if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                continue
            if n.attr not in own:
                out.append(f"{where}:{n.lineno}: {ast.unparse(n)}")
    return out


def package_files(root: Path = ROOT) -> list[Path]:
    return [f for f in sorted(root.rglob("*.py"))
            if f.relative_to(root).parts[0] not in OUTSIDE and not any(p.startswith(".") for p in f.relative_to(root).parts)]


def test_no_module_uses_another_modules_private_names():
    found = [use for f in package_files() for use in foreign_private_uses(f.read_text(), str(f.relative_to(ROOT)))]
    assert not found, "private names used outside the file that defines them:\n" + "\n".join(found)


def test_the_check_finds_a_planted_use_and_allows_a_files_own():
    planted = "import other\n\ndef f(engine):\n    return engine._seqs, other._helper()\n"
    assert foreign_private_uses(planted, "x.py") == ["x.py:4: engine._seqs", "x.py:4: other._helper"]
    own = "class A:\n    def __init__(self):\n        self._n = 1\n\n    def same(self, b):\n        return b._n\n"
    assert foreign_private_uses(own, "y.py") == []
