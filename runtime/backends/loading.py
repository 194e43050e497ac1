"""Opening an artifact folder for ``LLM.load``: manifest, tokenizer, backend, sampling defaults, prefix cache.

Each step checks what it reads and fails with one DecodertError naming the file or setting.
"""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path
from typing import Any

from decodert.errors import DecodertError
from decodert.artifact.manifest import Manifest, TokenizerRecord, load_manifest
from decodert.artifact.targets import target_info
from decodert.runtime.backends.memory import available_bytes
from decodert.runtime.prefix_cache import PrefixCache
from decodert.runtime.decoding.sampling import sampling_params


def make_prefix_cache(backend: Any, budget_mb: float | None, cache_dir: str | Path | None = None,
                      cache_dir_gb: float | None = None, manifest: Manifest | None = None,
                      source: str | None = None) -> PrefixCache | None:
    """The prefix cache of ``backend`` under ``budget_mb`` MiB (None: default budget; 0: none), and with
    ``cache_dir`` its disk tier there (runtime/persist/disk_tier.py) under ``cache_dir_gb`` GB (default 4), keyed
    by ``manifest``'s identity; ``source`` (the artifact's folder) is what ``decodert cache list`` names it by.

    Default: the K/V of two full contexts (2 x max_seq tokens), and for a hybrid model the states
    two such contexts keep on their way (one every 512 tokens and one at the end: runtime/prefix_cache.py),
    at most a quarter of the memory available now. Off for backends that cannot copy K/V blocks (``read_kv``)."""
    if budget_mb is not None and (not isinstance(budget_mb, (int, float)) or isinstance(budget_mb, bool)
                                  or not budget_mb >= 0):
        raise DecodertError(f"prefix_cache_mb must be a number >= 0 (0 = off), not {budget_mb!r}")
    if cache_dir_gb is not None and (not isinstance(cache_dir_gb, (int, float)) or isinstance(cache_dir_gb, bool)
                                     or not cache_dir_gb > 0 or cache_dir_gb != cache_dir_gb):
        raise DecodertError(f"cache_dir_gb must be a number > 0 (GB on disk), not {cache_dir_gb!r}")
    if cache_dir_gb is not None and cache_dir is None:
        raise DecodertError("cache_dir_gb is the disk tier's budget: give cache_dir (--cache-dir DIR) too")
    if cache_dir is not None and not isinstance(cache_dir, (str, Path)):
        raise DecodertError(f"cache_dir must be a folder path, not {type(cache_dir).__name__}")
    if cache_dir is not None and (budget_mb == 0 or not hasattr(backend, "kv_to_bytes")):
        why = "prefix_cache_mb is 0" if budget_mb == 0 else f"the {getattr(backend, 'name', '?')} backend cannot copy K/V blocks"
        raise DecodertError(f"cache_dir {cache_dir}: the disk tier sits under the prefix cache, which is off ({why})")
    if cache_dir is not None and manifest is None:
        raise DecodertError(f"cache_dir {cache_dir}: the disk tier needs the artifact's manifest (its identity)")
    if budget_mb == 0 or not hasattr(backend, "read_kv"):
        return None
    if budget_mb is None:
        budget = 2 * backend.kv_bytes(int(backend.max_seq)) + 2 * (int(backend.max_seq) // 512 + 1) * _state_bytes(backend)
        avail = available_bytes() if getattr(backend, "name", "") != "trt" else None
        budget = min(budget, avail // 4) if avail else budget
    else:
        budget = int(budget_mb * 2**20)
        avail = available_bytes() if getattr(backend, "name", "") != "trt" else None
        if avail is not None and budget > 0.9 * avail:
            raise DecodertError(f"prefix_cache_mb={budget_mb:g} is more than the {avail / 2**20:.0f} MiB of memory "
                                "available now; give a smaller budget (0 = off)")
    prefix = PrefixCache(backend, budget)
    if cache_dir is not None:
        from decodert.runtime.persist.disk_tier import DEFAULT_GB, DiskTier

        about = {"artifact": source, "family": manifest.model.family, "dtype": manifest.dtype,
                 "kv_dtype": manifest.kv_dtype or manifest.dtype, "block_tokens": prefix.block_tokens}
        gb = DEFAULT_GB if cache_dir_gb is None else cache_dir_gb
        prefix.attach_disk(lambda stats: DiskTier(cache_dir, manifest, int(gb * 1e9), stats, about=about))
    return prefix


def model_defaults(manifest: Manifest | None) -> dict[str, Any]:
    """manifest.sampling.defaults, checked as SamplingParams (a bad value names the manifest field)."""
    defaults = dict(manifest.sampling.defaults) if manifest and manifest.sampling else {}
    try:
        sampling_params(**defaults)
    except DecodertError as e:
        raise DecodertError(f"manifest sampling.defaults: {e}") from None
    return defaults


def read_manifest(path: Path, verify: str = "fast") -> Manifest:
    """``path/manifest.json``, validated (artifact/manifest.py) and its files verified ("fast" | "full" | "none")."""
    return load_manifest(path, verify=verify)


def open_tokenizer(path: Path, manifest: Manifest | None) -> Any:
    """The artifact's ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer

    file = path / (manifest.tokenizer if manifest else TokenizerRecord()).file
    if not file.is_file():
        raise DecodertError(f"{file} not found (tokenizer of the artifact)")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise DecodertError(f"cannot load tokenizer {file}: {e}") from None
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    recorded, model_vocab = (manifest.tokenizer.vocab_size, manifest.model.vocab_size) if manifest else (None, n)
    if (recorded is not None and n != recorded) or n > model_vocab:
        raise DecodertError(f"{file}: has {n} tokens but the artifact was exported with {recorded or 'fewer'}; "
                            "the tokenizer was replaced (re-export the model)")
    return tokenizer


def open_backend(path: Path, manifest: Manifest, choice: str = "auto", placement: Any = "off") -> Any:
    """Create the ort or trt backend ("auto": trt when the folder has engines and TensorRT works).

    ``placement`` (ort): which backend runs each phase (runtime/backends/placement.py: "auto" | "measure" |
    "off" | a phase -> backend mapping); "off" opens the one-session ort backend as before."""
    from decodert.runtime.backends import placement as placing

    setting = placing.parse(placement)
    if choice not in ("auto", "ort", "trt"):
        raise DecodertError(f"unknown backend {choice!r}; expected auto, ort or trt (--backend)")
    if choice == "auto":
        choice = "trt" if manifest.engines and _trt_usable() else "ort"
    if choice == "trt" and manifest.lora_layout is not None:
        raise DecodertError(f"{path} takes LoRA adapters at run time (--lora-slots), which run on --backend ort only")
    if choice == "trt" and isinstance(setting, dict):
        raise DecodertError(f"placement {placement!r} places phases of the ort backend; TensorRT runs every phase itself")
    if choice == "trt":
        if not manifest.engines and not target_info(manifest.target).runs_on("trt"):
            raise DecodertError(f"{path} has no TensorRT engines: it is a --target {manifest.target} artifact, which "
                                f"runs on ONNX Runtime (--backend ort); for TensorRT export with --target trt, then "
                                f"`decodert build OUT`")
        if not manifest.engines:
            raise DecodertError(f"{path} has no TensorRT engines; run `decodert build {path}` or use --backend ort")
        from decodert.runtime.backends.trt.backend import TrtBackend

        return TrtBackend(path, manifest)
    return placing.open_placed(path, manifest, setting)


def seq2seq_backend(path: Path, record: dict, choice: str = "auto") -> str:
    """The backend an encoder-decoder artifact (seq2seq.json ``record``) runs on: ``choice``, or for "auto" trt when
    it has engines and TensorRT works, else ort; a one-line error where trt cannot run it."""
    if choice not in ("auto", "ort", "trt"):
        raise DecodertError(f"unknown backend {choice!r}; expected auto, ort or trt (--backend)")
    if choice == "auto":
        return "trt" if record.get("engines") and _trt_usable() else "ort"
    if choice == "trt" and not record.get("engines"):
        target = target_info(str(record.get("target")))
        how = (f"run `decodert build {path}`" if target.runs_on("trt") else
               f"it is a --target {target.name} artifact (ONNX Runtime only): export with --target trt, then "
               "`decodert build OUT`")
        raise DecodertError(f"{path} has no TensorRT engines; {how}, or use --backend ort")
    return choice


def _trt_usable() -> bool:
    """An NVIDIA GPU is visible (cuda-python) and the TensorRT backend imports."""
    if not (Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi")):
        return False  # cheap check first: no driver, no GPU
    try:
        importlib.import_module("decodert.runtime.backends.trt.backend")
        return importlib.import_module("decodert.plugins.cuda_mem").gpu_count() > 0
    except (ImportError, OSError, DecodertError):
        return False


def _state_bytes(backend: Any) -> int:
    """Bytes of one row's per-layer states beyond K/V (a hybrid model; 0 for K/V alone)."""
    manifest = getattr(backend, "manifest", None)
    if manifest is None or not manifest.kv.states:
        return 0
    return int(manifest.kv.state_bytes(1, 4 if manifest.dtype == "fp32" else 2))
