"""Hugging Face checkpoint folders: config.json + model.safetensors (single or sharded)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from decodert.errors import DecodertError
from decodert.export.checkpoints.checkpoint import Checkpoint, build_spec
from decodert.artifact.safetensors_file import SafetensorsFile
from decodert.export.lowering.semantics import check_tensors_used
from decodert.export.quantize import quant_packed
from decodert.export.quantize.quant import QuantConfig, QuantizedWeight, WeightQuant
from decodert.export.quantize.quant_packed import packed_format
from decodert.export.quantize.mxfp4 import dequantize_mxfp4, mxfp4_shape
from decodert.models import family_for

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
                    "chat_template.jinja")


def read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise DecodertError(f"{path}: cannot read ({e.strerror})") from None
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly nested JSON
        raise DecodertError(f"{path}: invalid JSON ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(data, dict):
        raise DecodertError(f"{path}: expected a JSON object")
    return data


def _index(folder: Path) -> dict[str, Path] | None:
    """tensor key -> shard file from model.safetensors.index.json, or None when not sharded."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return None
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise DecodertError(f"{index}: no 'weight_map'")
    bad = [v for v in weight_map.values() if not isinstance(v, str) or Path(v).name != v or v in ("", ".", "..")]
    if bad:  # a shard must be a plain file name in this folder: no ../, no absolute paths
        raise DecodertError(f"{index}: weight_map names {bad[0]!r}, which is not a file in {folder}")
    return {k: folder / v for k, v in weight_map.items()}


class HFCheckpoint(Checkpoint):
    kind = "hf"

    def __init__(self, folder: Path) -> None:
        config_path = folder / "config.json"
        if not config_path.is_file():
            raise DecodertError(f"{folder}: no config.json (not a Hugging Face checkpoint folder)")
        self.config = read_json(config_path)
        family = family_for(self.config.get("model_type", "<missing model_type>"), str(config_path))
        self._files: dict[Path, SafetensorsFile] = {}
        stored = _index(folder) or self._single_file(folder)
        try:
            self._where, self._stored = _sanitized(folder, stored, family.sanitize)
            spec = build_spec(lambda: family.spec_from_hf(self.config), config_path, len(self._where))
        except DecodertError:
            self.close()
            raise
        super().__init__(folder, spec, family, family.hf_weights)
        try:
            self.packed_format = packed_format(self.config, str(config_path))  # GPTQ / AWQ linear layers
            if self.packed_format is not None and not any(k.endswith(".qweight") for k in self._where):
                raise DecodertError(f"{config_path}: quantization_config says {self.packed_format.method}, but the "
                                    "checkpoint holds no qweight tensors (its weights are float: remove "
                                    "quantization_config, or point at the quantized checkpoint)")
        except DecodertError:
            self.close()
            raise

    def _single_file(self, folder: Path) -> dict[str, Path]:
        single = folder / "model.safetensors"
        if single.is_file():
            self._files[single] = SafetensorsFile(single)
            return {k: single for k in self._files[single].keys()}
        if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
            raise DecodertError(f"{folder}: only safetensors checkpoints are supported (found PyTorch .bin files)")
        raise DecodertError(f"{folder}: no model.safetensors or model.safetensors.index.json")

    def _file(self, key: str) -> SafetensorsFile:
        shard = self._where.get(key)
        if shard is None:
            raise DecodertError(f"{self.source}: tensor '{key}' not found in the checkpoint")
        if shard not in self._files:
            if not shard.is_file():
                raise DecodertError(f"{shard}: missing shard file (listed in model.safetensors.index.json)")
            self._files[shard] = SafetensorsFile(shard)
        f = self._files[shard]
        if self._stored.get(key, key) not in f:
            raise DecodertError(f"{shard}: tensor '{self._stored.get(key, key)}' not found (the index lists it here)")
        return f

    def _shape(self, key: str) -> tuple[int, ...]:
        base = self._packed_base(key)
        if base is not None:  # [N, K] of a GPTQ / AWQ linear, every packed tensor's dtype and shape checked
            assert self.packed_format is not None
            return quant_packed.packed_shape(self.packed_format, self._packed_stored(base), self._packed_where(base))
        if self._mxfp4(key):  # [E, N, G, 16] -> transformers' parameter [E, G * 32, N]
            e, n, groups = mxfp4_shape(*((self._file(key + x).dtype(self._stored.get(key + x, key + x)),
                                          self._file(key + x).shape(self._stored.get(key + x, key + x)))
                                         for x in ("_blocks", "_scales")), f"{self.source}: tensor '{key}'")
            return (e, groups * 32, n)
        return self._file(key).shape(self._stored.get(key, key))

    def _read(self, key: str) -> np.ndarray:
        base = self._packed_base(key)
        if base is not None:
            return quant_packed.dequantize(*self._unpack(base))
        if self._mxfp4(key):
            return np.stack([self._read_row(key, j) for j in range(self._shape(key)[0])])
        return self._file(key).read(self._stored.get(key, key))

    def _mxfp4(self, key: str) -> bool:
        """Is ``key`` stored as MXFP4 (``key_blocks`` + ``key_scales``, gpt-oss experts) instead of floats?"""
        return key not in self._where and key + "_blocks" in self._where and key + "_scales" in self._where

    def _read_row(self, key: str, row: int) -> np.ndarray:
        """Row ``row`` (an expert) of stacked tensor ``key``; MXFP4 experts dequantized exactly, one at a time,
        and laid out as transformers' parameter ([in, out], as the float checkpoints store them)."""
        if not self._mxfp4(key):
            return self._file(key).read_row(self._stored.get(key, key), row)
        self._shape(key)  # blocks and scales U8 and paired (mxfp4_shape)
        blocks, scales = (self._file(key + s).raw_row(self._stored.get(key + s, key + s), row) for s in ("_blocks", "_scales"))
        try:
            return dequantize_mxfp4(blocks, scales).T.copy()
        except ValueError as e:
            raise DecodertError(f"{self.source}: tensor '{key}': {e}") from None

    # -- GPTQ / AWQ (export/quantize/quant_packed.py) --------------------------------------------
    def _packed_base(self, key: str) -> str | None:
        """``...q_proj.`` when ``key`` (``...q_proj.weight``) is stored as GPTQ / AWQ tensors."""
        if self.packed_format is None or not key.endswith(".weight") or key in self._where:
            return None
        base = key[: -len("weight")]
        return base if base + "qweight" in self._where else None

    def _packed_stored(self, base: str) -> dict[str, tuple[str, tuple[int, ...]]]:
        """suffix -> (stored dtype, shape) of the packed tensors of linear ``base``."""
        keys = {suffix: base + suffix for suffix in quant_packed.SUFFIXES if base + suffix in self._where}
        return {suffix: (self._file(key).dtype(self._stored.get(key, key)), self._file(key).shape(self._stored.get(key, key)))
                for suffix, key in keys.items()}

    def _packed_where(self, base: str):
        return lambda suffix: f"{self.source}: tensor '{self._stored.get(base + suffix, base + suffix)}'"

    def _unpack(self, base: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        assert self.packed_format is not None
        where = self._packed_where(base)
        stored = self._packed_stored(base)
        quant_packed.packed_shape(self.packed_format, stored, where)
        tensors = {suffix: self._file(base + suffix).raw(self._stored.get(base + suffix, base + suffix)) for suffix in stored}
        return quant_packed.unpack(self.packed_format, tensors, where)

    def native_quant(self) -> QuantConfig | None:
        return None if self.packed_format is None else self.packed_format.quant_config()

    def packed(self, name: str) -> tuple[QuantizedWeight, WeightQuant] | None:
        keys = self._parts(name)
        bases = [self._packed_base(key) for key in keys]
        if self.packed_format is None or any(b is None for b in bases):
            return None
        return quant_packed.transcode(self.packed_format, [self._unpack(b) for b in bases if b is not None],
                                      f"{self.source}: {name}")

    def used_keys(self) -> set[str]:
        used = super().used_keys()
        bases = {b for b in map(self._packed_base, used) if b is not None}
        return used | {b + s for b in bases for s in quant_packed.SUFFIXES if b + s in self._where}

    def _fix(self, key: str, w: np.ndarray) -> np.ndarray:
        fix = self.family.hf_fix
        return fix(key, w, self.spec) if fix else w

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def write_tokenizer(self, out_dir: str | Path) -> dict[str, Any]:
        return write_hf_tokenizer(self.source, self.config, Path(out_dir))


def _sanitized(folder: Path, where: dict[str, Path], sanitize) -> tuple[dict[str, Path], dict[str, str]]:
    """The family's ``sanitize(key) -> name | None`` over the stored keys (None drops a key).

    Returns (name -> shard, name -> stored key for each renamed one).
    """
    if sanitize is None:
        return where, {}
    named: dict[str, Path] = {}
    stored: dict[str, str] = {}
    for key, shard in where.items():
        name = sanitize(key)
        if name is None:
            continue
        if name in named:
            raise DecodertError(f"{folder}: tensors '{stored.get(name, name)}' and '{key}' both load as '{name}'")
        named[name] = shard
        if name != key:
            stored[name] = key
    return named, stored


def open_hf(folder: Path) -> HFCheckpoint:
    ckpt = HFCheckpoint(folder)
    ckpt.validate()
    check_tensors_used(ckpt._where, ckpt.used_keys(), ckpt.spec.num_layers, folder,
                       ckpt.family.hf_unused, strict=False)  # layers past num_hidden_layers
    return ckpt


# -- tokenizer ------------------------------------------------------------------------------------


def _token_text(value: Any) -> str | None:
    """tokenizer_config token fields are a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _token_ids(tok: dict) -> dict[str, int]:
    vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        ids = {entry[0]: i for i, entry in enumerate(vocab)}
    else:  # BPE / WordPiece: {token: id}
        ids = dict(vocab or {})
    ids.update({t["content"]: t["id"] for t in tok.get("added_tokens", [])})
    return ids


def _chat_template(folder: Path, tok_config: dict) -> str | None:
    """tokenizer_config's chat_template (a string, or [{"name", "template"}, ...]: "default" or the
    first), else chat_template.jinja; any other type is refused (the artifact could never load)."""
    template = tok_config.get("chat_template")
    if isinstance(template, list) and template and all(
            isinstance(t, dict) and isinstance(t.get("template"), str) for t in template):
        named = {t.get("name"): t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()))
    elif template is not None and not isinstance(template, str):
        raise DecodertError(f"{folder / 'tokenizer_config.json'}: chat_template is a {type(template).__name__} "
                            "that is not a string or a list of {name, template} strings")
    jinja = folder / "chat_template.jinja"
    if template is None and jinja.is_file():
        try:
            template = jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise DecodertError(f"{jinja}: cannot be read as UTF-8 text ({type(e).__name__})") from None
    return template


def _adds_bos(tok: dict, bos: str | None) -> bool:
    """Does tokenizer.json's post-processor put the BOS token in front of a single sequence?"""
    post = json.dumps(tok.get("post_processor") or {})
    return bos is not None and json.dumps(bos) in post and '"single"' in post


def write_hf_tokenizer(folder: Path, config: dict, out_dir: Path) -> dict[str, Any]:
    """Copy tokenizer.json and friends to out_dir; return the special-token summary."""
    tok_path = folder / "tokenizer.json"
    if not tok_path.is_file():
        raise DecodertError(f"{folder}: no tokenizer.json (only fast tokenizers are supported)")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        src, dst = folder / name, out_dir / name
        if src.is_file() and not (dst.exists() and dst.samefile(src)):
            shutil.copyfile(src, dst)
    tok = read_json(tok_path)
    tok_config = read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    gen = read_json(folder / "generation_config.json") if (folder / "generation_config.json").is_file() else {}
    ids = _token_ids(tok)
    special = {k: _token_text(tok_config.get(f"{k}_token")) for k in ("bos", "eos", "pad")}

    def pick(key: str) -> Any:
        for source in (gen, config):
            if source.get(f"{key}_token_id") is not None:
                return source[f"{key}_token_id"]
        return ids.get(special[key]) if special[key] else None

    eos = pick("eos")
    add_bos = tok_config.get("add_bos_token")
    return {
        "bos_token_id": pick("bos"),
        "eos_token_ids": [eos] if isinstance(eos, int) else list(eos or []),
        "pad_token_id": pick("pad"),
        "add_bos_token": bool(add_bos) if add_bos is not None else _adds_bos(tok, special["bos"]),
        "chat_template": _chat_template(folder, tok_config),
    }
