"""How a checkpoint turns its last hidden state into one vector per input: the ``embedding`` record of the manifest.

    sentence-transformers folder (modules.json):   the Pooling module's config (1_Pooling/config.json):
        pooling_mode_lasttoken -> "last",  pooling_mode_mean_tokens -> "mean",  pooling_mode_cls_token -> "cls"
        (one of them; max / weighted-mean / sqrt-len pooling are refused in one line);
        Dense modules after it (2_Dense, 3_Dense: in/out features, bias, identity activation) -> dense layers,
        their weights written float32 to ``dense_{k}.npz`` in the artifact
    anything else (a plain causal LM):             "last", the one token that has seen the whole input
    causal:       False where config.json says use_bidirectional_attention (EmbeddingGemma), else True
    matryoshka:   embedding checkpoints of the families trained for truncated vectors (Qwen3-Embedding, EmbeddingGemma)

Vectors are always L2-normalised (runtime/embedding.py), Normalize module or not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from decodert.errors import DecodertError

POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
MATRYOSHKA_TYPES = ("qwen3", "gemma3_text")  # Qwen3-Embedding, EmbeddingGemma (their model cards: MRL)
IDENTITY = ("torch.nn.modules.linear.Identity", "torch.nn.Identity", None)


def is_embedding_checkpoint(folder: Path) -> bool:
    """A sentence-transformers folder: modules.json lists a Pooling module."""
    return any(m.get("type", "").endswith("Pooling") for m in _modules(Path(folder)))


def embedding_rule(folder: Path | None, config: dict[str, Any] | None, hidden_size: int,
                   out: Path) -> dict[str, Any]:
    """The manifest's ``embedding`` fields but ``graph`` for checkpoint ``folder`` (None: a GGUF file), with the
    dense layers' weights written into ``out``."""
    config = config or {}
    causal = not config.get("use_bidirectional_attention", False)
    modules = _modules(folder) if folder is not None else []
    pooling = next((m for m in modules if m.get("type", "").endswith("Pooling")), None)
    if pooling is None:
        return {"pooling": "last", "causal": causal, "dimensions": hidden_size, "matryoshka": False, "dense": [],
                "source": "default: last-token pooling (a causal LM's last token has seen the whole input)"}
    assert folder is not None
    where = folder / pooling.get("path", "") / "config.json"
    raw = _json(where)
    modes = [POOLING_MODES[k] for k in POOLING_MODES if raw.get(k)]
    refused = [k for k in UNSUPPORTED_MODES if raw.get(k)]
    if refused or len(modes) != 1:
        raise DecodertError(f"{where}: decodert pools with exactly one of {', '.join(POOLING_MODES)} "
                            f"(found {', '.join(refused + [k for k in POOLING_MODES if raw.get(k)]) or 'none'})")
    dense, width = [], hidden_size
    after = [m for m in modules if int(m.get("idx", 0)) > int(pooling.get("idx", 0))]
    for k, m in enumerate(x for x in after if x.get("type", "").endswith("Dense")):
        dense.append(_dense(folder / m.get("path", ""), width, out / f"dense_{k}.npz"))
        width = dense[-1]["out_features"]
    return {"pooling": modes[0], "causal": causal, "dimensions": width,
            "matryoshka": config.get("model_type") in MATRYOSHKA_TYPES, "dense": dense,
            "source": str(Path(pooling.get("path", "")) / "config.json")}


def _dense(folder: Path, width: int, out: Path) -> dict[str, Any]:
    """A Dense module (config.json + model.safetensors: linear.weight [out, in], linear.bias) -> its record;
    the weights saved float32 to ``out``."""
    cfg = _json(folder / "config.json")
    n_in, n_out, bias = cfg.get("in_features"), cfg.get("out_features"), bool(cfg.get("bias", True))
    if n_in != width or not isinstance(n_out, int) or n_out < 1:
        raise DecodertError(f"{folder}/config.json: in_features {n_in} / out_features {n_out} do not follow the "
                            f"width {width} before it")
    if cfg.get("activation_function") not in IDENTITY:
        raise DecodertError(f"{folder}/config.json: activation_function {cfg.get('activation_function')!r} is not "
                            "supported (decodert applies identity Dense layers only)")
    from safetensors.numpy import load_file

    path = folder / "model.safetensors"
    if not path.is_file():
        raise DecodertError(f"{folder}: no model.safetensors (the Dense layer's weights)")
    tensors = load_file(str(path))
    weight, b = tensors.get("linear.weight"), tensors.get("linear.bias")
    if weight is None or weight.shape != (n_out, n_in) or (bias and (b is None or b.shape != (n_out,))):
        raise DecodertError(f"{path}: needs linear.weight [{n_out}, {n_in}]" + (f" and linear.bias [{n_out}]" if bias else ""))
    arrays = {"weight": weight.astype(np.float32)} | ({"bias": b.astype(np.float32)} if bias else {})
    np.savez(out, **arrays)
    return {"file": out.name, "in_features": n_in, "out_features": n_out, "bias": bias}


def _modules(folder: Path) -> list[dict[str, Any]]:
    path = folder / "modules.json"
    if not path.is_file():
        return []
    raw = _json(path)
    if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw):
        raise DecodertError(f"{path}: expected a list of modules")
    return raw


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DecodertError(f"{path}: missing (modules.json names it)") from None
    except (OSError, ValueError) as e:
        raise DecodertError(f"{path}: cannot read ({type(e).__name__}: {str(e)[:120]})") from None
