"""Tiny random embedding checkpoints, laid out as sentence-transformers saves them (test-only helper), and the
reference vectors of transformers for them.

    path = make_tiny_embedding(tmp / "emb")                      # Qwen3-Embedding style: a qwen3 folder, last-token
                                                                 # pooling, the tokenizer appends <|endoftext|>
    path = make_tiny_embedding(tmp / "mean", pooling="mean", family="llama", dense=(48, 32))   # + two Dense layers
    path = make_tiny_embedding(tmp / "eg", family="gemma3", pooling="mean", dense=(128, 64), bidirectional=True)
                                                                 # EmbeddingGemma style: a bare Gemma3TextModel
    vectors = reference_vectors(path, texts)                     # transformers' AutoModel, pooled, normalised
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np

from tiny import make_tiny_checkpoint

MODES = {"lasttoken": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}
ALL_MODES = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
             "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")


def make_tiny_embedding(path: Path, family: str = "qwen3", pooling: str = "lasttoken", dense: Sequence[int] = (),
                        append_eos: bool = True, seed: int = 0, bidirectional: bool = False) -> Path:
    """A tiny random ``family`` checkpoint plus modules.json, 1_Pooling/config.json and one Dense folder per
    entry of ``dense`` (its out_features; identity activation, with bias); ``append_eos``: the tokenizer's
    post-processor appends <|endoftext|> to every text, as Qwen3-Embedding's does; ``bidirectional``: the config's
    use_bidirectional_attention, the weights saved as the bare text model (EmbeddingGemma's layout: no "model."
    prefix, no lm_head)."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, processors

    path = make_tiny_checkpoint(family, path, seed=seed, **({"use_bidirectional_attention": True} if bidirectional else {}))
    if bidirectional:
        from transformers import AutoModel

        AutoModel.from_pretrained(str(path)).save_pretrained(str(path))
    cfg = json.loads((path / "config.json").read_text())
    if append_eos:
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        tok.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>", pair="$A <|endoftext|> $B",
                                                           special_tokens=[("<|endoftext|>", 0)])
        tok.save(str(path / "tokenizer.json"))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (path / "1_Pooling").mkdir()
    width = cfg["hidden_size"]
    pool = {"word_embedding_dimension": width, **{k: k == MODES[pooling] for k in ALL_MODES}, "include_prompt": True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pool, indent=2))
    rng = np.random.default_rng(seed + 1)
    for k, n_out in enumerate(dense):
        folder = path / f"{k + 2}_Dense"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"in_features": width, "out_features": n_out, "bias": True,
                                                        "activation_function": "torch.nn.modules.linear.Identity"}))
        save_file({"linear.weight": (0.2 * rng.standard_normal((n_out, width))).astype(np.float32),
                   "linear.bias": (0.1 * rng.standard_normal(n_out)).astype(np.float32)}, str(folder / "model.safetensors"))
        modules.append({"idx": k + 2, "name": str(k + 2), "path": folder.name, "type": "sentence_transformers.models.Dense"})
        width = n_out
    modules.append({"idx": len(modules), "name": str(len(modules)), "path": f"{len(modules)}_Normalize",
                    "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    return path


def reference_vectors(path: Path, texts: Sequence[str], pooling: str = "lasttoken", padding_side: str = "left",
                      dimensions: int | None = None) -> np.ndarray:
    """transformers' vectors: AutoTokenizer (its special tokens), AutoModel's last hidden state over one padded
    batch (``padding_side`` as the model card: left for last-token pooling), pooled by ``pooling``, the Dense
    layers in numpy, L2-normalised (truncated to ``dimensions`` and normalised again)."""
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    tok.padding_side = padding_side
    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    batch = tok(list(texts), padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state.numpy()  # [B, S, D]
    mask = batch["attention_mask"].numpy()
    if pooling == "lasttoken":  # left padding: the last column; right padding: each row's last valid token
        last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)
        x = hidden[np.arange(len(texts)), last]
    elif pooling == "cls":
        x = hidden[np.arange(len(texts)), np.argmax(mask, axis=1)]
    else:
        x = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    listed = Path(path) / "modules.json"
    for m in json.loads(listed.read_text()) if listed.is_file() else []:
        if m["type"].endswith("Dense"):
            w = load_file(str(Path(path) / m["path"] / "model.safetensors"))
            x = x @ w["linear.weight"].T + w["linear.bias"]
    if dimensions is not None:
        x = x[:, :dimensions]
    return x / np.linalg.norm(x, axis=1, keepdims=True)
