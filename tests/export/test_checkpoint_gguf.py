"""open_checkpoint on GGUF files: tiny files of every family, quant types, the real SmolLM2, tokenizers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tiny import CHAT_TEMPLATE, FAMILIES, assert_matches, make_tiny_gguf, one_line_error, torch_weights  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.export.checkpoints.checkpoint_open import open_checkpoint  # noqa: E402
from decodert.models import family_names  # noqa: E402


# -- GGUF (tiny files written here, llama.cpp style) ------------------------------------------------


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    made: dict[tuple, Path] = {}

    def make(family: str, qtype: str = "F32") -> Path:
        if (family, qtype) not in made:
            folder = tmp_path_factory.mktemp(f"gguf-{family}-{qtype}")
            made[family, qtype] = make_tiny_gguf(family, folder / f"{family}.gguf", qtype)
        return made[family, qtype]

    return make


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_tensors_equal_hf(tiny_gguf, family):
    """Same weights through GGUF (renamed, q/k rows permuted by the writer, F32) and through safetensors."""
    path = tiny_gguf(family)
    gguf_ckpt, hf_ckpt = open_checkpoint(path), open_checkpoint(path.with_suffix(".hf"))
    assert gguf_ckpt.kind == "gguf"
    fields = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "rms_norm_eps", "rope",
              "max_position", "tie_word_embeddings", "bos_token_id")
    assert {f: getattr(gguf_ckpt.spec, f) for f in fields} == {f: getattr(hf_ckpt.spec, f) for f in fields}
    g, h = gguf_ckpt.spec, hf_ckpt.spec
    assert (g.attention.qkv_bias, g.attention.qk_norm, g.mlp(0)) == (h.attention.qkv_bias, h.attention.qk_norm, h.mlp(0))
    assert gguf_ckpt.spec.family == ("llama" if family == "mistral" else hf_ckpt.spec.family)  # as llama.cpp writes
    assert_matches(gguf_ckpt, {n: hf_ckpt.tensor(n) for n in hf_ckpt.names()})


@pytest.mark.parametrize("family", ["llama", "llama_tied", "qwen2", "phi3"])
def test_gguf_tensors_equal_transformers_gguf_loader(tiny_gguf, family):
    """transformers' own GGUF loader agrees (it ignores qwen3 key_length and rope_freqs, so those are left out)."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    from transformers import AutoModelForCausalLM

    path = tiny_gguf(family)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype="float32")
    ckpt = open_checkpoint(path)
    assert_matches(ckpt, torch_weights(model, ckpt.spec), atol=1e-6)


@pytest.mark.parametrize("qtype,atol", [("F16", 1e-3), ("BF16", 1e-2), ("Q8_0", 0.01), ("Q4_0", 0.05), ("Q4_1", 0.05)])
def test_gguf_quantised(tiny_gguf, qtype, atol):
    import gguf

    ckpt = open_checkpoint(tiny_gguf("qwen2", qtype))
    hf_ckpt = open_checkpoint(tiny_gguf("qwen2").with_suffix(".hf"))
    qt = gguf.GGMLQuantizationType[qtype]
    for name in ("embed", "layers.1.qkv", "layers.0.gate_up", "layers.0.qkv_bias", "final_norm"):
        ref = hf_ckpt.tensor(name)
        # blocks run along rows, so quantising the fused matrix equals quantising each part
        exact = ref if ref.ndim == 1 else gguf.quants.dequantize(gguf.quants.quantize(ref, qt), qt)
        np.testing.assert_array_equal(ckpt.tensor(name), exact, err_msg=name)
        np.testing.assert_allclose(ckpt.tensor(name), ref, atol=atol, err_msg=name)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "BF16", "F16"])
def test_gguf_block_types_read_as_gguf_dequantises(tmp_path, qtype):
    """Every supported type goes through gguf.quants.dequantize with the right shape (random blocks)."""
    import gguf

    qt = gguf.GGMLQuantizationType[qtype]
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    rows, cols = 128, 256  # ffn_down of a tiny llama with intermediate_size=256
    raw = np.random.default_rng(0).integers(0, 256, (rows, cols // block * nbytes), dtype=np.uint8)
    raw[:] &= 0x3B  # keep fp16/bf16 scale bytes finite (exponent bits never all ones)
    path = make_tiny_gguf("llama", tmp_path / "m.gguf", intermediate_size=256,
                          raw={"blk.0.ffn_down.weight": (qtype, raw)}, hidden_size=128, head_dim=32)
    w = open_checkpoint(path).tensor("layers.0.down")
    want = gguf.quants.dequantize(raw, qt).reshape(rows, cols)
    np.testing.assert_array_equal(w, want)


def test_gguf_write_tokenizer_tiny(tiny_gguf, tmp_path):
    from tokenizers import Tokenizer

    path = tiny_gguf("llama")
    info = open_checkpoint(path).write_tokenizer(tmp_path)
    assert info == {"bos_token_id": 0, "eos_token_ids": [2], "pad_token_id": 0, "add_bos_token": False,
                    "chat_template": CHAT_TEMPLATE}
    ours = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    orig = Tokenizer.from_file(str(path.with_suffix(".hf") / "tokenizer.json"))
    for text in ["Hello world!", "def add(a, b):\n    return a + b", "<|im_start|>user\nhi<|im_end|>\n", "héllo 🎉"]:
        assert ours.encode(text).ids == orig.encode(text).ids, text
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"


def test_gguf_bad_input(tmp_path, tiny_gguf):
    import shutil

    path = tmp_path / "m.gguf"
    data = tiny_gguf("llama").read_bytes()
    for cut in (len(data) // 2, 1000, 12):
        path.write_bytes(data[:cut])
        msg = one_line_error(path, str(path))
        assert "truncated" in msg, msg
    missing = make_tiny_gguf("llama", tmp_path / "missing.gguf", drop=("blk.1.attn_v.weight",))
    one_line_error(missing, "tensor 'blk.1.attn_v.weight' not found")
    shutil.copy(tiny_gguf("llama"), tmp_path / "ok.gguf")
    assert open_checkpoint(tmp_path / "ok.gguf").spec.family == "llama"


def test_gguf_unsupported_quant_type(tmp_path):
    raw = np.zeros((64, 256 // 256 * 84), dtype=np.uint8)  # Q2_K: 84-byte blocks of 256 values
    path = make_tiny_gguf("llama", tmp_path / "q2k.gguf", intermediate_size=256,
                          raw={"blk.0.ffn_down.weight": ("Q2_K", raw)})
    msg = one_line_error(path, "tensor 'blk.0.ffn_down.weight' has type Q2_K, which is not supported")
    assert str(path) in msg


def test_gguf_unknown_architecture(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert one_line_error(path, "unknown architecture 'gpt2'") == (
        f"unknown architecture 'gpt2' in {path}; supported: {', '.join(family_names())}")


# -- the real model: SmolLM2-135M-Instruct Q4_1 ---------------------------------------------------

SMOLLM2_TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 12:45 on 2024-05-17; pi = 3.14159.",
    "  leading spaces,\ttabs\nand\n\nnewlines   ",
    "Ünïcödé: café, naïve, Straße, Ελληνικά, русский, 日本語のテキスト, 中文, 한국어, हिन्दी",
    "emoji 🎉🚀👩‍👩‍👧‍👦 and symbols ∑∫≈≠ ©®™",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint([fib(i) for i in range(10)])",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat's 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x/y<file_sep>a.py\n<jupyter_code>1234567890",
    "",
]


@pytest.fixture(scope="module")
def smollm2_ckpt(smollm2_gguf):
    return open_checkpoint(smollm2_gguf)


def test_smollm2_spec(smollm2_ckpt):
    ckpt = smollm2_ckpt
    s = ckpt.spec
    assert (s.family, s.vocab_size, s.hidden_size, s.mlp_size(0), s.num_layers) == ("llama", 49152, 576, 1536, 30)
    assert (s.num_heads, s.num_kv_heads, s.head_dim, s.rms_norm_eps, s.rope.theta) == (9, 3, 64, 1e-5, 100000.0)
    assert s.tie_word_embeddings and "lm_head" not in ckpt.names()
    assert (s.bos_token_id, s.eos_token_ids, s.max_position) == (1, (2,), 8192)


def test_smollm2_tensors_equal_transformers(smollm2_ckpt, smollm2_hf_model):
    model, _ = smollm2_hf_model
    assert_matches(smollm2_ckpt, torch_weights(model, smollm2_ckpt.spec), atol=1e-6)  # every tensor, q/k un-permuted


def test_smollm2_tokenizer_matches_transformers(smollm2_ckpt, smollm2_hf_model, tmp_path):
    from tokenizers import Tokenizer

    _, hf_tok = smollm2_hf_model
    info = smollm2_ckpt.write_tokenizer(tmp_path)
    assert info["bos_token_id"] == 1 and info["eos_token_ids"] == [2] and info["pad_token_id"] == 2
    assert info["add_bos_token"] is False and "<|im_start|>" in info["chat_template"]
    ours = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert ours.get_vocab_size() == 49152
    for text in SMOLLM2_TEXTS:
        ids = ours.encode(text).ids
        assert ids == hf_tok(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("<|im_start|>").ids == [1] and ours.encode("<|im_end|>").ids == [2]


# -- GGUF SentencePiece ("llama") vocabularies, checked against sentencepiece itself ----------------

SPM_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b",
    "Once upon a time there was a small model that wanted to speak many languages.",
    "Numbers: 1 22 333 4444, dates 2024-05-17, prices $3.50.",
] * 20


@pytest.fixture(scope="module")
def spm_meta():
    """GGUF tokenizer metadata for a small SentencePiece BPE model, as llama.cpp's converter writes it."""
    spm = pytest.importorskip("sentencepiece")
    import io

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SPM_CORPUS), model_writer=buf, vocab_size=400, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
        user_defined_symbols=["<|tool|>"],
        bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else
             5 if sp.is_unused(i) else 4 if sp.id_to_piece(i) == "<|tool|>" else 1 for i in range(sp.get_piece_size())]
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(sp.get_piece_size())],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(sp.get_piece_size())],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
    }
    return sp, meta


SPM_TEXTS = ["Hello world!", "The quick brown fox", "  two leading spaces and trailing ", "unseen: Żółw 🎉 ∑",
             "def add(a, b):\n    return a + b", "1234567", "a", ""]


def test_gguf_sentencepiece_tokenizer_matches_sentencepiece(spm_meta):
    from decodert.export.checkpoints.gguf_tokenizer import build_tokenizer, tokenizer_info

    sp, meta = spm_meta
    tok = build_tokenizer(meta)
    assert tokenizer_info(meta)["add_bos_token"] is True  # llama.cpp's default for SentencePiece
    for text in SPM_TEXTS:
        want = sp.encode(text)
        assert tok.encode(text, add_special_tokens=False).ids == want, text
        assert tok.encode(text).ids == [1, *want], text
        assert tok.decode(tok.encode(text).ids) == sp.decode(want) == text, text
    # control and user-defined tokens stay whole; text after a special token gets its own prefix space
    ids = tok.encode("<s>hi<|tool|>x", add_special_tokens=False).ids
    assert ids[0] == 1 and sp.piece_to_id("<|tool|>") in ids


def test_gguf_tokenizer_rejects_unknown_model(tmp_path):
    from decodert.export.checkpoints.gguf_tokenizer import build_tokenizer

    with pytest.raises(DecodertError, match="tokenizer model 'bert' is not supported"):
        build_tokenizer({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]}, "x.gguf")
    with pytest.raises(DecodertError, match="x.gguf: no tokenizer"):
        build_tokenizer({"tokenizer.ggml.model": "gpt2"}, "x.gguf")


@pytest.mark.parametrize("pre,digits", [("smollm", ["1", "2", "3", "4", "5"]), ("qwen2", ["1", "2", "3", "4", "5"]),
                                        ("llama-bpe", ["123", "45"]), ("default", ["Ġ12345"])])
def test_gguf_byte_level_pre_tokenizers(pre, digits):
    """tokenizer.ggml.pre picks the split the vocabulary was trained with (digits show the difference)."""
    from decodert.export.checkpoints.gguf_tokenizer import build_tokenizer

    tokens = ["<|endoftext|>", *"abcdefghijklmnopqrstuvwxyzĠ0123456789", "ab"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3] + [1] * (len(tokens) - 1), "tokenizer.ggml.merges": ["a b"]}
    tok = build_tokenizer(meta)
    pieces = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("abc 12345")]
    assert pieces[0] == "abc" and [p for p in pieces[1:] if p != "Ġ"] == digits
    assert tok.decode(tok.encode("abc 12345").ids) == "abc 12345"
