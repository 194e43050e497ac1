"""Rebuild a `tokenizers` tokenizer.json from GGUF tokenizer metadata.

Two vocabularies cover the supported families:
- ``tokenizer.ggml.model == "gpt2"``: byte-level BPE from tokens + merges; the pre-tokenizer split
  is chosen by ``tokenizer.ggml.pre`` (llama3, qwen2, smollm/starcoder digits, GPT-2 default).
- ``tokenizer.ggml.model == "llama"``: SentencePiece BPE with byte fallback and ``▁`` for spaces;
  merges come from the file or are derived from the piece scores (a merge ranks by the score of
  the piece it produces, as SentencePiece does).
Control (type 3) and user-defined (type 4) tokens become added tokens, so they are matched whole.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from decodert.errors import DecodertError, first_line

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # SentencePiece's visible space

# Pre-tokenizer splits, keyed by tokenizer.ggml.pre (the regexes the original tokenizer.json files use).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3, "smaug-bpe": _LLAMA3,
          "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2}
DIGIT_SPLIT = ("smollm", "starcoder", "refact", "codeshell")  # each digit alone, then GPT-2 regex
IGNORE_MERGES = ("llama-bpe", "llama3", "llama-v3")  # a pre-token found whole in the vocab is kept whole


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes map to themselves,
    the rest to chr(256 + k) in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, shifted = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def _vocab(tokens: list[str], types: list[int], respell: bool) -> dict[str, int]:
    """token -> first id. Byte-level: a normal token not written in the byte alphabet is respelled."""
    table = byte_alphabet()
    alphabet = set(table.values())
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        if respell and types[i] == NORMAL and not set(tok) <= alphabet:
            tok = "".join(table[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, i)
    return vocab


def _file_merges(meta: dict) -> list[tuple[str, str]] | None:
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        return None
    pairs = [tuple(m.split(" ")) for m in merges]
    return [p for p in pairs if len(p) == 2]


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: (left, right) for every normal piece that
    splits into two normal pieces, best (highest-scoring) result first."""
    normal = {tok: i for i, tok in enumerate(tokens) if types[i] == NORMAL}
    ranked = []
    for piece, pid in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[pid], normal[left], normal[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _byte_level_bpe(meta: dict, tokens: list[str], types: list[int]) -> Tokenizer:
    pre = meta.get("tokenizer.ggml.pre", "default")
    merges = _file_merges(meta) or []
    tok = Tokenizer(models.BPE(_vocab(tokens, types, respell=True), merges, ignore_merges=pre in IGNORE_MERGES))
    if pre in SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        steps = [pre_tokenizers.Digits(individual_digits=True)] if pre in DIGIT_SPLIT else []
        tok.pre_tokenizer = pre_tokenizers.Sequence([*steps, pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(meta: dict, tokens: list[str], types: list[int]) -> Tokenizer:
    scores = meta.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]
    merges = _file_merges(meta) or spm_merges(tokens, scores, types)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id", 0)
    model = models.BPE(_vocab(tokens, types, respell=False), merges, unk_token=tokens[unk_id],
                       fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(model)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # Like llama.cpp and SentencePiece: spaces become ▁ and, with add_space_prefix, every text fragment
    # (the input, or the text after an added token) gets one more ▁ in front, even if it starts with a
    # space (Metaspace would skip that one). No pre-split: merges may cross word boundaries.
    space = normalizers.Replace(" ", SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), space]) if prefix else space
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def _post_processor(meta: dict, tokens: list[str], fallback: Any) -> Any:
    """Prepend BOS / append EOS when the file says so (tokenizer.ggml.add_bos_token / add_eos_token)."""
    bos_id, eos_id = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    add_bos = add_bos_token(meta) and bos_id is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    if not (add_bos or add_eos):
        return fallback
    bos, eos = ([tokens[bos_id]] if add_bos else []), ([tokens[eos_id]] if add_eos else [])
    single = [*bos, "$A", *eos]
    pair = single + [*(f"{t}:1" for t in bos), "$B:1", *(f"{t}:1" for t in eos)]
    special = [(t, i) for t, i in ((bos and bos[0], bos_id), (eos and eos[0], eos_id)) if t]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def add_bos_token(meta: dict) -> bool:
    # llama.cpp adds BOS for SentencePiece vocabularies unless the file says otherwise.
    return bool(meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama"))


def _is_list(value: Any, kind: type | tuple[type, ...], n: int | None = None) -> bool:
    return (isinstance(value, list) and (n is None or len(value) == n)
            and all(isinstance(v, kind) and not isinstance(v, bool) for v in value))


def check_tokenizer_meta(meta: dict, source: Path | str) -> None:
    """Types, lengths and id ranges of the tokenizer metadata (it comes from an untrusted file)."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise DecodertError(f"{source}: no tokenizer in the GGUF metadata (tokenizer.ggml.tokens)")
    n = len(tokens)
    checks = {"tokens": _is_list(tokens, str), "token_type": _is_list(meta.get("tokenizer.ggml.token_type", []), int),
              "scores": _is_list(meta.get("tokenizer.ggml.scores", []), (int, float)),
              "merges": _is_list(meta.get("tokenizer.ggml.merges", []), str),
              "pre": isinstance(meta.get("tokenizer.ggml.pre", ""), str)}
    for key in ("token_type", "scores"):
        checks[key] = checks[key] and len(meta.get(f"tokenizer.ggml.{key}") or tokens) == n
    for key in ("bos", "eos", "eot", "eom", "unknown", "padding"):
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        checks[f"{key}_token_id"] = value is None or (type(value) is int and 0 <= value < n)
    template = meta.get("tokenizer.chat_template")
    checks["chat_template"] = template is None or isinstance(template, str)
    bad = [k for k, ok in checks.items() if not ok]
    if not bad and meta.get("tokenizer.ggml.model") == "gpt2" and not meta.get("tokenizer.ggml.merges"):
        raise DecodertError(f"{source}: a gpt2 (byte-level BPE) tokenizer without tokenizer.ggml.merges would "
                            "split every text into single bytes; the file is incomplete")
    if bad:
        raise DecodertError(f"{source}: tokenizer.ggml metadata is malformed ({', '.join(bad)}: wrong type, "
                            f"length or an id outside the {n} tokens)")


def build_tokenizer(meta: dict, source: Path | str = "the GGUF file") -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to the GGUF's (meta must include the tokenizer arrays)."""
    check_tokenizer_meta(meta, source)
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise DecodertError(f"{source}: tokenizer model '{kind}' is not supported (supported: gpt2, llama)")
    try:
        return _assemble(meta, kind)
    except Exception as e:  # the tokenizers library raises a bare Exception (e.g. a merge of unknown tokens)
        raise DecodertError(f"{source}: cannot rebuild the tokenizer from the GGUF metadata ({first_line(e)})") from None


def _assemble(meta: dict, kind: str) -> Tokenizer:
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if kind == "gpt2":
        tok = _byte_level_bpe(meta, tokens, types)
        fallback = processors.ByteLevel(trim_offsets=False)
    else:
        tok = _sentencepiece_bpe(meta, tokens, types)
        fallback = None
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    post = _post_processor(meta, tokens, fallback)
    if post is not None:
        tok.post_processor = post
    return tok


def tokenizer_info(meta: dict) -> dict[str, Any]:
    """The special-token summary recorded in the manifest."""
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_ids": list(dict.fromkeys(e for e in eos if e is not None)),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "add_bos_token": add_bos_token(meta),
        "chat_template": meta.get("tokenizer.chat_template"),
    }


def write_gguf_tokenizer(meta: dict, out_dir: Path, source: Path | str) -> dict[str, Any]:
    """Write tokenizer.json (+ a tokenizer_config.json for transformers) and return tokenizer_info."""
    tok = build_tokenizer(meta, source)
    info = tokenizer_info(meta)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    tokens = meta["tokenizer.ggml.tokens"]

    def text(i: int | None) -> str | None:
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": text(info["bos_token_id"]),
        "eos_token": text(info["eos_token_ids"][0] if info["eos_token_ids"] else None),
        "pad_token": text(info["pad_token_id"]),
        "add_bos_token": info["add_bos_token"],
        "chat_template": info["chat_template"],
    }
    with open(out_dir / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump({k: v for k, v in config.items() if v is not None}, f, indent=2, ensure_ascii=False)
    return info
