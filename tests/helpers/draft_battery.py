"""The exactness checks every draft head's tests run, written once (test-only helper): EAGLE-3
(tests/families/test_eagle3.py), Qwen3.5's MTP layer (tests/families/test_qwen3_5_mtp.py) and Gemma 4's assistant
(tests/families/test_gemma4_assistant.py). A module of its own beside battery.py, whose checks are pytest classes over
a family's tiny checkpoints: these are plain functions over a loaded target and its head, called by each head's tests.

    plain = [llm.generate(p, max_new_tokens=20).token_ids for p in PROMPTS]
    greedy_drafting_is_plain(llm, plain, "eagle3", refused="mtp")       # batch 1 and 4, fixed, adaptive and auto
    sessions_and_prefix_hits_stay_exact(llm, art, head, "eagle3")       # the prefix cache, sessions
    fp16_head_stays_exact(src, head_src, tmp_path, "eagle3", hidden_layers="eagle3")
    with proposals(drafter) as seen: ...                                # every proposal: drafts and the head's cache
    got, seen = forced_drafts(llm, drafter, "eagle3", PROMPTS[0], plain[0], vocab=512)
    logits, hidden = catch_up_outputs(head)                             # one catch-up call of random pairs
    printed = int4_head_stays_exact(head_src, art, tmp_path / "h4", "eagle3", "mtp", capsys)  # --quant int4 via the CLI

A head's own checks (its reference chain, the K/V its cache keeps) run over what ``proposals`` and ``forced_drafts``
record; the greedy, session, prefix-cache and fp16 checks are the same for every head but for the method's name.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

PROMPTS = [[5, 9, 33, 7, 100, 3, 41, 8], [17, 2, 250], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70], [300, 301]]


def greedy_drafting_is_plain(llm: Any, plain: list, method: str, refused: str, tokens: int = 20) -> None:
    """Greedy speculative tokens are plain decoding's: every step drafting 4 (batch 1 and 4), the adaptive planner and
    "auto" (batch 4); another method with this head is refused in one line naming the head's."""
    from decodert.errors import DecodertError
    from decodert.runtime.speculation.speculative import SpeculativeConfig

    fixed = SpeculativeConfig(method, draft_len=4, adaptive=False)  # every step drafts and verifies
    assert [llm.generate(p, max_new_tokens=tokens, speculative=fixed).token_ids for p in PROMPTS] == plain
    assert [r.token_ids for r in llm.generate(PROMPTS, max_new_tokens=tokens, speculative=fixed)] == plain
    assert [r.token_ids for r in llm.generate(PROMPTS, max_new_tokens=tokens, speculative=method)] == plain
    assert [r.token_ids for r in llm.generate(PROMPTS, max_new_tokens=tokens, speculative="auto")] == plain
    with pytest.raises(DecodertError, match=f"it is a speculative='{method}' head"):
        llm.generate(PROMPTS[0], max_new_tokens=2, speculative=refused)


def sessions_and_prefix_hits_stay_exact(llm: Any, art: Path, head: Path, method: str) -> None:
    """``llm`` (no prefix cache) gives plain decoding; a second LLM with the prefix cache and the head gives its
    tokens for a long prompt twice (the second a cache hit) and for a batch mixing hits and misses; a session's
    speculative turns are a plain session's, and the session reuses its cache."""
    from decodert.runtime.llm import LLM
    from decodert.runtime.speculation.speculative import SpeculativeConfig

    fixed = SpeculativeConfig(method, draft_len=3, adaptive=False)
    with LLM.load(art, backend="ort", draft=head) as cached:  # with the prefix cache
        long = PROMPTS[2] * 3
        want = llm.generate(long, max_new_tokens=12).token_ids
        first = cached.generate(long, max_new_tokens=12, speculative=fixed)
        again = cached.generate(long, max_new_tokens=12, speculative=fixed)
        assert first.token_ids == want and again.token_ids == want and again.metrics.cached_tokens > 0
        batch = cached.generate([long, PROMPTS[0], long[:20], PROMPTS[3]], max_new_tokens=8, speculative=fixed)
        assert [r.token_ids for r in batch] == [llm.generate(p, max_new_tokens=8).token_ids
                                               for p in (long, PROMPTS[0], long[:20], PROMPTS[3])]
    plain_session, spec_session = llm.session(), llm.session()
    for message in ("hello there", "and again", "one more"):
        a = plain_session.chat(message, max_new_tokens=8)
        b = spec_session.chat(message, max_new_tokens=8, speculative=fixed)
        assert a.token_ids == b.token_ids
    assert spec_session.cached_tokens > 0


def fp16_head_stays_exact(src: Path, head_src: Path, tmp_path: Path, method: str, **export: Any) -> None:
    """An fp16 export of the target ``src`` (``export``: the outputs the head reads): the head (``head_src``) is
    exported in the target's dtype and its greedy speculative tokens are plain decoding's, batch 4."""
    from decodert.export.heads import export_head
    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM
    from decodert.runtime.speculation.speculative import SpeculativeConfig

    art = tmp_path / "fp16"
    export_model(src, art, dtype="fp16", max_seq=128, max_batch=4, progress=False, **export)
    assert export_head(head_src, tmp_path / "head", art)["dtype"] == "fp16"
    with LLM.load(art, backend="ort", draft=tmp_path / "head", prefix_cache_mb=0) as llm:
        plain = [llm.generate(p, max_new_tokens=12).token_ids for p in PROMPTS]
        fixed = SpeculativeConfig(method, draft_len=3, adaptive=False)
        assert [r.token_ids for r in llm.generate(PROMPTS, max_new_tokens=12, speculative=fixed)] == plain


@contextmanager
def proposals(drafter: Any) -> Iterator[list]:
    """Records every row of every proposal while the block runs: (the row's history, its draft, the head's run
    start and length, the target's length, the head's K, V and tokens of the row's slot, copied)."""
    seen: list = []
    propose = drafter.propose

    def spy(seqs, limits, **kw):
        drafts, keys = propose(seqs, limits, **kw)
        c = drafter.cache
        for seq, draft in zip(seqs, drafts):
            cache, slot = seq.spec.at
            seen.append((seq.history[: seq.length].tolist(), draft.tolist(), int(c.starts[slot]), int(c.lengths[slot]),
                         int(cache.lengths[slot]), c.keys[slot].copy(), c.values[slot].copy(), c.tokens[slot].copy()))
        return drafts, keys

    drafter.propose = spy
    try:
        yield seen
    finally:
        drafter.propose = propose


def forced_drafts(llm: Any, drafter: Any, method: str, prompt: list, want: list, vocab: int) -> tuple[Any, list]:
    """``prompt`` generated (20 tokens, drafts of 3) with the proposals forced: every other proposal two right drafts
    (``want``: plain decoding's tokens) and a wrong one, the others none (a plain step). -> (the result, per proposal:
    the row's history, the head's run start and length, its K and V of the row's slot, copied)."""
    from decodert.runtime.speculation.speculative import SpeculativeConfig

    seen, calls = [], []
    propose = drafter.propose

    def forced(seqs, limits):
        drafts, keys = propose(seqs, limits)
        seq = seqs[0]
        _, slot = seq.spec.at
        c = drafter.cache
        seen.append((seq.history[: seq.length].tolist(), int(c.starts[slot]), int(c.lengths[slot]),
                     c.keys[slot].copy(), c.values[slot].copy()))
        g = seq.length - len(prompt)  # tokens generated so far: the next right one is want[g]
        calls.append(g)
        if len(calls) % 2 or g + 3 > len(want) or limits[0] < 3:
            return [np.zeros(0, np.int64)], keys
        return [np.array([want[g], want[g + 1], (want[g + 2] + 1) % vocab], np.int64)], keys

    drafter.propose = forced
    try:
        got = llm.generate(prompt, max_new_tokens=20, speculative=SpeculativeConfig(method, draft_len=3, adaptive=False))
    finally:
        drafter.propose = propose
    return got, seen


def catch_up_outputs(head: Path, pairs: int = 3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A head artifact with its own K/V (EAGLE-3, MTP): head.onnx's logits and hidden_out for one catch-up call of
    ``pairs`` random pairs, no held entries (EAGLE-3: random features, zero hidden; MTP: a random hidden)."""
    import onnxruntime as ort

    record = json.loads((head / "head.json").read_text())
    spec, cache = record["spec"], record["cache"]
    h, kv, d = spec["hidden_size"], cache["num_kv_heads"], cache["head_dim"]
    rng = np.random.default_rng(seed)
    feeds = {"token_embeds": rng.standard_normal((1, pairs, h), np.float32)}
    if record["family"] == "eagle3":
        feeds["features"] = rng.standard_normal((1, pairs, 3 * spec["target_hidden_size"]), np.float32)
        feeds["hidden"] = np.zeros((1, pairs, h), np.float32)
    else:
        feeds["hidden"] = rng.standard_normal((1, pairs, h), np.float32)
    feeds.update({"past_lengths": np.zeros(1, np.int64), "past_starts": np.zeros(1, np.int64),
                  "seq_lengths": np.array([pairs], np.int64), "past_key.0": np.zeros((1, kv, 1, d), np.float32),
                  "past_value.0": np.zeros((1, kv, 1, d), np.float32)})
    session = ort.InferenceSession(str(head / record["graph"]["file"]), providers=["CPUExecutionProvider"])
    logits, _, hidden, *_ = session.run(None, feeds)
    return logits, hidden


def int4_head_stays_exact(head_src: Path, art: Path, out: Path, method: str, refused: str, capsys: Any,
                          tokens: int = 12) -> str:
    """``decodert export HEAD --target-artifact ART -o OUT --quant int4``, then greedy drafting with that head is plain
    decoding (``greedy_drafting_is_plain``). Returns what the export printed."""
    from decodert.cli import main
    from decodert.runtime.llm import LLM

    assert main(["export", str(head_src), "--target-artifact", str(art), "-o", str(out), "--quant", "int4"]) == 0
    printed = capsys.readouterr().out
    with LLM.load(art, backend="ort", draft=out, prefix_cache_mb=0) as llm:
        plain = [llm.generate(p, max_new_tokens=tokens).token_ids for p in PROMPTS]
        greedy_drafting_is_plain(llm, plain, method, refused=refused, tokens=tokens)
    return printed
