"""EAGLE-3 draft heads (speculative="eagle3") on tiny random Llama-3 and Qwen3 targets, with tiny random heads written
in the published heads' layout (config.json with architectures LlamaForCausalLMEagle3 + model.safetensors: fc,
midlayer.*, norm, lm_head, d2t / t2d, embed_tokens where the head has its own), models/families/eagle3.py.

No transformers reference exists for an EAGLE-3 head (transformers has no such model), so ``Eagle3Reference`` below
is an independent torch one written from the layer definitions (as vLLM's and SGLang's Llama EAGLE-3 heads run
them): RMSNorms written out, the attention over the concatenated [normed embedding, normed fused hidden] with
transformers' LlamaRotaryEmbedding / apply_rotary_pos_emb for RoPE, the SwiGLU MLP, the pre-norm output fed back as
the next step's hidden state. It runs the whole sequence of pairs at once under a causal mask (no cache), so the
head's own K/V, written call by call, is checked by agreeing with it. The target's features are transformers'
``hidden_states[i]`` of the layers the head names (the input of layer i)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import transformers
from safetensors.torch import save_file
from transformers.models.llama import modeling_llama

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
VOCAB = 512
# two targets: a Llama-3 (llama3 rope scaling) of 8 layers, the default layers (2, 4, 5), a reduced draft vocabulary
# with d2t / t2d, the target's embedding; a Qwen3 of 4 layers whose head names layers [0, 2, 3] (0: the embedding),
# has an embedding of its own and the whole vocabulary (no d2t)
TARGETS = {
    "llama3": dict(family="llama3", layers=8, ids=None, draft_vocab=200, own_embed=False),
    "qwen3": dict(family="qwen3", layers=4, ids=[0, 2, 3], draft_vocab=VOCAB, own_embed=True),
}


class Norm(torch.nn.Module):
    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.ones(n)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Eagle3Reference(torch.nn.Module):
    """The head with the checkpoint's names: fc, midlayer.{input_layernorm, hidden_norm, self_attn.*,
    post_attention_layernorm, mlp.*}, norm, lm_head."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        h, th, eps = cfg["hidden_size"], cfg.get("target_hidden_size", cfg["hidden_size"]), cfg["rms_norm_eps"]
        self.heads, self.kv, self.d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.fc = lin(3 * th, h)
        self.midlayer = torch.nn.Module()
        m = self.midlayer
        m.input_layernorm, m.hidden_norm, m.post_attention_layernorm = Norm(h, eps), Norm(h, eps), Norm(h, eps)
        m.self_attn = torch.nn.Module()
        m.self_attn.q_proj, m.self_attn.k_proj = lin(2 * h, self.heads * self.d), lin(2 * h, self.kv * self.d)
        m.self_attn.v_proj, m.self_attn.o_proj = lin(2 * h, self.kv * self.d), lin(self.heads * self.d, h)
        m.mlp = torch.nn.Module()
        i = cfg["intermediate_size"]
        m.mlp.gate_proj, m.mlp.up_proj, m.mlp.down_proj = lin(h, i), lin(h, i), lin(i, h)
        self.norm = Norm(h, eps)
        self.lm_head = lin(h, cfg["draft_vocab_size"])
        rope = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "eagle_config")})
        self.rotary = modeling_llama.LlamaRotaryEmbedding(rope)

    def forward(self, embeds: torch.Tensor, x: torch.Tensor, first: int = 0):
        """Pairs [S, h]: the embedding of token p+1 and the fused hidden (fc(features) or the previous g) at
        positions first..first+S-1 -> (g [S, h], logits [S, draft_vocab], keys, values [Hkv, S, D])."""
        m, s = self.midlayer, embeds.shape[0]
        a = torch.cat([m.input_layernorm(embeds), m.hidden_norm(x)], -1)[None]  # [1, S, 2h]
        q = m.self_attn.q_proj(a).view(1, s, self.heads, self.d).transpose(1, 2)
        k = m.self_attn.k_proj(a).view(1, s, self.kv, self.d).transpose(1, 2)
        v = m.self_attn.v_proj(a).view(1, s, self.kv, self.d).transpose(1, 2)
        cos, sin = self.rotary(a, torch.arange(first, first + s)[None])
        q, k = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
        rep = self.heads // self.kv
        scores = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) / self.d ** 0.5
        scores = scores + torch.full((s, s), float("-inf")).triu(1)
        att = (scores.softmax(-1) @ v.repeat_interleave(rep, 1)).transpose(1, 2).reshape(s, -1)
        r = x + m.self_attn.o_proj(att)
        h = m.post_attention_layernorm(r)
        g = r + m.mlp.down_proj(torch.nn.functional.silu(m.mlp.gate_proj(h)) * m.mlp.up_proj(h))
        return g, self.lm_head(self.norm(g)), k[0], v[0]


def make_head(folder, tcfg: dict, draft_vocab: int, ids, own_embed: bool, seed: int = 5, **sizes):
    """A random EAGLE-3 head for a target of config ``tcfg`` written in the published layout into ``folder``
    (``sizes``: config fields to set); returns (the reference module, d2t as a tensor (zeros: the whole
    vocabulary), the head's own embedding or None)."""
    vocab = tcfg["vocab_size"]
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
           "hidden_size": tcfg["hidden_size"], "intermediate_size": 96, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
           "max_position_embeddings": 1024, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
           "rope_theta": 10000.0, "tie_word_embeddings": False, **sizes}
    if "rope_scaling" in tcfg:  # the Llama-3 target's llama3 scaling, as a head for it has
        cfg["rope_scaling"] = tcfg["rope_scaling"]
    if ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    torch.manual_seed(seed)
    ref = Eagle3Reference(cfg).eval()
    _randomise(ref, seed)
    tensors = {k: v.detach().clone() for k, v in ref.state_dict().items() if not k.startswith("rotary")}
    gen = torch.Generator().manual_seed(seed)
    if draft_vocab < vocab:  # a random subset of the target's ids, sorted
        keep = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
        d2t = keep - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[keep] = True
        tensors["d2t"], tensors["t2d"] = d2t, t2d
    else:
        d2t = torch.zeros(draft_vocab, dtype=torch.int64)
    embed = None
    if own_embed:
        embed = 0.05 * torch.randn(vocab, tcfg["hidden_size"], generator=gen)
        tensors["embed_tokens.weight"] = embed
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return ref, d2t, embed


class Case:
    """A target checkpoint, its transformers model, its artifact with the head's features, the head folder, its
    reference and its exported artifact."""

    def __init__(self, root, name: str) -> None:
        t = TARGETS[name]
        self.name = name
        self.src = make_tiny_checkpoint(t["family"], root / "target", num_hidden_layers=t["layers"])
        self.model = transformers.AutoModelForCausalLM.from_pretrained(self.src, dtype=torch.float32).eval()
        n = t["layers"]
        self.ids = t["ids"] or [2, n // 2, n - 3]
        self.art = root / "target-art"
        export_model(self.src, self.art, max_seq=MAX_SEQ, max_batch=4, progress=False,
                     hidden_layers="eagle3" if t["ids"] is None else t["ids"])
        self.head_src = root / "head-src"
        tcfg = json.loads((self.src / "config.json").read_text())
        self.ref, self.d2t, own = make_head(self.head_src, tcfg, t["draft_vocab"], t["ids"], t["own_embed"])
        self.embed = torch.nn.Embedding.from_pretrained(own) if own is not None else self.model.get_input_embeddings()
        self.head = root / "head"
        self.record = export_head(self.head_src, self.head, self.art)

    def features(self, ids: list[int]) -> torch.Tensor:
        """[n, 3 hidden]: transformers' hidden_states[i] of the head's layers, concatenated."""
        with torch.no_grad():
            hs = self.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        return torch.cat([hs[i][0] for i in self.ids], -1)

    def target_token(self, draft_logits: torch.Tensor) -> int:
        best = int(draft_logits.argmax())
        return best + int(self.d2t[best])

    def chain(self, history: list[int], start: int, k: int):
        """The reference's k greedy drafts for a row whose target holds history[:-1], the head's run starting at
        ``start``: pairs start..L-1 from the target's features, then each draft's pair (its own g, the draft) ->
        (drafts, the K/V [H_kv, n, D] of every pair but the last draft's: the entries the head wrote)."""
        length = len(history) - 1
        with torch.no_grad():
            xs = self.ref.fc(self.features(history[:-1])[start:length])
            es = self.embed(torch.tensor(history[start + 1 :]))
            out = []
            for _ in range(k):
                g, logits, _, _ = self.ref(es, xs, start)
                token = self.target_token(logits[-1])
                out.append(token)
                es, xs = torch.cat([es, self.embed(torch.tensor([token]))]), torch.cat([xs, g[-1:]])
            _, _, keys, values = self.ref(es[:-1], xs[:-1], start)
        return out, keys.numpy(), values.numpy()


@pytest.fixture(scope="module", params=list(TARGETS))
def case(request, tmp_path_factory):
    return Case(tmp_path_factory.mktemp(f"eagle3-{request.param}"), request.param)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return Case(tmp_path_factory.mktemp("eagle3-llama3-only"), "llama3")


def test_the_head_record_and_what_it_reads(case):
    r = case.record
    assert r["family"] == "eagle3" and r["reads"]["hidden_layers"] == case.ids
    assert r["target"]["weights_sha256"] == load_manifest(case.art).files["weights.bin"].sha256
    assert load_manifest(case.art).hidden_layers == tuple(case.ids)
    assert r["embedding"] == ("embed.npy" if case.name == "qwen3" else "target")
    assert load_head(case.head, load_manifest(case.art))["cache"] == {"layers": 1, "num_kv_heads": 2, "head_dim": 16}


def test_the_targets_features_are_its_layer_inputs(case):
    """prefill (hidden_state, prompt_hidden) and verify (seq_hidden) return transformers' hidden_states[i] of the
    head's layers, concatenated low, mid, high."""
    ids = np.array([[5, 9, 33, 7, 100, 3, 41]], np.int64)
    want = case.features(ids[0].tolist()).numpy()
    for graph in ("prefill", "verify"):
        sess = ort.InferenceSession(str(case.art / f"{graph}.onnx"), providers=["CPUExecutionProvider"])
        feeds = {"input_ids": ids, "past_lengths": np.zeros(1, np.int64)}
        if graph == "prefill":
            feeds["seq_lengths"] = np.array([7], np.int64)
        for t in sess.get_inputs():
            if t.name.startswith("past_") and t.name != "past_lengths":
                feeds[t.name] = np.zeros([1 if s == "batch" else s for s in t.shape], np.float32)
        out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        if graph == "prefill":
            np.testing.assert_allclose(out["prompt_hidden"][0], want, atol=TOL)
            np.testing.assert_allclose(out["hidden_state"][0], want[-1], atol=TOL)
        else:
            np.testing.assert_allclose(out["seq_hidden"][0], want, atol=TOL)


def test_draft_logits_match_the_reference(case):
    """Three rows of different lengths, each caught up in two calls (the head's K/V of the first call read by the
    second), then a chained step over its own pre-norm output: draft logits and hidden_out within 1e-4 of the
    reference over the whole sequence of pairs, next_token the target's id (d2t)."""
    sess = ort.InferenceSession(str(case.head / HEAD_GRAPH), providers=["CPUExecutionProvider"])
    rows = [[5, 9, 33, 7, 100, 3, 41, 8], [17, 2, 250], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71]]
    feats = [case.features(r) for r in rows]
    with torch.no_grad():
        embeds_all = [case.embed(torch.tensor(r[1:] + [r[0]])) for r in rows]  # the token after each position
    n = np.array([len(r) for r in rows])
    split = n - np.array([3, 1, 5])
    b, h = len(rows), 64
    cache = np.zeros((2, b, 2, MAX_SEQ, 16), np.float32)

    def call(first, count, embeds, features, hidden):
        p = max(1, int(first.max()))
        out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {
            "token_embeds": embeds, "features": features, "hidden": hidden, "past_lengths": first,
            "past_starts": np.zeros(b, np.int64), "seq_lengths": count,
            "past_key.0": cache[0, :, :, :p], "past_value.0": cache[1, :, :, :p]})))
        for i in range(b):
            for c, name in enumerate(("new_key.0", "new_value.0")):
                cache[c, i, :, first[i] : first[i] + count[i]] = out[name][i, :, : count[i]]
        return out

    for lo, hi in ((np.zeros(b, np.int64), split), (split, n)):
        count = (hi - lo).astype(np.int64)
        w = int(count.max())
        embeds, features = np.zeros((b, w, h), np.float32), np.zeros((b, w, 3 * h), np.float32)
        for i in range(b):
            embeds[i, : count[i]] = embeds_all[i][lo[i] : hi[i]].numpy()
            features[i, : count[i]] = feats[i][lo[i] : hi[i]].numpy()
        out = call(lo.astype(np.int64), count, embeds, features, np.zeros((b, w, h), np.float32))
    chained = []
    with torch.no_grad():
        for i in range(b):
            g, logits, _, _ = case.ref(embeds_all[i], case.ref.fc(feats[i]))
            np.testing.assert_allclose(out["logits"][i], logits[-1].numpy(), atol=TOL)
            np.testing.assert_allclose(out["hidden_out"][i], g[-1].numpy(), atol=TOL)
            d1 = case.target_token(logits[-1])
            assert out["next_token"][i] == d1
            e2 = case.embed(torch.tensor([d1]))
            _, logits2, _, _ = case.ref(torch.cat([embeds_all[i], e2]), torch.cat([case.ref.fc(feats[i]), g[-1:]]))
            chained.append((e2[0].numpy(), logits2[-1].numpy(), case.target_token(logits2[-1])))
    out2 = call(n.astype(np.int64), np.ones(b, np.int64), np.stack([e for e, *_ in chained])[:, None],
                np.zeros((b, 1, 3 * h), np.float32), out["hidden_out"][:, None])
    for i, (_, want, token) in enumerate(chained):
        np.testing.assert_allclose(out2["logits"][i], want, atol=TOL)
        assert out2["next_token"][i] == token
    if case.name == "llama3":  # the draft vocabulary is a subset: the ids are the target's, not the draft's
        assert any(int(case.d2t[int(o)]) != 0 for o in out["logits"].argmax(-1))


def test_the_head_refuses_what_it_cannot_draft_for(llama, tmp_path):
    plain = tmp_path / "plain"
    export_model(llama.src, plain, max_seq=MAX_SEQ, max_batch=2, progress=False, hidden_states=True)
    with pytest.raises(DecodertError, match="export the target again with --hidden-layers 2,4,5"):
        export_head(llama.head_src, tmp_path / "h", plain)
    other = tmp_path / "other"
    export_model(llama.src, other, max_seq=MAX_SEQ, max_batch=2, progress=False, hidden_layers=[1, 2, 3])
    with pytest.raises(DecodertError, match=r"reads the inputs of the target's layers \[2, 4, 5\]"):
        export_head(llama.head_src, tmp_path / "h", other)
    with pytest.raises(DecodertError, match="layer indices of the model's 8 layers"):
        export_model(llama.src, tmp_path / "bad", max_seq=MAX_SEQ, hidden_layers=[1, 9, 3], progress=False)
    bad = tmp_path / "bad-head"
    make_head(bad, json.loads((llama.src / "config.json").read_text()), 200, None, False)
    raw = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**raw, "draft_vocab_size": 100}))
    with pytest.raises(DecodertError, match=r"lm_head.weight is \[200, 64\], the config says \[100, 64\]"):
        export_head(bad, tmp_path / "h", llama.art)
    # a head record that reads other layers than the target's graphs return, refused at load
    record = json.loads((llama.head / "head.json").read_text())
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "head.json").write_text(json.dumps({**record, "reads": {**record["reads"], "hidden_layers": [1, 2, 3]}}))
    with pytest.raises(DecodertError, match=r"the head reads the inputs of layers \[1, 2, 3\]"):
        load_head(wrong, load_manifest(llama.art))


# ---- drafting: LLM.load(target, draft=HEAD), speculative="eagle3" ------------------------------------------------


@pytest.fixture(scope="module")
def drafting(case):
    from decodert.runtime.llm import LLM

    llm = LLM.load(case.art, backend="ort", draft=case.head, prefix_cache_mb=0)
    plain = [llm.generate(p, max_new_tokens=20).token_ids for p in PROMPTS]
    yield llm, plain
    llm.close()


def test_greedy_eagle3_is_plain_decoding_batch_1_and_4(drafting):
    llm, plain = drafting
    greedy_drafting_is_plain(llm, plain, "eagle3", refused="mtp")


def test_the_head_drafts_what_the_reference_drafts(drafting, case):
    """Every proposal of a speculative generation, batch 1 and 4: the drafter's tokens are the reference's chain
    from the run of entries the head held for the row, and its cache then holds the reference's K/V of the
    target's pairs of that run (kept entries, no more than the target's positions, computed from the row's own
    tokens) and of the drafted pairs after them (scratch)."""
    from decodert.runtime.speculation.speculative import SpeculativeConfig

    llm, _ = drafting
    fixed = SpeculativeConfig("eagle3", draft_len=3, adaptive=False)
    with proposals(llm.engine.speculator.drafter(fixed)) as seen:
        llm.generate(PROMPTS[0], max_new_tokens=12, speculative=fixed)
        llm.generate(PROMPTS, max_new_tokens=6, speculative=fixed)
    assert sum(len(d) == 3 for _, d, *_ in seen) >= 6
    for history, draft, start, length, target_length, keys, values, tokens in seen:
        if not len(draft):
            continue
        want, want_k, want_v = case.chain(history, start, len(draft))
        assert draft == want
        assert length == target_length and tokens.tolist() == history[: length + 1]
        end = start + want_k.shape[1]
        np.testing.assert_allclose(keys[:, start:end], want_k, atol=TOL)
        np.testing.assert_allclose(values[:, start:end], want_v, atol=TOL)


def test_the_head_rewinds_its_kv_under_rejected_drafts(drafting, case):
    """Proposals forced to two right drafts and a wrong one every other step (the verify keeps two and rejects the
    third; the target and the head's K/V rewind), plain steps between: the tokens are plain decoding's, the head's
    run starts at the prompt and never again, and at every proposal its kept entries are the reference's K/V of
    the row's accepted history (the rejected draft's entry was not kept)."""
    from decodert.runtime.speculation.speculative import SpeculativeConfig

    llm, plain = drafting
    drafter = llm.engine.speculator.drafter(SpeculativeConfig("eagle3"))
    got, seen = forced_drafts(llm, drafter, "eagle3", PROMPTS[0], plain[0], VOCAB)
    assert got.token_ids == plain[0] and 0 < got.metrics.acceptance_rate < 1
    assert len(seen) >= 6 and {start for _, start, *_ in seen} == {0}
    for history, start, length, keys, values in seen:
        assert length == len(history) - 1  # every position but the pending token's: nothing stale kept
        _, want_k, want_v = case.chain(history, start, 1)
        np.testing.assert_allclose(keys[:, start:length], want_k[:, : length - start], atol=TOL)
        np.testing.assert_allclose(values[:, start:length], want_v[:, : length - start], atol=TOL)


def test_plain_steps_judge_the_heads_first_draft_and_proposals_reuse_the_catch_up(drafting, monkeypatch):
    """The head follows every pass, so at a plain step it has already run the pair that drafts the next token: that
    draft is judged in hindsight once the step settles the token (a head whose first verified drafts were unlucky
    is drafted again when it turns out right: before, the planner gave up on the trained SmolLM2 head for good), and
    a proposal in the same step starts from that catch-up instead of running the pair again (k = 1: no head call
    beyond the follow's)."""
    from decodert.runtime.speculation import speculative
    from decodert.runtime.speculation.speculative import SpeculativeConfig

    llm, plain = drafting
    drafter = llm.engine.speculator.drafter(SpeculativeConfig("eagle3"))
    calls = {"run": 0, "follow": 0}
    run, follow = drafter.session.run, drafter.follow

    def counted_run(*a, **k):
        calls["run"] += 1
        return run(*a, **k)

    def counted_follow(seqs):
        before = calls["run"]
        got = follow(seqs)
        calls["follow"] += calls["run"] - before
        return got

    monkeypatch.setattr(drafter.session, "run", counted_run)
    monkeypatch.setattr(drafter, "follow", counted_follow)
    one = SpeculativeConfig("eagle3", draft_len=1, adaptive=False)
    assert llm.generate(PROMPTS[0], max_new_tokens=20, speculative=one).token_ids == plain[0]
    assert calls["follow"] >= 5 and calls["run"] == calls["follow"]

    seen = llm.engine.speculator.seen
    before = seen.get((id(drafter), 1), (0.0, 0.0))[1]
    calibration = llm.engine.speculator.calibration(drafter)
    counted = calibration.seen.sum()
    monkeypatch.setattr(speculative, "plan", lambda *a, **k: (1, 0.0))  # plain steps only: nothing is verified
    assert llm.generate(PROMPTS[1], max_new_tokens=12, speculative="eagle3").token_ids == plain[1][:12]
    judged = seen[(id(drafter), 1)][1] - before * (1 - 0.02 * speculative.HINDSIGHT) ** 11
    assert judged > 8 * speculative.HINDSIGHT * 0.9  # ~one hindsight judgement per plain step after the first
    # and each judged draft's probability taught the calibration whether drafts that sure are accepted
    assert calibration.seen.sum() - counted * calibration.KEEP ** 11 > 8 * 0.9


def test_the_chain_ends_where_the_heads_confidence_says_and_stays_exact(drafting, monkeypatch):
    """``propose(keep=...)``: the head reports its probability of each draft (the softmax maximum of its logits)
    and stops calling once no row's next draft is worth it; adaptive decoding cuts chains by the calibrated
    probability and still gives plain decoding's tokens."""
    from decodert.runtime.decoding.sampling import top_probability
    from decodert.runtime.speculation.speculative import SpeculativeConfig

    llm, plain = drafting
    drafter = llm.engine.speculator.drafter(SpeculativeConfig("eagle3"))
    calls, logits = [], []
    run = drafter.session.run

    def counted_run(*a, **k):
        out = run(*a, **k)
        calls.append(1)
        logits.append(out[0])
        return out

    monkeypatch.setattr(drafter.session, "run", counted_run)
    seen: list = []
    propose = drafter.propose

    def one_only(seqs, limits, keep=None):  # the first draft only, whatever the limits
        got = propose(seqs, limits, keep=lambda probs: len(probs) < 2)
        seen.append((list(limits), [len(d) for d in got[0]], [c.copy() for c in drafter.confidences], len(calls)))
        return got

    monkeypatch.setattr(drafter, "propose", one_only)
    three = SpeculativeConfig("eagle3", draft_len=3, adaptive=False)
    assert llm.generate(PROMPTS[0], max_new_tokens=16, speculative=three).token_ids == plain[0][:16]
    assert seen and all(lengths == [1] for _, lengths, _, _ in seen)
    assert all(len(c[0]) == 1 and 0 < c[0][0] <= 1 for _, _, c, _ in seen)
    # the probability is the softmax maximum of the logits of the call that drafted it (the follow's: no chained call)
    last = seen[-1]
    assert np.isclose(last[2][0][0], top_probability(logits[last[3] - 1])[0])

    def none_kept(seqs, limits, keep=None):
        return propose(seqs, limits, keep=lambda probs: False)

    monkeypatch.setattr(drafter, "propose", none_kept)
    before, calibration = len(calls), llm.engine.speculator.calibration(drafter)
    counted = calibration.seen.sum()
    got = llm.generate(PROMPTS[1], max_new_tokens=12, speculative=three)
    assert got.token_ids == plain[1][:12]
    follows = len(calls) - before  # every call was a follow: nothing chained, and no draft verified
    assert got.metrics.acceptance_rate == 0.0 and follows <= 12
    # the first drafts nobody verified are judged in hindsight all the same
    assert calibration.seen.sum() - counted * calibration.KEEP ** 11 > 8 * 0.9

    monkeypatch.setattr(drafter, "propose", propose)
    for prompt, want in zip(PROMPTS, plain):  # the real rule: calibrated chance against the cost floor
        assert llm.generate(prompt, max_new_tokens=len(want), speculative="eagle3").token_ids == want


def test_sessions_and_prefix_hits_stay_exact(drafting, case):
    llm, _ = drafting
    sessions_and_prefix_hits_stay_exact(llm, case.art, case.head, "eagle3")


def test_cli_exports_the_head_and_runs_it(llama, tmp_path, capsys):
    """`decodert export --hidden-layers eagle3`, then `decodert export HEAD --target-artifact T`; `decodert run T
    --draft HEAD` drafts with it (implies --speculative eagle3); another method with it is refused in one line."""
    from decodert.cli import main

    art = tmp_path / "t"
    assert main(["export", str(llama.src), "-o", str(art), "--hidden-layers", "eagle3", "--max-seq", "64"]) == 0
    assert main(["export", str(llama.head_src), "--target-artifact", str(art), "-o", str(tmp_path / "h")]) == 0
    assert "eagle3" in capsys.readouterr().out
    assert main(["run", str(art), "--backend", "ort", "--draft", str(tmp_path / "h"), "--prompt", "hello",
                 "--max-new-tokens", "4"]) == 0
    capsys.readouterr()
    assert main(["run", str(art), "--backend", "ort", "--draft", str(tmp_path / "h"), "--speculative", "mtp",
                 "--prompt", "hello"]) == 2
    assert "use --speculative eagle3" in capsys.readouterr().err
    assert main(["export", str(llama.src), "-o", str(tmp_path / "x"), "--hidden-layers", "2,x"]) == 2
    assert "--hidden-layers must be 'eagle3' or layer indices" in capsys.readouterr().err


@pytest.mark.slow  # ~100 s a target: 2400 generations
def test_speculative_sampling_keeps_the_targets_distribution(drafting, case):
    """1200 seeds, 3 tokens (the first from the prefill, the next two from one verify pass of 2 EAGLE-3 drafts:
    accepted, or rejected and resampled, then the bonus token) against the exact joint distribution of the target
    (transformers' logits, top-k 3), plain sampling as the control. A random head's drafts are seldom among the
    target's top 3, so they would only ever be rejected: half of the first drafts (a seeded choice) are the target's
    greedy token instead, so that passes accept, and reject and resample, with the head following both."""
    from distribution import assert_keeps_the_targets_distribution

    from decodert.runtime.speculation.speculative import SpeculativeConfig

    llm, _ = drafting
    drafter = llm.engine.speculator.drafter(SpeculativeConfig("eagle3"))
    propose, rng, best = drafter.propose, np.random.default_rng(11), {}

    def mixed(seqs, limits):
        drafts, keys = propose(seqs, limits)
        for seq, draft in zip(seqs, drafts):
            history = tuple(seq.history[: seq.length].tolist())
            if len(draft) and rng.random() < 0.5:
                if history not in best:
                    with torch.no_grad():
                        best[history] = int(case.model(torch.tensor([history])).logits[0, -1].argmax())
                draft[0] = best[history]
        return drafts, keys

    drafter.propose = mixed
    try:
        assert_keeps_the_targets_distribution(llm, case.model, PROMPTS[1], "eagle3", n=1200, temperature=1.0, top_k=3)
    finally:
        drafter.propose = propose


def test_an_fp16_target_and_its_head_stay_exact(llama, tmp_path):
    fp16_head_stays_exact(llama.src, llama.head_src, tmp_path, "eagle3", hidden_layers="eagle3")


def test_a_quantized_head_is_close_to_the_float_one_and_stays_exact(llama, tmp_path, capsys):
    """``--quant int8|int4`` on a head export: its linears as MatMulNBits (a drafted token reads a quarter / an
    eighth of the bytes), recorded in head.json; int8's logits within 2% of the float head's range, and greedy
    drafting with the int4 head is still plain decoding (the target verifies every draft). A quantized head for a
    trt target, and the GGUF-only options, are refused in one line."""
    from decodert.cli import main
    from decodert.export.quantize.quant import QuantConfig

    want, want_hidden = catch_up_outputs(llama.head)
    rec = export_head(llama.head_src, tmp_path / "h8", llama.art, quant=QuantConfig(bits=8, accuracy_level=0))
    assert rec["quant"]["bits"] == 8
    graph = onnx.load(str(tmp_path / "h8" / HEAD_GRAPH), load_external_data=False)
    ops = [n.op_type for n in graph.graph.node]
    assert ops.count("MatMulNBits") == 9 and "MatMul" in ops  # the nine linears; attention's products stay float
    got, hidden = catch_up_outputs(tmp_path / "h8")
    assert np.abs(got - want).max() < 0.02 * np.abs(want).max()
    assert np.abs(hidden - want_hidden).max() < 0.02 * np.abs(want_hidden).max()

    assert "int4 linears" in int4_head_stays_exact(llama.head_src, llama.art, tmp_path / "h4", "eagle3", "mtp", capsys, 20)
    assert main(["export", str(llama.head_src), "--target-artifact", str(llama.art), "-o", str(tmp_path / "hq"),
                 "--quant", "int4", "--keep-q8"]) == 2
    assert "--keep-q8 / --keep-q4-1 are for GGUF targets" in capsys.readouterr().err
    fp16 = tmp_path / "t16"
    export_model(llama.src, fp16, target="trt", dtype="fp16", max_seq=64, max_batch=2, progress=False,
                 hidden_layers="eagle3")
    with pytest.raises(DecodertError, match="a quantized head runs on the ort target only"):
        export_head(llama.head_src, tmp_path / "ht", fp16, quant=QuantConfig(bits=4))


@pytest.mark.trt
def test_trt_builds_the_feature_graphs_and_the_head(llama, tmp_path):
    """TensorRT-RTX (on the CPU, as the other engines): a trt-target fp16 export with --hidden-layers eagle3 builds
    every engine with its feature outputs, and the head's graph parses and builds over its dynamic batch, pairs and
    past."""
    pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX not installed")
    from decodert.export import trt_build
    from decodert.plugins.trt.compat import load_trt

    out = tmp_path / "trt"
    export_model(llama.src, out, target="trt", dtype="fp16", max_seq=64, max_batch=2, progress=False,
                 hidden_layers="eagle3")
    engines = trt_build.build_engines(out, progress=False)
    for graph, name in (("prefill", "hidden_state"), ("prefill", "prompt_hidden"), ("verify", "seq_hidden")):
        io = {t["name"]: t for t in engines[graph].io["outputs"]}
        assert name in io and list(io[name]["shape"])[-1] in (192, "192")
    record = export_head(llama.head_src, tmp_path / "head", out)
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


@pytest.mark.slow  # ~1 min: SmolLM2's export
def test_a_smollm2_head_in_the_published_layout(smollm2_gguf, tmp_path):
    """SmolLM2-135M (a llama target of 30 layers, hidden 576, tied embeddings) and a random head in the layout the
    bench trainer writes (config.json of model_type llama with eagle_config's layer ids [2, 15, 27], a 4096-token
    draft vocabulary with d2t / t2d, no embed_tokens): the target exports with --hidden-layers eagle3, the head for
    it reads the target's embedding, and greedy speculative decoding is plain decoding's at batch 1 and 2."""
    from decodert.runtime.llm import LLM
    from decodert.runtime.speculation.speculative import SpeculativeConfig

    art = tmp_path / "smol"
    export_model(smollm2_gguf, art, max_seq=256, max_batch=2, progress=False, hidden_layers="eagle3")
    spec = load_manifest(art).model.spec()
    assert (spec.num_layers, spec.hidden_size, spec.tie_word_embeddings) == (30, 576, True)
    tcfg = {"hidden_size": spec.hidden_size, "vocab_size": spec.vocab_size}
    make_head(tmp_path / "head-src", tcfg, 4096, [2, 15, 27], False, num_attention_heads=9, num_key_value_heads=3,
              head_dim=64, intermediate_size=1536, rope_theta=100000.0,
              eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 15, 27], "use_aux_hidden_state": True})
    record = export_head(tmp_path / "head-src", tmp_path / "head", art)
    assert record["reads"]["hidden_layers"] == [2, 15, 27] and record["embedding"] == "target"
    prompts = [[1, 9690, 28, 2683, 253, 1345, 30, 2], [1, 504, 3458, 282, 4649, 314]]
    fixed = SpeculativeConfig("eagle3", draft_len=3, adaptive=False)
    with LLM.load(art, backend="ort", draft=tmp_path / "head", prefix_cache_mb=0) as llm:
        plain = [llm.generate(p, max_new_tokens=12).token_ids for p in prompts]
        assert llm.generate(prompts[0], max_new_tokens=12, speculative=fixed).token_ids == plain[0]
        assert [r.token_ids for r in llm.generate(prompts, max_new_tokens=12, speculative=fixed)] == plain


def test_prompt_lookup_drafts_beside_the_head_where_it_promises_more(drafting, monkeypatch):
    """A head row also looks the prompt up (``prompt_lookup``): on a reply that repeats itself (the tiny random
    target loops) the lookup's drafts are verified instead of the random head's, which is never right, so more
    tokens come a pass; tokens stay plain decoding's, and with ``prompt_lookup=False`` only the head drafts."""
    from decodert.runtime.speculation import speculative
    from decodert.runtime.speculation.speculative import SpeculativeConfig

    llm, _ = drafting
    prompt = PROMPTS[0] * 3
    plain = llm.generate(prompt, max_new_tokens=48).token_ids
    assert len(set(plain[-24:])) < 12  # it repeats itself: prompt lookup has something to find
    verified: list = []
    learn = speculative._learn

    def spy(seq, key, proposed, accepted):
        verified.append((key, proposed, accepted))
        return learn(seq, key, proposed, accepted)

    monkeypatch.setattr(speculative, "_learn", spy)
    costs = llm.engine.speculator.costs  # given, not timed: a verify of w tokens costs 1 + 0.05 (w - 1) decode steps
    monkeypatch.setattr(costs, "estimate", lambda rows, width: 1.0 + 0.05 * (width - 1))
    monkeypatch.setattr(costs, "slope", lambda rows: 0.05)
    runs = {}
    for lookup in (True, False):
        verified.clear()
        got = llm.generate(prompt, max_new_tokens=48, speculative=SpeculativeConfig("eagle3", prompt_lookup=lookup))
        assert got.token_ids == plain
        runs[lookup] = (list(verified), got.metrics.accepted_per_step)
    with_lookup, alone = runs[True][0], runs[False][0]
    assert any(key not in (None, 1) and accepted for key, _, accepted in with_lookup)  # lookup drafts, accepted
    assert all(key in (None, 1) for key, proposed, _ in alone if proposed)  # the head's own only
    assert runs[True][1] > runs[False][1]
