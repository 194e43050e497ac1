"""Granite 4.0-H (granitemoehybrid): Mamba2 and attention layers, each with the shared SwiGLU MLP, in the MoE
variant the router's experts beside it; every Granite multiplier away from 1.

Against transformers on tiny random checkpoints (the Mamba2 math and the runtime over its states are tested at
length in tests/test_nemotron_h.py): logits and greedy tokens for the ort, portable and trt graphs, dense and MoE,
a ragged batch equal to the singles; speculative equals plain; a GGUF in llama.cpp's layout; an unknown layer kind
refused in one line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from parity import backend, decodert_greedy, hf_reference, logits_parity, random_prompts  # noqa: E402
from tiny import make_tiny_checkpoint, tiny_config  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.export.pipeline import export_model  # noqa: E402
from decodert.models import family_for  # noqa: E402
from decodert.runtime.decoding.sampling import SamplingParams  # noqa: E402
from decodert.runtime.llm import LLM, Request  # noqa: E402
from decodert.runtime.speculation.speculative import SpeculativeConfig  # noqa: E402

pytest.importorskip("transformers.models.granitemoehybrid")
MAX_SEQ = 112


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    made: dict[tuple[str, str], Path] = {}
    sources = {variant: make_tiny_checkpoint("granitemoehybrid", tmp_path_factory.mktemp(f"granite-{variant}"),
                                             num_local_experts=4 if variant == "moe" else 0)
               for variant in ("dense", "moe")}
    models = {v: AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval() for v, src in sources.items()}

    def get(variant: str, target: str) -> Path:
        if (variant, target) not in made:
            made[variant, target] = tmp_path_factory.mktemp(f"granite-{variant}-{target}")
            export_model(sources[variant], made[variant, target], target=target, dtype="fp32", max_seq=MAX_SEQ,
                         max_batch=4, progress=False)
        return made[variant, target]

    return sources, models, get


def test_spec_reads_kinds_multipliers_and_experts():
    spec = family_for("granitemoehybrid").spec_from_hf(tiny_config("granitemoehybrid"))
    assert spec.layer_kinds == ("mamba2", "attention", "mamba2") and spec.kv_layers == (1,)
    m = spec.mixer(0)
    assert (m.heads, m.head_dim, m.state, m.groups) == (8, 16, 16, 2)
    assert (spec.embed_scale, spec.residual_scale, spec.attention.scale, spec.logits_scaling) == (3.0, 0.5, 0.1, 2.0)
    assert spec.experts() is None and spec.mlp_size(0) == 96
    assert spec.attention.rope_table == "rope_none"  # no position embedding: the identity rotation
    moe = family_for("granitemoehybrid").spec_from_hf(tiny_config("granitemoehybrid", num_local_experts=4)).mlp(0)
    assert moe.num_experts == 4 and moe.shared.size == 96 and moe.expert_size == 32


@pytest.mark.parametrize("variant,target", [("dense", "ort"), ("dense", "trt"), ("moe", "ort"), ("moe", "portable")])
def test_logits_and_greedy_match_transformers(granite, variant, target):
    _, models, get = granite
    prompts = random_prompts((40, 5, 1), seed=1)  # longer than the scan's chunk (16) and the conv window
    refs = [hf_reference(models[variant], p, 9) for p in prompts]
    assert logits_parity(get(variant, target), refs, prompts, steps=8) < 1e-4
    be = backend(get(variant, target))
    assert decodert_greedy(be, prompts, 9) == [toks for toks, _ in refs]
    assert [decodert_greedy(be, [p], 9)[0] for p in prompts] == [toks for toks, _ in refs]  # uneven batch = singles


def test_speculative_equals_plain(granite):
    _, _, get = granite
    llm = LLM.load(get("moe", "ort"), backend="ort")
    rng = np.random.default_rng(4)
    ps = [np.tile(rng.integers(3, 512, 6), 4), rng.integers(3, 512, 9)]
    plain = [llm.generate(p, max_new_tokens=30).token_ids for p in ps]
    fixed = SpeculativeConfig(adaptive=False, draft_len=5)
    batch = llm.generate_many([Request(p, SamplingParams(max_new_tokens=30), speculative=fixed) for p in ps])
    assert [r.token_ids for r in batch] == plain


def test_unknown_layer_kind_is_one_line(tmp_path):
    src = make_tiny_checkpoint("granitemoehybrid", tmp_path / "m")
    config = json.loads((src / "config.json").read_text())
    config["layer_types"] = ["mamba", "mamba3", "attention"]
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(DecodertError, match="layer kind 'mamba3'") as e:
        export_model(src, tmp_path / "out", max_seq=32, progress=False)
    assert "\n" not in str(e.value)


# ---- GGUF: llama.cpp's granitehybrid files (dense MLP) --------------------------------------------------------
def make_granite_gguf(src: Path, path: Path) -> Path:
    """The tiny dense checkpoint as llama.cpp's converter writes it (names from the gguf package's GRANITE_HYBRID
    map; the shared MLP's input_linear split into ffn_gate and ffn_up; ssm tensors as for nemotron_h)."""
    import gguf
    from safetensors.numpy import load_file
    from test_nemotron_h import _to_llama_cpp_layout
    from tiny import _gguf_tokenizer_meta

    cfg = json.loads((src / "config.json").read_text())
    types = cfg["layer_types"]
    arch = "granitehybrid"
    writer = gguf.GGUFWriter(str(path), arch)
    _gguf_tokenizer_meta(writer, src)
    for key, value in (("context_length", cfg["max_position_embeddings"]), ("embedding_length", cfg["hidden_size"]),
                       ("block_count", len(types)), ("attention.head_count", cfg["num_attention_heads"]),
                       ("attention.key_length", cfg["head_dim"]), ("attention.value_length", cfg["head_dim"]),
                       ("feed_forward_length", cfg["shared_intermediate_size"]), ("vocab_size", cfg["vocab_size"]),
                       ("ssm.conv_kernel", cfg["mamba_d_conv"]), ("ssm.state_size", cfg["mamba_d_state"]),
                       ("ssm.group_count", cfg["mamba_n_groups"]), ("ssm.time_step_rank", cfg["mamba_n_heads"]),
                       ("ssm.inner_size", cfg["mamba_n_heads"] * cfg["mamba_d_head"])):
        writer.add_uint32(f"{arch}.{key}", int(value))
    writer.add_array(f"{arch}.attention.head_count_kv",
                     [cfg["num_key_value_heads"] if t == "full_attention" else 0 for t in types])
    for key, value in (("attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"]),
                       ("embedding_scale", cfg["embedding_multiplier"]), ("residual_scale", cfg["residual_multiplier"]),
                       ("logit_scale", cfg["logits_scaling"]), ("attention.scale", cfg["attention_multiplier"])):
        writer.add_float32(f"{arch}.{key}", float(value))
    writer.add_bool(f"{arch}.rope.scaling.finetuned", False)  # llama.cpp's "no RoPE" (position_embedding_type nope)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GRANITE_HYBRID, len(types))
    fields = {"n_groups": cfg["mamba_n_groups"]}
    for key, w in load_file(src / "model.safetensors").items():
        if key.endswith("shared_mlp.input_linear.weight"):
            layer = key.split(".")[2]
            gate, up = np.split(w, 2)
            writer.add_tensor(f"blk.{layer}.ffn_gate.weight", np.ascontiguousarray(gate, np.float32))
            writer.add_tensor(f"blk.{layer}.ffn_up.weight", np.ascontiguousarray(up, np.float32))
            continue
        hf = key.replace(".dt_bias", ".dt_proj.bias").replace("shared_mlp.output_linear", "mlp.down_proj")
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        writer.add_tensor(name, np.ascontiguousarray(_to_llama_cpp_layout(key, w, fields), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_as_llama_cpp_writes_it(granite, tmp_path):
    """A granitehybrid GGUF: llama.cpp (llama-cpp-python) reads it as transformers' model, and decodert's export of
    it gives transformers' logits."""
    sources, models, _ = granite
    path = make_granite_gguf(sources["dense"], tmp_path / "tiny-granitehybrid.gguf")
    prompt = random_prompts((13,), seed=3)[0]
    ref = hf_reference(models["dense"], prompt, 9)
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2,
                          type_k=0, type_v=0)  # an F32 KV cache
    llm.eval(list(map(int, prompt)))
    want = models["dense"](torch.tensor([list(map(int, prompt))])).logits[0, -1].detach().numpy()
    assert np.abs(np.asarray(llm.scores[len(prompt) - 1]) - want).max() < 1e-3 * np.abs(want).max()
    out = tmp_path / "out"
    export_model(path, out, target="ort", dtype="fp32", max_seq=32, max_batch=1, progress=False)
    assert logits_parity(out, [ref], [prompt], steps=8) < 1e-4
