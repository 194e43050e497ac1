"""Every package folder ships in the wheel (the package is the repository root)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"decodert"}
    for top in sorted(d for d in ROOT.iterdir() if (d / "__init__.py").is_file()):  # cli, export, runtime, ...
        for init in top.rglob("__init__.py"):
            found.add(".".join(["decodert", *init.parent.relative_to(ROOT).parts]))
    assert listed == found


def test_lint_clean():
    """ruff (pyflakes + pycodestyle rules, settings in pyproject.toml) finds nothing."""
    import shutil
    import subprocess

    import pytest

    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    res = subprocess.run([ruff, "check", "--quiet", str(ROOT)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:]


def test_tensorrt_code_type_checks():
    """The TensorRT modules run here only through tests/trt_emulator.py; mypy checks them against the installed API."""
    import shutil
    import subprocess

    import pytest

    mypy = shutil.which("mypy")
    if mypy is None:
        pytest.skip("mypy is not installed (pip install -e '.[test]')")
    files = ["plugins/trt_compat.py", "export/trt_build.py", "runtime/trt_backend.py", "runtime/trt_engine.py",
             "runtime/trt_verify.py", "plugins/cuda_mem.py", "export/manifest.py",
             "runtime/verify.py"]
    res = subprocess.run([mypy, "--ignore-missing-imports", "--follow-imports=silent", *files], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:]
