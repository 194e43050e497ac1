"""Gemma 4's assistant (MTP drafter) against transformers' Gemma4AssistantForCausalLM on tiny random checkpoints:
the target's hidden-state outputs, the head artifact (its record, the target it refuses), the head's draft logits
and its next hidden state given the same target hidden state, token and K/V (within 1e-4), plain and with ordered
embeddings (centroids)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import transformers

from draft_battery import PROMPTS, greedy_drafting_is_plain, int4_head_stays_exact, sessions_and_prefix_hits_stay_exact
from tiny import _randomise, make_tiny_checkpoint  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.artifact.manifest import load_manifest  # noqa: E402
from decodert.export.heads import HEAD_GRAPH, export_head, load_head  # noqa: E402
from decodert.export.pipeline import export_model  # noqa: E402
from decodert.models.families import gemma4_assistant  # noqa: E402

TOL = 1e-4
MAX_SEQ = 128


def assistant_config(**overrides) -> transformers.Gemma4AssistantConfig:
    text = dict(model_type="gemma4_text", hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=4, vocab_size=512,
                intermediate_size=48, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                rms_norm_eps=1e-5, layer_types=["sliding_attention", "full_attention", "full_attention"],
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                    "rope_theta": 1000000.0}})
    return transformers.Gemma4AssistantConfig(text_config=text, backbone_hidden_size=64, **overrides)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny Gemma 4 target (K/V shared by its last layers), its transformers model, and an fp32 export with the
    hidden-state outputs."""
    root = tmp_path_factory.mktemp("g4a")
    src = make_tiny_checkpoint("gemma4", root / "target")
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    art = root / "target-art"
    export_model(src, art, max_seq=MAX_SEQ, max_batch=4, progress=False, hidden_states=True)
    return root, src, model, art


def make_head(root, name: str, **overrides):
    torch.manual_seed(1)
    model = transformers.Gemma4AssistantForCausalLM(assistant_config(**overrides)).eval()
    _randomise(model, 1)
    if overrides.get("use_ordered_embeddings"):
        with torch.no_grad():
            model.masked_embedding.token_ordering.copy_(torch.randperm(512, generator=torch.Generator().manual_seed(3)))
    model.save_pretrained(root / name)
    return root / name, model


def test_hidden_state_outputs_match_transformers(target):
    """prefill.onnx's hidden_state is the final norm's output at each row's last token (transformers'
    hidden_states[-1], what the assistant reads); verify.onnx's seq_hidden every position's."""
    _, _, model, art = target
    m = load_manifest(art)
    assert [t.name for t in m.graphs["prefill"].outputs][-3:] == ["hidden_state", "seq_hidden", "prompt_hidden"]
    assert m.graphs["verify"].outputs[-1].name == "seq_hidden" and m.graphs["decode"].outputs[-1].name == "hidden_state"
    ids = np.array([[5, 9, 33, 7, 100, 3, 41]], np.int64)
    with torch.no_grad():
        ref = model(torch.from_numpy(ids), output_hidden_states=True).hidden_states[-1][0].numpy()  # [S, hidden]
    sess = ort.InferenceSession(str(art / "verify.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": ids, "past_lengths": np.zeros(1, np.int64)}
    for t in sess.get_inputs():
        if t.name.startswith("past_") and t.name != "past_lengths":
            feeds[t.name] = np.zeros([1 if s == "batch" else s for s in t.shape], np.float32)
    out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    np.testing.assert_allclose(out["seq_hidden"][0], ref, atol=TOL)


def test_exports_without_hidden_states_are_unchanged(target, tmp_path):
    """The option only adds outputs: without it the graphs carry none and the rest is the same."""
    _, src, _, art = target
    plain = tmp_path / "plain"
    export_model(src, plain, max_seq=MAX_SEQ, max_batch=4, progress=False)
    for kind in ("prefill", "decode", "verify"):
        a, b = onnx.load(str(plain / f"{kind}.onnx"), load_external_data=False), onnx.load(
            str(art / f"{kind}.onnx"), load_external_data=False)
        assert not {"hidden_state", "seq_hidden"} & {o.name for o in a.graph.output}
        assert [o.name for o in a.graph.output] == [o.name for o in b.graph.output][: len(a.graph.output)]
    assert (plain / "weights.bin").read_bytes() == (art / "weights.bin").read_bytes()


def _target_state(model, ids: list[int]):
    """transformers' target over ``ids``: (shared K/V per kind, last hidden state [hidden], the chosen next token)."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True, return_shared_kv_states=True)
    return out.shared_kv_states, out.hidden_states[-1][0, -1], int(out.logits[0, -1].argmax())


@pytest.mark.parametrize("ordered", [False, True])
def test_draft_logits_match_transformers(target, ordered):
    """Three rows of different lengths (past the sliding window and not): the head's logits and hidden_out within
    1e-4 of Gemma4AssistantForCausalLM's given the same target hidden states, tokens and K/V; then a chained step."""
    root, _, model, art = target
    overrides = dict(use_ordered_embeddings=True, num_centroids=16, centroid_intermediate_top_k=4) if ordered else {}
    head_src, head = make_head(root, f"head-{int(ordered)}", **overrides)
    out = root / f"head-art-{int(ordered)}"
    record = export_head(head_src, out, art)
    assert record["reads"]["kv_layers"] == {"full_attention": 2, "sliding_attention": 1}
    assert load_head(out, load_manifest(art))["family"] == "gemma4_assistant"
    sess = ort.InferenceSession(str(out / HEAD_GRAPH), providers=["CPUExecutionProvider"])
    rows = [[5, 9, 33, 7, 100, 3, 41, 8], [17, 2, 250], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71]]
    embed = model.get_input_embeddings()
    feeds = {"token_embeds": [], "hidden": [], "past_lengths": np.array([len(r) for r in rows], np.int64)}
    caches = {f"past_{n}.{i}": np.zeros((len(rows), 2, MAX_SEQ, d), np.float32)
              for i, d in ((1, 16), (2, 32)) for n in ("key", "value")}
    refs = []
    for b, ids in enumerate(rows):
        kv, hidden, token = _target_state(model, ids)
        for kind, i in (("sliding_attention", 1), ("full_attention", 2)):
            caches[f"past_key.{i}"][b, :, : len(ids)] = kv[kind][0][0].numpy()
            caches[f"past_value.{i}"][b, :, : len(ids)] = kv[kind][1][0].numpy()
        with torch.no_grad():
            e = embed(torch.tensor([[token]]))  # the target's scaled embedding
            ref = head(inputs_embeds=torch.cat([e, hidden.view(1, 1, -1)], -1), position_ids=torch.tensor([[len(ids)]]),
                       shared_kv_states=kv)
            t2 = int(ref.logits[0, -1].argmax())
            ref2 = head(inputs_embeds=torch.cat([embed(torch.tensor([[t2]])), ref.last_hidden_state], -1),
                        position_ids=torch.tensor([[len(ids)]]), shared_kv_states=kv)
        feeds["token_embeds"].append(e[0, 0].numpy())
        feeds["hidden"].append(hidden.numpy())
        refs.append((ref, t2, ref2))
    feeds = {**{k: np.stack(v) if isinstance(v, list) else v for k, v in feeds.items()}, **caches}
    logits, next_token, hidden_out = sess.run(None, feeds)
    for b, (ref, t2, ref2) in enumerate(refs):
        np.testing.assert_allclose(logits[b], ref.logits[0, -1].numpy(), atol=TOL)
        np.testing.assert_allclose(hidden_out[b], ref.last_hidden_state[0, -1].numpy(), atol=TOL)
        assert next_token[b] == t2
    # the chained step: its own token and hidden_out at the same position over the same K/V
    with torch.no_grad():
        e2 = np.stack([embed(torch.tensor([t2]))[0].numpy() for _, t2, _ in refs])
    logits2, _, _ = sess.run(None, {**feeds, "token_embeds": e2, "hidden": hidden_out})
    for b, (_, _, ref2) in enumerate(refs):
        np.testing.assert_allclose(logits2[b], ref2.logits[0, -1].numpy(), atol=TOL)


def test_head_refuses_another_target(target, tmp_path):
    root, src, _, art = target
    head_src, _ = make_head(root, "head-other")
    plain = tmp_path / "plain"
    export_model(src, plain, max_seq=MAX_SEQ, max_batch=4, progress=False)
    with pytest.raises(DecodertError, match="export the target again with --hidden-states"):
        export_head(head_src, tmp_path / "h", plain)
    export_head(head_src, tmp_path / "h2", art)
    other = tmp_path / "other"
    export_model(make_tiny_checkpoint("gemma4", tmp_path / "t2", seed=5), other, max_seq=MAX_SEQ, progress=False,
                 hidden_states=True)
    with pytest.raises(DecodertError, match="exported for another target"):
        load_head(tmp_path / "h2", load_manifest(other))
    record = json.loads((tmp_path / "h2" / "head.json").read_text())
    assert record["target"]["weights_sha256"] == load_manifest(art).files["weights.bin"].sha256


def test_spec_refuses_what_it_cannot_run():
    config = assistant_config().to_dict()
    assert gemma4_assistant.spec_from_hf(config).kinds == ("sliding_attention", "full_attention", "full_attention")
    config["text_config"]["num_kv_shared_layers"] = 1
    with pytest.raises(DecodertError, match="every layer must read the target's K/V"):
        gemma4_assistant.spec_from_hf(config)


# ---- drafting: LLM.load(target, draft=HEAD), speculative="assistant" -------------------------------------------


@pytest.fixture(scope="module")
def assisted(target):
    """The target loaded with its head (a head that copies the target's own choices often enough: its drafts are
    right sometimes, wrong often), and the plain greedy tokens to compare with."""
    from decodert.runtime.llm import LLM

    root, _, _, art = target
    head_src, _ = make_head(root, "head-llm")
    export_head(head_src, root / "head-llm-art", art)
    llm = LLM.load(art, backend="ort", draft=root / "head-llm-art", prefix_cache_mb=0)
    plain = [llm.generate(p, max_new_tokens=20).token_ids for p in PROMPTS]
    return llm, plain, root / "head-llm-art"


def test_greedy_assistant_is_plain_decoding_batch_1_and_4(assisted):
    llm, plain, _ = assisted
    greedy_drafting_is_plain(llm, plain, "assistant", refused="mtp")


def test_the_head_drafts_what_transformers_drafts(assisted, target):
    """The drafter's first proposal after a prompt: the head's greedy chain from the target's own hidden state and
    K/V, as transformers' assistant chains it (the same position, its own hidden_out fed back)."""
    from decodert.runtime.speculation.speculative import SpeculativeConfig

    llm, plain, _ = assisted
    root, _, model, _ = target
    _, head = make_head(root, "head-llm-ref")  # the same seed: the same weights as the loaded head
    drafter = llm.engine.speculator.drafter(SpeculativeConfig("assistant"))
    seen = []
    propose = drafter.propose

    def spy(seqs, limits):
        drafts, keys = propose(seqs, limits)
        seen.append((seqs[0].history[: seqs[0].length].copy(), drafts[0].copy()))
        return drafts, keys

    drafter.propose = spy
    try:
        llm.generate(PROMPTS[0], max_new_tokens=6, speculative=SpeculativeConfig("assistant", draft_len=3, adaptive=False))
    finally:
        drafter.propose = propose
    history, draft = seen[0]
    kv, hidden, _ = _target_state(model, history[:-1].tolist())
    embed, token, want = model.get_input_embeddings(), int(history[-1]), []
    with torch.no_grad():
        h = hidden.view(1, 1, -1)
        for _ in range(len(draft)):
            out = head(inputs_embeds=torch.cat([embed(torch.tensor([[token]])), h], -1),
                       position_ids=torch.tensor([[len(history) - 1]]), shared_kv_states=kv)
            token, h = int(out.logits[0, -1].argmax()), out.last_hidden_state
            want.append(token)
    assert draft.tolist() == want and len(want) == 3


def test_sessions_and_prefix_hits_stay_exact(assisted, target):
    llm, _, head = assisted
    _, _, _, art = target
    sessions_and_prefix_hits_stay_exact(llm, art, head, "assistant")


def test_a_head_for_another_target_is_refused_at_load(assisted, tmp_path):
    from decodert.runtime.llm import LLM

    _, _, head = assisted
    other = tmp_path / "other"
    export_model(make_tiny_checkpoint("gemma4", tmp_path / "t2", seed=7), other, max_seq=MAX_SEQ, progress=False,
                 hidden_states=True)
    with pytest.raises(DecodertError, match="exported for another target"):
        LLM.load(other, backend="ort", draft=head)
    with pytest.raises(DecodertError, match="needs a draft head"):
        LLM.load(other, backend="ort").generate([1, 2], max_new_tokens=2, speculative="assistant")


def test_cli_exports_a_head_and_runs_it(target, tmp_path, capsys):
    """`decodert export HEAD --target-artifact T`, `decodert run T --draft HEAD` (implies --speculative assistant),
    and the one-line refusals: a head without its target, a head checkpoint through the plain export, flags that
    disagree with the --draft given."""
    from decodert.cli import main

    root, src, _, art = target
    head_src, _ = make_head(root, "head-cli")
    assert main(["export", str(head_src), "-o", str(tmp_path / "h")]) == 2
    assert "--target-artifact TARGET" in capsys.readouterr().err
    assert main(["export", str(head_src), "--target-artifact", str(art), "-o", str(tmp_path / "h")]) == 0
    assert "exported gemma4_assistant head" in capsys.readouterr().out
    assert main(["export", str(head_src), "--target-artifact", str(art), "-o", str(tmp_path / "h")]) == 2
    assert "--force" in capsys.readouterr().err
    with pytest.raises(DecodertError, match="is a draft head checkpoint"):
        export_model(head_src, tmp_path / "x", progress=False)
    assert main(["run", str(art), "--backend", "ort", "--draft", str(tmp_path / "h"), "--prompt", "hello",
                 "--max-new-tokens", "4"]) == 0
    capsys.readouterr()
    assert main(["run", str(art), "--backend", "ort", "--draft", str(tmp_path / "h"), "--speculative", "draft",
                 "--prompt", "hello"]) == 2
    assert "use --speculative assistant" in capsys.readouterr().err
    assert main(["run", str(art), "--backend", "ort", "--speculative", "assistant", "--prompt", "hello"]) == 2
    assert "needs --draft HEAD" in capsys.readouterr().err


def test_speculative_sampling_keeps_the_targets_distribution(assisted, target):
    """1200 seeds, 3 tokens (the first from the prefill, the next two from one verify pass of 2 head drafts:
    accepted, or rejected and resampled, then the bonus token) against the exact joint distribution of the target
    (transformers' logits under the same top-k 3 / temperature transform), plain sampling as the control."""
    from distribution import assert_keeps_the_targets_distribution

    llm, _, _ = assisted
    _, _, model, _ = target
    assert_keeps_the_targets_distribution(llm, model, PROMPTS[1], "assistant", n=1200, temperature=1.0, top_k=3)


@pytest.mark.trt
def test_trt_builds_the_hidden_state_graphs_and_the_head(target, tmp_path):
    """TensorRT-RTX (on the CPU, as the other engines): a trt-target fp16 export with --hidden-states builds every
    engine with the hidden-state outputs, and the head's graph for it parses and builds."""
    pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX not installed")
    from decodert.export import trt_build
    from decodert.plugins.trt.compat import load_trt

    root, src, _, _ = target
    out = tmp_path / "trt"
    export_model(src, out, target="trt", dtype="fp16", max_seq=64, max_batch=2, progress=False, hidden_states=True)
    engines = trt_build.build_engines(out, progress=False)
    assert "hidden_state" in {t["name"] for t in engines["prefill"].io["outputs"]}
    assert "seq_hidden" in {t["name"] for t in engines["verify"].io["outputs"]}
    head_src, _ = make_head(root, "head-trt", use_ordered_embeddings=True, num_centroids=16,
                            centroid_intermediate_top_k=4)
    record = export_head(head_src, tmp_path / "head", out)
    trt, _ = load_trt(need_builder=True)
    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    network, _parser = trt_build.parse_onnx(trt, builder, logger, tmp_path / "head" / HEAD_GRAPH)
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for io in record["graph"]["inputs"]:
        shape = lambda b: [b if s == "batch" else s for s in io["shape"]]  # noqa: E731
        profile.set_shape(io["name"], shape(1), shape(2), shape(2))
    config.add_optimization_profile(profile)
    assert builder.build_serialized_network(network, config) is not None


def test_trt_backend_binds_the_hidden_state_outputs(target, tmp_path, monkeypatch):
    """A trt-target export with --hidden-states runs on the trt backend (every engine output bound: the emulator
    refuses a call that leaves one unbound), plain and speculative, with the ort backend's tokens."""
    import trt_emulator

    from decodert.runtime.llm import LLM
    from decodert.runtime.speculation.speculative import SpeculativeConfig

    _, src, _, _ = target
    art = tmp_path / "fp16"
    export_model(src, art, target="trt", dtype="fp16", max_seq=64, max_batch=2, progress=False, hidden_states=True)
    trt_emulator.emulate_engines(art)
    trt_emulator.install(monkeypatch)
    fixed = SpeculativeConfig(adaptive=False, draft_len=4)
    with LLM.load(art, backend="ort") as reference, LLM.load(art, backend="trt") as llm:
        want = [reference.generate(p, max_new_tokens=10).token_ids for p in PROMPTS[:2]]
        assert [llm.generate(p, max_new_tokens=10).token_ids for p in PROMPTS[:2]] == want
        assert [r.token_ids for r in llm.generate(PROMPTS[:2], max_new_tokens=10, speculative=fixed)] == want
        assert llm.backend.stats["verify_runs"] > 0


def test_a_quantized_assistant_is_close_to_the_float_one_and_stays_exact(target, tmp_path, capsys):
    """``--quant int8|int4`` on the assistant: its linears (pre/post projection, each layer's q/o/gate/up/down) as
    MatMulNBits; the embedding, which the logits read as the lm_head, stays float (head.json: lm_head false).
    int8's logits within 2% of the float head's range on random inputs over a random cache; greedy drafting
    with the int4 head is still plain decoding."""
    from decodert.export.quantize.quant import QuantConfig

    root, _, _, art = target
    head_src, _ = make_head(root, "head-q")
    export_head(head_src, tmp_path / "hf", art)
    rec = export_head(head_src, tmp_path / "h8", art, quant=QuantConfig(bits=8, accuracy_level=0))
    assert rec["quant"]["bits"] == 8 and rec["quant"]["lm_head"] is False
    graph = onnx.load(str(tmp_path / "h8" / HEAD_GRAPH), load_external_data=False)
    quantized = {i.name[: -len(".q")] for i in graph.graph.initializer if i.name.endswith(".q")}
    layers = {f"layers.{i}.{n}" for i in range(len(rec["spec"]["kinds"])) for n in ("q", "o", "gate", "up", "down")}
    assert quantized == {"pre_projection", "post_projection"} | layers
    rng = np.random.default_rng(0)
    feeds = {"token_embeds": rng.standard_normal((2, 64), np.float32), "hidden": rng.standard_normal((2, 64), np.float32),
             "past_lengths": np.array([5, 9], np.int64),
             **{f"past_{n}.{i}": rng.standard_normal((2, 2, MAX_SEQ, d), np.float32)
                for i, d in ((1, 16), (2, 32)) for n in ("key", "value")}}
    (want, _, want_hidden), (got, _, hidden) = (
        ort.InferenceSession(str(h / HEAD_GRAPH), providers=["CPUExecutionProvider"]).run(None, feeds)
        for h in (tmp_path / "hf", tmp_path / "h8"))
    assert np.abs(got - want).max() < 0.02 * np.abs(want).max()
    assert np.abs(hidden - want_hidden).max() < 0.02 * np.abs(want_hidden).max()

    int4_head_stays_exact(head_src, art, tmp_path / "h4", "assistant", "mtp", capsys)
