"""Qwen3.5's MTP layer as a draft head (speculative="mtp") on a tiny random Qwen3.5 whose safetensors carry random
mtp.* tensors in the published layout (models/families/qwen3_5.MTP_WEIGHTS).

transformers does not load the MTP layer, so there is no transformers reference for it: ``MtpReference`` below is
an independent torch one, written from the layer definitions (the published checkpoints' mtp.* modules, as vLLM's
and SGLang's Qwen3.5 / Qwen3-Next MTP models run them) and built of transformers' own Qwen3.5 modules with the mtp
weights loaded into them: Qwen3_5RMSNorm (the (1 + w) norms), a Qwen3_5DecoderLayer of kind full_attention (gated
attention, q/k norm, partial RoPE, the MLP) and Qwen3_5TextRotaryEmbedding. It runs the whole sequence of pairs
(h_p, token p+1) at once under a causal mask, so it keeps no cache: the head's own K/V, written call by call, is
checked by agreeing with it (draft logits within 1e-4)."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file
from transformers.models.qwen3_5 import modeling_qwen3_5 as q35
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q35moe

from draft_battery import (PROMPTS, catch_up_outputs, forced_drafts, fp16_head_stays_exact, greedy_drafting_is_plain,
                           int4_head_stays_exact, proposals,
                           sessions_and_prefix_hits_stay_exact)
from tiny import _randomise, make_tiny_checkpoint  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.artifact.manifest import load_manifest  # noqa: E402
from decodert.export.heads import HEAD_GRAPH, export_head, load_head  # noqa: E402
from decodert.export.pipeline import export_model  # noqa: E402

TOL = 1e-4
MAX_SEQ = 128
MOE = dict(model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
           shared_expert_intermediate_size=40)  # a tiny Qwen3.5-MoE: 4 experts of 24, top 2, a shared expert of 40


class MtpReference(torch.nn.Module):
    """The MTP module with the checkpoint's names (mtp.<name>): pre_fc_norm_embedding, pre_fc_norm_hidden, fc,
    layers.0 (a full-attention Qwen3.5 decoder layer), norm; the target's embed_tokens and lm_head beside it."""

    def __init__(self, text: transformers.PretrainedConfig) -> None:
        super().__init__()
        moe = text.model_type == "qwen3_5_moe_text"  # the layer of a Qwen3.5-MoE: its sparse MoE block
        kind = transformers.Qwen3_5MoeTextConfig if moe else transformers.Qwen3_5TextConfig
        config = kind(**{**text.to_dict(), "num_hidden_layers": 1, "layer_types": ["full_attention"]})
        config._attn_implementation = "eager"
        h = config.hidden_size
        self.pre_fc_norm_embedding = q35.Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = q35.Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.layers = torch.nn.ModuleList([(q35moe.Qwen3_5MoeDecoderLayer if moe else q35.Qwen3_5DecoderLayer)(config, 0)])
        self.norm = q35.Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)
        self.rotary = q35.Qwen3_5TextRotaryEmbedding(config)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, first: int = 0) -> torch.Tensor:
        """Pairs [1, S, h] (the embedding of token p+1, the hidden state at p) at positions first..first+S-1
        -> the normed output [1, S, h] (lm_head of it: the logits; the next step's hidden state)."""
        s = embeds.shape[1]
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], -1))
        positions = torch.arange(first, first + s)[None]
        mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
        x = self.layers[0](x, position_embeddings=self.rotary(x, positions), attention_mask=mask,
                           position_ids=positions)
        return self.norm(x)


def add_mtp_layers(src, seed: int = 2) -> MtpReference:
    """Random mtp.* tensors added to the checkpoint's safetensors (and mtp_num_hidden_layers to its config.json);
    returns the reference module holding them."""
    config = transformers.AutoConfig.from_pretrained(src)
    torch.manual_seed(seed)
    ref = MtpReference(config).eval()
    _randomise(ref, seed)
    with torch.no_grad():  # norms near 0: Qwen3.5's RMSNorm multiplies by (1 + w)
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.sub_(1.0)
    tensors = load_file(src / "model.safetensors")
    for k, v in ref.state_dict().items():
        v = v.numpy().copy()
        if k.endswith("mlp.experts.gate_up_proj"):  # transformers' fused [E, 2 Ie, h] -> the published per-expert
            for j, w in enumerate(v):
                gate, up = np.split(w, 2)
                tensors[f"mtp.layers.0.mlp.experts.{j}.gate_proj.weight"] = gate.copy()
                tensors[f"mtp.layers.0.mlp.experts.{j}.up_proj.weight"] = up.copy()
        elif k.endswith("mlp.experts.down_proj"):
            for j, w in enumerate(v):
                tensors[f"mtp.layers.0.mlp.experts.{j}.down_proj.weight"] = w.copy()
        elif not k.startswith("rotary"):
            tensors[f"mtp.{k}"] = v
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**raw, "mtp_num_hidden_layers": 1}, indent=2))
    return ref


def _target(root, **overrides):
    src = make_tiny_checkpoint("qwen3_5", root / "target", **overrides)
    ref = add_mtp_layers(src)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    art = root / "target-art"
    export_model(src, art, max_seq=MAX_SEQ, max_batch=4, progress=False, hidden_states=True)
    head = root / "head"
    record = export_head(src, head, art)
    return root, src, model, ref, art, head, record


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny Qwen3.5 with MTP layers, its transformers model, the reference MTP, and an fp32 export with the
    hidden-state outputs and its MTP head beside it."""
    return _target(tmp_path_factory.mktemp("q35mtp"))


@pytest.fixture(scope="module", params=["dense", "moe"])
def any_target(request, tmp_path_factory):
    """The dense one, and a tiny Qwen3.5-MoE whose MTP layer has its experts and shared expert."""
    if request.param == "dense":
        return request.getfixturevalue("target")
    return _target(tmp_path_factory.mktemp("q35moemtp"), **MOE)


def _pairs(model, ids: list[int]):
    """transformers' target over ``ids``: (every position's last hidden state [n, h], the embedding of each next
    token [n, h] (the last: the target's greedy choice), that choice)."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
        nxt = int(out.logits[0, -1].argmax())
        embeds = model.get_input_embeddings()(torch.tensor(ids[1:] + [nxt]))
    return out.hidden_states[-1][0], embeds, nxt


def test_the_head_record_and_its_target(target, tmp_path):
    _, _, _, _, art, head, record = target
    assert record["family"] == "qwen3_5_mtp" and record["target"]["family"] == "qwen3_5"
    assert record["target"]["weights_sha256"] == load_manifest(art).files["weights.bin"].sha256
    assert load_head(head, load_manifest(art))["cache"] == {"layers": 1, "num_kv_heads": 2, "head_dim": 32}
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "head.json").write_text(json.dumps({**record, "cache": {"layers": 1, "head_dim": 32}}))
    with pytest.raises(DecodertError, match="'cache' record must give"):
        load_head(broken, load_manifest(art))


def test_draft_logits_match_the_reference(any_target):
    """Three rows of different lengths, each caught up in two calls (the head's K/V of the first call read by the
    second), then a chained step over its own previous hidden state: logits and hidden_out within 1e-4 of the
    reference over the whole sequence of pairs; dense and MoE."""
    _, _, model, ref, _, head, _ = any_target
    sess = ort.InferenceSession(str(head / HEAD_GRAPH), providers=["CPUExecutionProvider"])
    rows = [[5, 9, 33, 7, 100, 3, 41, 8], [17, 2, 250], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71]]
    lm_head = model.get_output_embeddings()
    states = [_pairs(model, ids) for ids in rows]
    n = np.array([len(r) for r in rows])
    split = n - np.array([3, 1, 5])  # the first call's pairs per row
    b, width, h = len(rows), int(n.max()), 64
    cache = np.zeros((2, b, 2, MAX_SEQ, 32), np.float32)  # (key, value) [B, Hkv, max_seq, D]

    def call(first, count, embeds, hidden):
        p = max(1, int(first.max()))
        out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {
            "token_embeds": embeds, "hidden": hidden, "past_lengths": first, "past_starts": np.zeros(b, np.int64),
            "seq_lengths": count, "past_key.0": cache[0, :, :, :p], "past_value.0": cache[1, :, :, :p]})))
        for i in range(b):
            for c, name in enumerate(("new_key.0", "new_value.0")):
                cache[c, i, :, first[i] : first[i] + count[i]] = out[name][i, :, : count[i]]
        return out

    for lo, hi in ((np.zeros(b, np.int64), split), (split, n)):
        count = (hi - lo).astype(np.int64)
        embeds, hidden = np.zeros((b, int(count.max()), h), np.float32), np.zeros((b, int(count.max()), h), np.float32)
        for i, (hs, es, _) in enumerate(states):
            embeds[i, : count[i]] = es[lo[i] : hi[i]].numpy()
            hidden[i, : count[i]] = hs[lo[i] : hi[i]].numpy()
        out = call(lo.astype(np.int64), count, embeds, hidden)
    assert width == 12
    chained = []
    with torch.no_grad():
        for i, (hs, es, _) in enumerate(states):
            y = ref(es[None], hs[None])  # [1, n, h]
            want = lm_head(y[0, -1]).numpy()
            np.testing.assert_allclose(out["logits"][i], want, atol=TOL)
            np.testing.assert_allclose(out["hidden_out"][i], y[0, -1].numpy(), atol=TOL)
            d1 = int(want.argmax())
            assert out["next_token"][i] == d1
            e2 = model.get_input_embeddings()(torch.tensor([d1]))
            y2 = ref(torch.cat([es, e2])[None], torch.cat([hs, y[0, -1:]])[None])  # the pair (h', d1) at n
            chained.append((e2[0].numpy(), lm_head(y2[0, -1]).numpy()))
    out2 = call(n.astype(np.int64), np.ones(b, np.int64), np.stack([e for e, _ in chained])[:, None],
                out["hidden_out"][:, None])
    for i, (_, want) in enumerate(chained):
        np.testing.assert_allclose(out2["logits"][i], want, atol=TOL)


def test_the_head_refuses_what_it_cannot_draft_for(target, tmp_path):
    root, src, _, _, art, _, _ = target
    plain = tmp_path / "plain"
    export_model(src, plain, max_seq=MAX_SEQ, max_batch=2, progress=False)
    with pytest.raises(DecodertError, match="export the target again with --hidden-states"):
        export_head(src, tmp_path / "h", plain)
    bare = make_tiny_checkpoint("qwen3_5", tmp_path / "bare", seed=4)
    with pytest.raises(DecodertError, match="carries no MTP layers"):
        export_head(bare, tmp_path / "h2", art)
    add_mtp_layers(bare)  # another checkpoint's MTP layers beside this target
    with pytest.raises(DecodertError, match="its embedding is not"):
        export_head(bare, tmp_path / "h3", art)


def test_the_targets_hidden_state_is_what_the_head_reads(target):
    """The target's verify graph, and its prefill graph for every prompt position (prompt_hidden), return
    transformers' hidden_states[-1] (after the final norm), the h of the pairs."""
    _, _, model, _, art, _, _ = target
    ids = np.array([[5, 9, 33, 7, 100, 3, 41]], np.int64)
    sess = ort.InferenceSession(str(art / "verify.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": ids, "past_lengths": np.zeros(1, np.int64)}
    for t in sess.get_inputs():
        if t.name.startswith("past_") and t.name != "past_lengths":
            feeds[t.name] = np.zeros([1 if s == "batch" else s for s in t.shape], np.float32)
    out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    want = _pairs(model, ids[0].tolist())[0].numpy()
    np.testing.assert_allclose(out["seq_hidden"][0], want, atol=TOL)
    # the prefill graph's prompt_hidden: every prompt position's (the MTP head's catch-up covers the prompt)
    sess = ort.InferenceSession(str(art / "prefill.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": ids, "past_lengths": np.zeros(1, np.int64), "seq_lengths": np.array([7], np.int64)}
    for t in sess.get_inputs():
        if t.name.startswith("past_") and t.name != "past_lengths":
            feeds[t.name] = np.zeros([1 if s == "batch" else s for s in t.shape], np.float32)
    out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    np.testing.assert_allclose(out["prompt_hidden"][0], want, atol=TOL)
    np.testing.assert_allclose(out["hidden_state"][0], want[-1], atol=TOL)


# ---- drafting: LLM.load(target, draft=HEAD), speculative="mtp" --------------------------------------------------


@pytest.fixture(scope="module")
def drafting(target):
    from decodert.runtime.llm import LLM

    _, _, _, _, art, head, _ = target
    llm = LLM.load(art, backend="ort", draft=head, prefix_cache_mb=0)
    plain = [llm.generate(p, max_new_tokens=20).token_ids for p in PROMPTS]
    return llm, plain


def test_greedy_mtp_is_plain_decoding_batch_1_and_4(drafting):
    llm, plain = drafting
    greedy_drafting_is_plain(llm, plain, "mtp", refused="assistant")


def _reference_chain(model, ref, history: list[int], start: int, k: int):
    """The reference's k greedy drafts for a row whose target holds history[:-1], the head's run starting at
    ``start``: pairs start..L-1 from the target's hidden states, then each draft's pair (its own output, the
    draft) -> (drafts, the K/V [H_kv, n, D] of every pair but the last draft's: the entries the head wrote)."""
    hs, _, _ = _pairs(model, history[:-1])
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    length = len(history) - 1
    es = embed(torch.tensor(history[start + 1 :]))
    hs = hs[start:length]
    out = []
    with torch.no_grad():
        for _ in range(k):
            y = ref(es[None], hs[None], first=start)[0]
            token = int(lm_head(y[-1]).argmax())
            out.append(token)
            es, hs = torch.cat([es, embed(torch.tensor([token]))]), torch.cat([hs, y[-1:]])
        layer = ref.layers[0].self_attn
        x = ref.fc(torch.cat([ref.pre_fc_norm_embedding(es[:-1]), ref.pre_fc_norm_hidden(hs[:-1])], -1))[None]
        a = ref.layers[0].input_layernorm(x)
        keys = layer.k_norm(layer.k_proj(a).view(1, -1, 2, 32)).transpose(1, 2)
        values = layer.v_proj(a).view(1, -1, 2, 32).transpose(1, 2)
        cos, sin = ref.rotary(x, torch.arange(start, start + x.shape[1])[None])
        _, keys = q35.apply_rotary_pos_emb(keys, keys, cos, sin)
    return out, keys[0].numpy(), values[0].numpy()


def test_the_head_drafts_what_the_reference_drafts_and_keeps_its_rule(drafting, target):
    """Every proposal of a speculative generation: the drafter's tokens are the reference's chain from the run of
    entries the head held for the row; after it, the head's cache holds the target's pairs of that run (the
    reference layer's K/V) as kept entries, no more than the target's positions, computed from the row's own
    tokens, and the drafted pairs' K/V after them as scratch."""
    from decodert.runtime.speculation.speculative import SpeculativeConfig

    llm, _ = drafting
    _, _, model, ref, _, _, _ = target
    with proposals(llm.engine.speculator.drafter(SpeculativeConfig("mtp"))) as seen:  # one row: one entry a proposal
        llm.generate(PROMPTS[0], max_new_tokens=14, speculative=SpeculativeConfig("mtp", draft_len=3, adaptive=False))
    assert len(seen) >= 4 and any(start < length - 1 for _, _, start, length, *_ in seen)  # runs longer than 1
    assert sum(len(d) == 3 for _, d, *_ in seen) >= 3
    for history, draft, start, length, target_length, keys, values, tokens in seen:
        want, want_k, want_v = _reference_chain(model, ref, history, start, len(draft))
        assert draft == want and len(draft) >= 1
        assert length == target_length and tokens.tolist() == history[: length + 1]
        end = start + want_k.shape[1]  # the kept entries [start, length), then the drafted steps' scratch
        np.testing.assert_allclose(keys[:, start:end], want_k, atol=TOL)
        np.testing.assert_allclose(values[:, start:end], want_v, atol=TOL)


def test_the_head_cache_rule():
    """HeadCache.kept: a row keeps the entries whose tokens (0..p+1) its history still begins with, below the
    target's length, inside its run; a rewind under the run's start empties it."""
    from decodert.runtime.speculation.mtp import HeadCache

    c = HeadCache(2, 1, 16, 4, np.float32)
    history = np.arange(10, 20)
    c.restart(0, 2)
    c.settle(0, 7, history)  # entries 2..6, from tokens 0..7
    assert c.kept(0, history, 9) == 7
    assert c.kept(0, history, 5) == 5  # the target rewound (a rejected draft, a reused slot)
    c.settle(0, 7, history)
    other = history.copy()
    other[6] = 99  # the history differs from token 6 on: entries up to 4 (tokens 0..5) stay
    assert c.kept(0, other, 9) == 5
    c.settle(0, 7, history)
    other[3] = 99  # differs before the run's start: nothing kept, the run starts again
    assert c.kept(0, other, 9) == 2 and c.starts[0] == 2
    assert c.kept(1, history, 9) == 0  # a slot never written


def test_sessions_and_prefix_hits_stay_exact(drafting, target):
    llm, _ = drafting
    _, _, _, _, art, head, _ = target
    sessions_and_prefix_hits_stay_exact(llm, art, head, "mtp")


def test_cli_exports_the_mtp_head_and_runs_it(target, tmp_path, capsys):
    """`decodert export TARGET_FOLDER --target-artifact T` writes the MTP head; `decodert run T --draft HEAD` drafts
    with it (implies --speculative mtp); another method with it is refused in one line."""
    from decodert.cli import main

    _, src, _, _, art, _, _ = target
    assert main(["export", str(src), "--target-artifact", str(art), "-o", str(tmp_path / "h")]) == 0
    assert "exported qwen3_5_mtp head" in capsys.readouterr().out
    assert main(["run", str(art), "--backend", "ort", "--draft", str(tmp_path / "h"), "--prompt", "hello",
                 "--max-new-tokens", "4"]) == 0
    capsys.readouterr()
    assert main(["run", str(art), "--backend", "ort", "--draft", str(tmp_path / "h"), "--speculative", "assistant",
                 "--prompt", "hello"]) == 2
    assert "use --speculative mtp" in capsys.readouterr().err
    assert main(["run", str(art), "--backend", "ort", "--speculative", "mtp", "--prompt", "hello"]) == 2
    assert "needs --draft HEAD" in capsys.readouterr().err


def test_the_head_keeps_its_run_across_plain_steps_and_accepted_drafts(drafting, target):
    """Proposals that alternate between two right drafts and a wrong one (the hybrid target verifies them, then
    runs the two accepted tokens again from its snapshot) and nothing (a plain decode step): the head follows
    every pass, so its run of entries starts at the prompt's last position and never again, the tokens are plain
    decoding's, and at every proposal its kept entries are the reference's K/V of the target's pairs."""
    from decodert.runtime.speculation.speculative import SpeculativeConfig

    llm, plain = drafting
    _, _, model, ref, _, _, _ = target
    drafter = llm.engine.speculator.drafter(SpeculativeConfig("mtp"))
    got, seen = forced_drafts(llm, drafter, "mtp", PROMPTS[0], plain[0], vocab=512)
    assert got.token_ids == plain[0] and got.metrics.acceptance_rate > 0
    assert len(seen) >= 6 and {start for _, start, *_ in seen} == {0}  # the prompt's rows: prompt_hidden
    for history, start, length, keys, _ in seen:
        _, want_k, _ = _reference_chain(model, ref, history, start, 1)
        np.testing.assert_allclose(keys[:, start:length], want_k[:, : length - start], atol=TOL)


def test_the_head_follows_the_steps_it_does_not_draft_at(drafting, target):
    """The planner's own choice (adaptive): on a random head it soon decodes plainly, asking for no drafts; the head
    still follows every pass, so at the end its run holds the target's pairs from the prompt's last position on
    (the reference's K/V), and the tokens are plain decoding's."""
    from decodert.runtime.speculation.speculative import SpeculativeConfig

    llm, plain = drafting
    _, _, model, ref, _, _, _ = target
    adaptive = SpeculativeConfig("mtp")
    drafter = llm.engine.speculator.drafter(adaptive)
    counts = {"propose": 0, "follow": 0}
    propose, follow = drafter.propose, drafter.follow

    def counted(name, fn):
        def call(*args):
            counts[name] += 1
            return fn(*args)
        return call

    drafter.propose, drafter.follow = counted("propose", propose), counted("follow", follow)
    prompt = PROMPTS[1]
    try:
        got = llm.generate(prompt, max_new_tokens=20, speculative=adaptive)
    finally:
        drafter.propose, drafter.follow = propose, follow
    assert got.token_ids == plain[1]
    assert counts["propose"] < counts["follow"] - 3  # steps that drafted nothing
    c = drafter.cache
    start, length = int(c.starts[0]), int(c.lengths[0])
    assert start == 0 and length >= len(prompt) + 20 - 6
    history = prompt + got.token_ids
    _, want_k, _ = _reference_chain(model, ref, history[: length + 1], start, 1)
    np.testing.assert_allclose(c.keys[0][:, start:length], want_k[:, : length - start], atol=TOL)


@pytest.mark.slow  # ~20 s: 2400 generations
def test_speculative_sampling_keeps_the_targets_distribution(drafting, target):
    """1200 seeds, 3 tokens (the first from the prefill, the next two from one verify pass of 2 MTP drafts:
    accepted, or rejected and resampled, then the bonus token) against the exact joint distribution of the target
    (transformers' logits under the same top-k 3 / temperature transform), plain sampling as the control."""
    from distribution import assert_keeps_the_targets_distribution

    llm, _ = drafting
    _, _, model, _, _, _, _ = target
    assert_keeps_the_targets_distribution(llm, model, PROMPTS[1], "mtp", n=1200, temperature=1.0, top_k=3)


@pytest.mark.trt
def test_trt_builds_the_mtp_head(tmp_path):
    """TensorRT-RTX (on the CPU, as the other engines): the MTP head's graph for a trt-target fp16 export with
    --hidden-states parses and builds over its dynamic batch, pairs and past."""
    pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX not installed")
    from decodert.export import trt_build
    from decodert.plugins.trt.compat import load_trt

    src = make_tiny_checkpoint("qwen3_5", tmp_path / "target")
    add_mtp_layers(src)
    out = tmp_path / "trt"
    export_model(src, out, target="trt", dtype="fp16", max_seq=64, max_batch=2, progress=False, hidden_states=True)
    record = export_head(src, tmp_path / "head", out)
    assert record["dtype"] == "fp16"
    trt, _ = load_trt(need_builder=True)
    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    network, _parser = trt_build.parse_onnx(trt, builder, logger, tmp_path / "head" / HEAD_GRAPH)
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    sizes = {"batch": (1, 2, 2), "seq": (1, 4, 8), "past": (1, 32, 64)}
    for io in record["graph"]["inputs"]:
        def shape(i):
            return [sizes[s][i] if isinstance(s, str) else s for s in io["shape"]]
        profile.set_shape(io["name"], shape(0), shape(1), shape(2))
    config.add_optimization_profile(profile)
    assert builder.build_serialized_network(network, config) is not None


def test_an_fp16_target_and_its_head_stay_exact(target, tmp_path):
    """An fp16 export: the head is exported in the target's dtype (its embedding compared at fp16's precision) and
    its greedy speculative tokens are plain decoding's, batch 4."""
    _, src, _, _, _, _, _ = target
    fp16_head_stays_exact(src, src, tmp_path, "mtp", hidden_states=True)


def test_drafting_is_exact_and_the_references_dense_and_moe(any_target):
    """Dense and MoE targets with their heads: greedy speculative tokens are plain decoding's (batch 1 and 4), and
    every proposal's drafts are the reference's chain."""
    from decodert.runtime.llm import LLM
    from decodert.runtime.speculation.speculative import SpeculativeConfig

    _, _, model, ref, art, head, _ = any_target
    fixed = SpeculativeConfig("mtp", draft_len=3, adaptive=False)
    with LLM.load(art, backend="ort", draft=head, prefix_cache_mb=0) as llm:
        plain = [llm.generate(p, max_new_tokens=10).token_ids for p in PROMPTS]
        assert [r.token_ids for r in llm.generate(PROMPTS, max_new_tokens=10, speculative=fixed)] == plain
        drafter = llm.engine.speculator.drafter(fixed)
        seen, propose = [], drafter.propose

        def spy(seqs, limits):
            drafts, keys = propose(seqs, limits)
            slot = seqs[0].spec.at[1]
            seen.append((seqs[0].history[: seqs[0].length].tolist(), int(drafter.cache.starts[slot]), drafts[0].tolist()))
            return drafts, keys

        drafter.propose = spy
        assert llm.generate(PROMPTS[0], max_new_tokens=10, speculative=fixed).token_ids == plain[0]
    assert len(seen) >= 3
    for history, start, draft in seen:
        assert draft == _reference_chain(model, ref, history, start, len(draft))[0]


def test_a_quantized_mtp_head_is_close_to_the_float_one_and_stays_exact(any_target, tmp_path, capsys):
    """``--quant int8|int4`` on an MTP head (dense and MoE): its linears, the target's lm_head among them (the
    whole vocabulary: most of the head's bytes), as MatMulNBits; the router, the shared expert's gate row and
    the experts stay float. int8's logits within 2% of the float head's range; greedy drafting with the int4 head
    is still plain decoding."""
    from decodert.export.quantize.quant import QuantConfig
    import onnx

    _, src, _, _, art, head, _ = any_target
    want, want_hidden = catch_up_outputs(head)
    rec = export_head(src, tmp_path / "h8", art, quant=QuantConfig(bits=8, accuracy_level=0))
    assert rec["quant"]["bits"] == 8 and rec["quant"]["lm_head"] is True
    graph = onnx.load(str(tmp_path / "h8" / HEAD_GRAPH), load_external_data=False)
    quantized = {i.name[: -len(".q")] for i in graph.graph.initializer if i.name.endswith(".q")}
    dense = {"fc", "q", "k", "v", "o", "lm_head"}
    assert quantized == dense | ({"shared.gate", "shared.up", "shared.down"} if rec["spec"]["moe"] else {"gate", "up", "down"})
    assert sum(n.op_type == "MatMulNBits" for n in graph.graph.node) == 9
    got, hidden = catch_up_outputs(tmp_path / "h8")
    assert np.abs(got - want).max() < 0.02 * np.abs(want).max()
    assert np.abs(hidden - want_hidden).max() < 0.02 * np.abs(want_hidden).max()

    int4_head_stays_exact(src, art, tmp_path / "h4", "mtp", "assistant", capsys)
