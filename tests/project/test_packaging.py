"""Every package folder ships in the wheel (the package is the repository root)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"decodert"}
    for top in sorted(d for d in ROOT.iterdir() if (d / "__init__.py").is_file()):  # cli, export, runtime, ...
        for init in top.rglob("__init__.py"):
            found.add(".".join(["decodert", *init.parent.relative_to(ROOT).parts]))
    assert listed == found


def test_llguidance_is_a_base_dependency():
    """The README's json_schema= snippet and serve's response_format work after a plain `pip install .`."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(d.replace(" ", "").startswith("llguidance>=") for d in project["dependencies"])


def _checker(module: str) -> list[str]:
    """The checker of this interpreter's environment (`python -m ...`), not whatever PATH finds first:
    the `test` extra pins it, so a missing one is an install error, not a reason to skip."""
    import importlib.util
    import sys

    assert importlib.util.find_spec(module) is not None, f"{module} is not installed: pip install -e '.[test]'"
    return [sys.executable, "-m", module]


def test_lint_clean():
    """ruff (pyflakes + pycodestyle rules, settings in pyproject.toml) finds nothing."""
    import subprocess

    res = subprocess.run([*_checker("ruff"), "check", "--quiet", str(ROOT)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:]


def test_tensorrt_code_type_checks(tmp_path):
    """The TensorRT modules run here only through tests/helpers/trt_emulator.py; mypy checks them against the installed API.

    mypy runs on ``decodert/...`` paths through a link named ``decodert`` to this tree: the repository root is the
    package, so mypy names modules after the folder a clone happens to be in (``ci-clone`` is no package name), and
    whether it could follow an installed copy depended on how that was installed (an editable install hides it)."""
    import os
    import subprocess

    (tmp_path / "decodert").symlink_to(ROOT, target_is_directory=True)

    files = ["plugins/trt/compat.py", "export/trt_build.py", "runtime/backends/trt/backend.py", "runtime/backends/trt/engine.py",
             "runtime/backends/trt/verify.py", "runtime/backends/trt/images.py", "export/trt_graphs.py",
             "runtime/backends/trt/vision.py", "runtime/backends/trt/mrope.py", "runtime/backends/trt/baked.py",
             "runtime/backends/trt/seq2seq.py", "export/trt_seq2seq.py",
             "runtime/backends/image_feeds.py",
             "plugins/cuda_mem.py", "artifact/manifest.py", "artifact/trt_engines.py",
             "tools/verify.py", "export/trt_progress.py", "export/progress.py"]
    res = subprocess.run([*_checker("mypy"), "--no-incremental", "--ignore-missing-imports", "--follow-imports=silent",
                          *(f"decodert/{f}" for f in files)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**os.environ, "MYPYPATH": str(tmp_path)})
    assert res.returncode == 0, res.stdout[-3000:]
