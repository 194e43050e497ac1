"""Small pristine inputs for the fuzzer and the reliability tests, made without torch in about a second.

    samples = make_samples(root)    # root/mini.gguf, root/hf/, root/art/, root/eng/
- ``mini.gguf``: a 2-layer llama GGUF (F32, F16, Q8_0, Q4_0, Q4_K tensors, gpt2 tokenizer + merges).
- ``hf/``: the same model as an HF folder (config.json, model.safetensors with F32 and F16 tensors,
  tokenizer.json, tokenizer_config.json with a chat template and no EOS: generation runs to length).
- ``art/``: ``hf/`` exported for the ORT target (fp32, max_seq 256, max_batch 2).
- ``eng/``: ``art/`` plus two fake TensorRT engine files recorded in manifest.engines (the checks
  ``read_engine`` does before TensorRT sees a plan need no GPU); ``ENGINE_TRT`` is their TensorRT.
``add_listed_file`` and ``flip_byte`` damage an artifact for the integrity tests.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 32, 2, 4, 2, 8, 256, 300
ENGINE_TRT = {"flavour": "tensorrt_rtx", "version": "1.7.1.116", "module": "tensorrt_rtx_bindings"}
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, a tiny model for fuzzing decodert",
          "numbers 12 345 6789 and punctuation: ; , . ! ?"] * 3
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}<|assistant|>"


def make_tokenizer():
    """A byte-level BPE with exactly VOCAB tokens, ids 0..2 special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|s|>", "<|user|>", "<|assistant|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([f"<|x{i}|>" for i in range(VOCAB - tok.get_vocab_size())])
    assert tok.get_vocab_size() == VOCAB
    return tok


def hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """HF tensor name -> random float32 weights of the mini llama."""
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
                       p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
                       p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                       p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                       p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
                       p + "mlp.gate_proj.weight": (FFN, HIDDEN), p + "mlp.up_proj.weight": (FFN, HIDDEN),
                       p + "mlp.down_proj.weight": (HIDDEN, FFN)})
    return {k: (1.0 + 0.1 * rng.standard_normal(s) if k.endswith("norm.weight") else 0.2 * rng.standard_normal(s))
            .astype(np.float32) for k, s in shapes.items()}


def make_hf(folder: Path, seed: int = 0) -> Path:
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama", "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "intermediate_size": FFN, "vocab_size": VOCAB,
              "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "bos_token_id": 0}
    (folder / "config.json").write_text(json.dumps(config))
    weights = {k: (w.astype(np.float16) if "mlp" in k else w) for k, w in hf_weights(seed).items()}
    save_file(weights, str(folder / "model.safetensors"))
    make_tokenizer().save(str(folder / "tokenizer.json"))
    tok_config = {"bos_token": "<|s|>", "add_bos_token": False, "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return folder


_GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}
_QTYPES = {"ffn_down": "Q4_K", "ffn_up": "Q8_0", "ffn_gate": "Q4_0", "attn_output": "F16"}


def _gguf_name(key: str) -> str:
    if key in _GGUF_NAMES:
        return _GGUF_NAMES[key]
    _, _, layer, rest = key.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest.rsplit('.', 1)[0]]}.weight"


def _random_q4k(shape: tuple[int, int], seed: int) -> np.ndarray:
    """Q4_K blocks (f16 d, f16 dmin, 12 scale bytes, 128 nibble bytes per 256 values) as uint8 rows."""
    rows, cols = shape
    blocks = np.random.default_rng(seed).integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    blocks[..., 0:4] = np.array([0.01, 0.001], np.float16).view(np.uint8)
    return blocks.reshape(rows, cols // 256 * 144)


def make_gguf(path: Path, seed: int = 0, meta: dict | None = None, merges: bool = True,
              extra_tensors: dict[str, np.ndarray] | None = None) -> Path:
    """The mini llama GGUF; ``meta`` adds float32 metadata (``{"llama.rope.freq_base": nan}``),
    ``merges=False`` leaves the BPE merges out, ``extra_tensors`` adds F32 tensors."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("context_length", 512), ("embedding_length", HIDDEN), ("block_count", LAYERS),
                       ("feed_forward_length", FFN), ("attention.head_count", HEADS),
                       ("attention.head_count_kv", KV_HEADS), ("rope.dimension_count", HEAD_DIM)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for key, value in (meta or {}).items():
        w.add_float32(key, value)
    tok = json.loads(make_tokenizer().to_str())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i < 3 else 1 for i in range(len(tokens))])
    if merges:
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(0)
    w.add_chat_template(CHAT_TEMPLATE)
    for key, arr in hf_weights(seed).items():
        name = _gguf_name(key)
        qtype = gguf.GGMLQuantizationType[_QTYPES.get(name.split(".")[-2], "F32")]
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, arr)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, arr.astype(np.float16))
        elif qtype == gguf.GGMLQuantizationType.Q4_K:  # no python quantizer: random blocks, small scales
            w.add_tensor(name, _random_q4k(arr.shape, seed), raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    for name, arr in (extra_tensors or {}).items():
        w.add_tensor(name, arr.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def add_fake_engines(folder: Path) -> Path:
    """Record two random 'engines' in ``folder``'s manifest (read_engine checks them; no GPU needed)."""
    import hashlib

    from decodert.artifact.manifest import MANIFEST

    manifest = json.loads((folder / MANIFEST).read_text())
    engines = {}
    for i, name in enumerate(("prefill", "decode")):
        blob = np.random.default_rng(i).integers(0, 256, 4096, dtype=np.uint8).tobytes()
        (folder / f"{name}.engine").write_bytes(blob)
        engines[name] = {"file": f"{name}.engine", "size": len(blob), "sha256": hashlib.sha256(blob).hexdigest(),
                         "tensorrt": dict(ENGINE_TRT), "version_compatible": False}
    manifest["engines"] = engines
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return folder


def make_samples(root: Path) -> dict[str, Path]:
    """Build every sample under ``root`` (once); returns name -> path."""
    from decodert.export.pipeline import export_model

    root.mkdir(parents=True, exist_ok=True)
    hf = make_hf(root / "hf")
    art = root / "art"
    if not (art / "manifest.json").is_file():
        export_model(hf, art, target="ort", dtype="fp32", max_seq=256, max_batch=2, progress=False)
    eng = root / "eng"
    if not eng.is_dir():
        shutil.copytree(art, eng)
        add_fake_engines(eng)
    template = root / "chat_template.jinja"  # the "template" fuzz target's sample
    template.write_text("{{ bos_token }}" + CHAT_TEMPLATE)
    return {"gguf": make_gguf(root / "mini.gguf"), "hf": hf, "art": art, "eng": eng, "template": template}


def add_listed_file(art: Path, name: str, data: bytes) -> Path:
    """Put ``name`` into the artifact and record it (size + hashes) in the manifest."""
    from decodert.artifact.artifact_files import file_record
    from decodert.artifact.manifest import load_manifest, write_manifest

    (art / name).write_bytes(data)
    manifest = load_manifest(art, verify="none")
    write_manifest(art, manifest.replace(files={**manifest.files, name: file_record(art / name)}))
    return art / name


def flip_byte(path: Path, at: int) -> None:
    """Invert the byte at offset ``at``."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))
