"""Speculative decoding in the loop (runtime/speculation/speculative.py, runtime/speculation/drafters.py) over the fake backend.

Every test compares against plain decoding of the same model: greedy must be token-for-token
identical, whatever the drafts; sampling must have plain sampling's distribution (checked
against the exact distribution of a small Markov model).
"""


import numpy as np
import pytest

from fake_backend import FakeBackend, make_llm, make_tokenizer, scripted_llm  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.runtime.speculation.drafters import (NgramDrafter, longest_suffix_match, ngram_kind, suffix_matches,  # noqa: E402
                                       voted_continuation)
from decodert.runtime.llm import LLM, Request  # noqa: E402
from decodert.runtime.decoding.sampling import SamplingParams, make_distribution  # noqa: E402
from decodert.runtime.speculation.planner import (Calibration, StepCosts, chain_tokens, draft_floor,  # noqa: E402
                                                  expected_tokens, plan)
from decodert.runtime.speculation.speculative import SpeculativeConfig  # noqa: E402

TOK = make_tokenizer()
PROMPTS = ["hello world, this is a tiny test", "the quick brown fox jumps over the lazy dog", "a",
           "héllo wörld: accents and other things"]


def copy_rule(history: np.ndarray) -> int:
    """A model that mostly copies its context (period 7) and breaks the pattern every 13th position:
    prompt lookup drafts are often right and sometimes wrong."""
    t = len(history)
    return int(history[(t - 7) % t]) if t % 13 else int((history[-1] * 3 + 1) % 200 + 3)


def noisy_rule(history: np.ndarray) -> int:
    """Effectively random among 5 tokens: n-gram matches are everywhere and right 1 time in 5."""
    mix = int((history * np.arange(1, len(history) + 1)).sum()) * 2654435761 % 2**32
    return 40 + (mix >> 7) % 5


def fixed_costs(llm: LLM, per_token: float) -> LLM:
    """Step costs as given instead of measured (fake steps take microseconds, and their timings
    under load would make the adaptive width, so the test, vary): decode 1, a verify of w tokens
    1 + per_token * (w - 1), for every row count."""
    llm.speculator.costs.record = lambda *a: None
    llm.speculator.costs.seconds = {(n, w): 1 + per_token * (w - 1) for n in range(1, 9) for w in range(1, 17)}
    return llm


def llm_for(rule=copy_rule, per_token: float = 0.05, **kw) -> LLM:
    """The fake model with fixed step costs: adaptive speculation is deterministic."""
    return fixed_costs(make_llm(TOK, rule=rule, **{"max_seq": 96, "max_batch": 4, **kw}), per_token)


def kinds(llm: LLM) -> dict[str, int]:
    out: dict[str, int] = {}
    for kind, _, _ in llm.backend.calls:
        out[kind] = out.get(kind, 0) + 1
    return out


def test_longest_suffix_match():
    h = np.array([5, 6, 7, 8, 1, 6, 7, 9, 5, 6, 7])
    assert longest_suffix_match(h, 4, 1) == (3, 3)  # "5 6 7" at 0..2 beats "6 7" at 5..6
    assert longest_suffix_match(h, 2, 1) == (7, 2)  # capped at 2: the most recent "6 7"
    assert longest_suffix_match(h, 4, 4) == (-1, 0)
    assert longest_suffix_match(np.array([3, 4]), 3, 1) == (-1, 0)
    assert longest_suffix_match(np.array([4, 4]), 3, 1) == (1, 1)


def test_the_occurrences_of_the_longest_match_vote():
    """Where the longest match occurred several times, each position of the draft is the token
    most of the occurrences still agreeing continue with; the most recent one's on a tie."""
    h = np.array([1, 5, 9, 2, 1, 5, 9, 3, 8, 1, 5, 9, 3, 7, 4, 1, 5])
    starts, n = suffix_matches(h, 4, 1)
    assert n == 2 and starts.tolist() == [2, 6, 11]  # "1 5" three times (each then "9")
    assert voted_continuation(h, starts, 4).tolist() == [9, 3, 7, 4]  # "9 3" 2 votes to 1; then a tie: latest
    assert voted_continuation(h, starts[:1], 3).tolist() == [9, 2, 1]  # one occurrence: its continuation
    assert voted_continuation(h, starts, 40).tolist() == [9, 3, 7, 4, 1, 5]  # up to the end of the history
    assert suffix_matches(h, 4, 3)[1] == 0  # no match of 3
    seq = type("Row", (), {"history": np.concatenate([h, [0] * 8]), "length": len(h)})()
    drafts, keys = NgramDrafter(4, 1).propose([seq, seq], [3, 0])
    assert [d.tolist() for d in drafts] == [[9, 3, 7], []] and keys == [4 * 2 + 3, 0]  # three agree on 9


def test_the_python_vote_equals_the_numpy_vote_on_random_histories():
    """voted_continuation's plain-Python vote (few occurrences) picks what the numpy one does."""
    from decodert.runtime.speculation.drafters import _voted_numpy

    rng = np.random.default_rng(5)
    for _ in range(300):
        h = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(2, 80))).astype(np.int64)
        starts, n = suffix_matches(h, 4, 1)
        if n:
            for k in (1, 3, 8):
                assert voted_continuation(h, starts, k).tolist() == _voted_numpy(h, starts, k).tolist()


def test_the_kind_of_a_proposal_says_how_its_occurrences_agree():
    """Prompt lookup's proposal kinds (acceptance is tracked per kind): match length and agreement."""
    h = np.array([1, 5, 9, 2, 1, 5, 8, 3, 1, 5])
    starts, n = suffix_matches(h, 4, 1)  # "1 5" then 9, then 8: split
    assert n == 2 and ngram_kind(h, starts, n, voted_continuation(h, starts, 2)) == 4 * 2 + 2
    once = np.array([4, 6, 1, 5, 9, 7, 1, 5])
    starts, n = suffix_matches(once, 4, 1)
    assert ngram_kind(once, starts, n, voted_continuation(once, starts, 2)) == 4 * 2 + 1
    assert ngram_kind(once, starts, 0, np.zeros(0, np.int64)) == 0


@pytest.mark.parametrize("rule", [copy_rule, None], ids=["copying", "random"])
def test_greedy_identical_batch_1_and_4(rule):
    llm = llm_for(rule)
    plain = [llm.generate(p, max_new_tokens=40) for p in PROMPTS]
    spec = [llm.generate(p, max_new_tokens=40, speculative="ngram") for p in PROMPTS]
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert [r.text for r in spec] == [r.text for r in plain]
    batch = llm.generate(PROMPTS, max_new_tokens=40, speculative="ngram")
    assert [r.token_ids for r in batch] == [r.token_ids for r in plain]
    if rule is copy_rule:
        assert kinds(llm)["verify"] > 0 and min(r.metrics.accepted_per_step for r in spec if len(r.token_ids) > 8) > 1.5
        assert all(0 < r.metrics.acceptance_rate <= 1 for r in spec[:2])


def test_continuous_batching_rows_accept_different_counts():
    llm = llm_for(max_batch=2)
    reqs = [Request(p, SamplingParams(max_new_tokens=n), speculative=s)
            for p, n, s in zip(PROMPTS * 2, [30, 5, 17, 40, 9, 23, 1, 12], ["ngram", None] * 4)]
    plain = [llm.generate(r.prompt, max_new_tokens=r.params.max_new_tokens).token_ids for r in reqs]
    llm.backend.calls.clear()
    assert [r.token_ids for r in llm.generate_many(reqs)] == plain
    assert max(len(slots) for kind, slots, _ in llm.backend.calls if kind == "verify") == 2
    mapping = [{"prompt": p, "max_new_tokens": 20, "speculative": "ngram"} for p in PROMPTS]
    assert [r.token_ids for r in llm.generate_many(mapping)] == [x[:20] for x in
                                                                  [llm.generate(p, max_new_tokens=20).token_ids for p in PROMPTS]]


def test_stop_string_and_eos_inside_an_accepted_run():
    text = "one two three one two three one two three STOP one two three"
    llm, script = scripted_llm(text, max_seq=128, max_batch=2)
    llm.backend.calls.clear()
    for stop in (["STOP"], ["three one"], []):
        plain = llm.generate("x", max_new_tokens=60, stop=stop)
        spec = llm.generate("x", max_new_tokens=60, stop=stop, speculative="ngram")
        assert (spec.text, spec.token_ids, spec.finish_reason) == (plain.text, plain.token_ids, plain.finish_reason)
    assert spec.token_ids[-1] == 0 and spec.finish_reason == "stop"  # eos (id 0) ended it
    assert kinds(llm)["verify"] > 0


@pytest.mark.parametrize("n", [1, 2, 3, 9, 26])
def test_max_new_tokens_landing_mid_run(n):
    llm = llm_for()
    for p in PROMPTS[:2]:
        plain = llm.generate(p, max_new_tokens=n)
        spec = llm.generate(p, max_new_tokens=n, speculative=SpeculativeConfig(draft_len=8, adaptive=False))
        assert spec.token_ids == plain.token_ids and len(spec.token_ids) == n and spec.finish_reason == "length"


def test_cache_full_mid_run():
    llm = llm_for(max_seq=40)
    for p in PROMPTS:
        plain = llm.generate(p, max_new_tokens=100)
        spec = llm.generate(p, max_new_tokens=100, speculative=SpeculativeConfig(adaptive=False, draft_len=15))
        assert spec.token_ids == plain.token_ids and spec.finish_reason == plain.finish_reason == "length"
        assert len(llm.encode(p)) + len(spec.token_ids) == 40


def test_stream_chat_and_penalties():
    llm = fixed_costs(make_llm(TOK, rule=copy_rule, max_seq=96, chat_template=(
        "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}<|assistant|>")), 0.05)
    plain = llm.generate(PROMPTS[1], max_new_tokens=30)
    stream = llm.stream(PROMPTS[1], max_new_tokens=30, speculative="ngram")
    deltas = list(stream)
    assert "".join(deltas) == plain.text and stream.result.token_ids == plain.token_ids
    assert len(deltas) < len(plain.token_ids)  # several tokens arrive per step
    msgs = [{"role": "user", "content": "hello world"}]
    assert llm.chat(msgs, max_new_tokens=25, speculative="ngram").token_ids == llm.chat(msgs, max_new_tokens=25).token_ids
    assert "".join(llm.stream_chat(msgs, max_new_tokens=25, speculative="ngram")) == llm.chat(msgs, max_new_tokens=25).text
    random_llm = llm_for(None)
    for kw in ({"repetition_penalty": 1.3}, {"presence_penalty": 0.5, "frequency_penalty": 0.2}):
        want = random_llm.generate(PROMPTS[0], max_new_tokens=30, **kw).token_ids
        assert random_llm.generate(PROMPTS[0], max_new_tokens=30, speculative="ngram", **kw).token_ids == want


def test_fallback_when_acceptance_collapses():
    """A noisy model: drafts are mostly wrong, so after a few tries most steps are plain decodes;
    a copying model under the same costs verifies most steps."""
    llm = llm_for(noisy_rule, per_token=0.3, max_seq=256)
    llm.generate(PROMPTS[0], max_new_tokens=200, speculative="ngram")
    assert kinds(llm)["decode"] > 4 * kinds(llm).get("verify", 0)
    copying = llm_for(per_token=0.3, max_seq=256)
    copying.generate(PROMPTS[0], max_new_tokens=200, speculative="ngram")
    assert kinds(copying)["verify"] > 2 * kinds(copying).get("decode", 0)
    llm.backend.calls.clear()
    llm.generate(PROMPTS[0], max_new_tokens=50, speculative=SpeculativeConfig(adaptive=False))
    assert kinds(llm)["verify"] > kinds(llm).get("decode", 0)  # without adaptivity every match is verified


def test_step_costs_measured_and_estimated():
    """The measured cost table the adaptive width reads (real timings feed it; given here)."""
    costs = StepCosts()
    assert costs.estimate(1, 1) is None
    costs.record(1, 1, 9.0)  # the first pass of a shape pays for warm-up: not recorded
    assert costs.estimate(1, 1) is None
    costs.record(1, 1, 1.0)
    costs.record(1, 1, 2.0)
    assert costs.estimate(1, 1) == pytest.approx(1.0)  # the lower quartile of the recent passes
    assert costs.estimate(1, 5) == pytest.approx(1.0 * 1.4)  # unmeasured width: the prior, +0.1 step per token
    assert costs.estimate(2, 1) is None
    costs.record(1, 5, 0.0)
    costs.record(1, 5, 3.0)  # 3.0 s for 5 tokens vs 1.0 s for 1: (3.0 / 1.0 - 1) / 4 = 0.5 per extra token
    assert costs.slope(1) == pytest.approx(0.5)
    assert costs.estimate(1, 4) == pytest.approx(3.0 * (1 + 3 * 0.5) / (1 + 4 * 0.5))  # from the nearest width
    costs.record(4, 1, 0.0)
    costs.record(4, 1, 2.0)
    assert costs.slope(4) == pytest.approx(0.5)  # no verify of 4 rows measured yet: every row count's
    assert costs.estimate(4, 3) == pytest.approx(2.0 * (1 + 2 * 0.5))
    for seconds in (9.0, 2.5, 2.5, 2.5, 2.5):  # one slow decode step (a neighbour's burst) does not stick
        costs.record(4, 1, seconds)
    assert costs.estimate(4, 1) == pytest.approx(2.5)
    for seconds in (0.0, 1.5, 1.5):  # a verify timed below a decode step of as many rows (noise)
        costs.record(4, 3, seconds)
    assert costs.estimate(4, 3) == pytest.approx(2.5)  # is priced as the decode step
    for seconds in [1.0] * 8 + [3.0] * 8:  # only the last WINDOW passes count
        costs.record(2, 1, seconds)
    assert costs.estimate(2, 1) == pytest.approx(3.0)


def test_adaptive_width_follows_the_step_costs():
    """Same model, same prompt: cheap verify passes -> verify most steps; verify passes as dear as
    several decode steps -> plain decode most steps (deterministic: the costs are given)."""
    cheap, dear = llm_for(per_token=0.02, max_seq=256), llm_for(per_token=2.0, max_seq=256)
    a = cheap.generate(PROMPTS[0], max_new_tokens=150, speculative="ngram")
    b = dear.generate(PROMPTS[0], max_new_tokens=150, speculative="ngram")
    assert a.token_ids == b.token_ids
    assert kinds(cheap)["verify"] > 2 * kinds(cheap).get("decode", 0)
    assert kinds(dear).get("decode", 0) > 2 * kinds(dear).get("verify", 0)
    assert a.metrics.accepted_per_step > b.metrics.accepted_per_step


def test_with_nobody_waiting_only_the_row_the_batch_waits_for_is_worth_a_wider_pass():
    """generate_many's last rows: speculating for one row beside rows that cannot speculate ends
    the batch no sooner (every row runs to its limit), so it is not done; when that row has the
    most tokens left, the batch waits for it, and it speculates (identical tokens either way)."""
    first = TOK.encode(PROMPTS[1]).ids[0]

    def mixed(history: np.ndarray) -> int:  # PROMPTS[1] copies its context, the others are noise
        return copy_rule(history) if history[0] == first else noisy_rule(history)

    def run(limits: list[int]) -> list:
        llm = llm_for(mixed, per_token=0.3, max_seq=256)
        reqs = [Request(p, SamplingParams(max_new_tokens=n), speculative="ngram") for p, n in zip(PROMPTS, limits)]
        plain = [llm.generate(r.prompt, max_new_tokens=r.params.max_new_tokens).token_ids for r in reqs]
        llm.backend.calls.clear()
        assert [r.token_ids for r in llm.generate_many(reqs)] == plain
        return llm.backend.calls

    calls = run([60, 60, 60, 60])
    assert sum(kind == "verify" for kind, slots, _ in calls) <= 8  # a few tries (31 without the drain rule)
    calls = run([30, 150, 30, 30])
    verifies = [slots for kind, slots, _ in calls if kind == "verify"]
    assert sum(len(slots) == 4 for slots in verifies) > 5  # the copying row speculates beside the others


def test_plain_steps_keep_learning_in_hindsight():
    """After a noisy reply taught the drafter that its proposals fail, a reply that copies its
    context is still drafted: the drafts plain steps did not verify are judged against the tokens
    generated next. Before, nothing was verified, so nothing was learnt: 149 plain decode steps."""
    first = TOK.encode(PROMPTS[1]).ids[0]

    def mixed(history: np.ndarray) -> int:
        return copy_rule(history) if history[0] == first else noisy_rule(history)

    llm = llm_for(mixed, per_token=0.3, max_seq=256)
    llm.generate(PROMPTS[0], max_new_tokens=200, speculative="ngram")  # noise: acceptance learnt low
    llm.backend.calls.clear()
    r = llm.generate(PROMPTS[1], max_new_tokens=150, speculative="ngram")
    assert r.token_ids == llm.generate(PROMPTS[1], max_new_tokens=150).token_ids
    assert r.metrics.accepted_per_step > 2.0 and kinds(llm)["verify"] > 20


def test_bad_arguments():
    llm = llm_for()
    with pytest.raises(DecodertError, match="speculative must be one of ngram, draft"):
        llm.generate("a", speculative="medusa")
    with pytest.raises(DecodertError, match="draft_len must be an integer >= 1"):
        llm.generate("a", speculative=SpeculativeConfig(draft_len=0))
    with pytest.raises(DecodertError, match="min_ngram 3 exceeds max_ngram 2"):
        llm.generate("a", speculative=SpeculativeConfig(max_ngram=2, min_ngram=3))
    with pytest.raises(DecodertError, match="needs a draft model"):
        llm.generate("a", speculative="draft")
    with pytest.raises(DecodertError, match="speculative must be 'ngram', 'draft' or a SpeculativeConfig"):
        llm.generate("a", speculative=3)
    old = llm_for()
    old.backend.verify_width = 0
    with pytest.raises(DecodertError, match="no verify graph"):
        old.generate("a", speculative="ngram")


def test_draft_model_greedy_identical_and_in_step():
    """The draft model is the target itself with another seed's weights mixed in: right often, not always."""
    target = llm_for(None, max_seq=96)
    draft_backend = FakeBackend(vocab_size=target.backend.vocab_size, max_seq=96, max_batch=4, seed=0)
    draft_backend.H = draft_backend.H + np.random.default_rng(9).standard_normal(draft_backend.H.shape).astype(np.float32)
    llm = LLM(target.backend, TOK, target.manifest, draft=LLM(draft_backend, TOK, target.manifest))
    plain = [llm.generate(p, max_new_tokens=30).token_ids for p in PROMPTS]
    assert [llm.generate(p, max_new_tokens=30, speculative="draft").token_ids for p in PROMPTS] == plain
    assert [r.token_ids for r in llm.generate(PROMPTS, max_new_tokens=30, speculative="draft")] == plain
    r = llm.generate(PROMPTS[1], max_new_tokens=30, speculative=SpeculativeConfig("draft", adaptive=False))
    assert r.token_ids == plain[1] and r.metrics.acceptance_rate > 0.2


class MarkovBackend(FakeBackend):
    """Logits depend on the last token only (table L [V, V]): the exact distribution of a
    continuation is a product of rows of softmax(L)."""

    def __init__(self, vocab_size: int, table: np.ndarray) -> None:
        super().__init__(vocab_size=vocab_size, max_seq=64, max_batch=1)
        self.table = table

    def logits_for(self, history: np.ndarray) -> np.ndarray:
        return self.table[history[-1]]


def test_speculative_sampling_has_plain_sampling_distribution():
    """4000 seeds; the three generated tokens (the last two come from one verify pass: a draft
    accepted or rejected, then a bonus or resampled token) of speculative sampling against the
    exact joint distribution, and plain sampling as a control."""
    vocab = TOK.get_vocab_size()
    rng = np.random.default_rng(0)
    hot = [40, 41, 42, 43, 44]  # the likely tokens (top-k 4 of them per row), so drafts are often right
    table = np.full((vocab, vocab), -8.0, np.float32)
    table[:, hot] = rng.normal(0, 1, (vocab, len(hot))).astype(np.float32)
    llm = LLM(MarkovBackend(vocab, table), TOK, None)
    prompt = [40, 41, 42, 43, 44, 40, 41, 42, 43, 44, 40]
    dist = make_distribution(0.9, top_k=4)
    step = np.stack([dist(table[t][None])[0, hot] for t in hot])  # [5, 5] p(next | last), over hot
    step /= step.sum(-1, keepdims=True)
    exact = step[0][:, None, None] * step[:, :, None] * step[None, :, :]  # [5, 5, 5] p(t1) p(t2|t1) p(t3|t2)
    counts = {"plain": np.zeros((5, 5, 5)), "ngram": np.zeros((5, 5, 5))}
    for seed in range(4000):
        for name, spec in (("plain", None), ("ngram", SpeculativeConfig(adaptive=False))):
            ids = llm.generate(prompt, seed=seed, speculative=spec, max_new_tokens=3, temperature=0.9, top_k=4).token_ids
            counts[name][tuple(hot.index(t) for t in ids)] += 1
    assert kinds(llm)["verify"] == 4000
    keep = exact * 4000 >= 5  # cells expected to hold >= 5 draws; the rest is pooled into one
    for name, c in counts.items():
        assert c.sum() == 4000, name
        seen = np.append(c[keep], c[~keep].sum())
        e = np.append(exact[keep], exact[~keep].sum()) * 4000
        chi2 = float(((seen - e) ** 2 / e).sum())
        assert chi2 < 1.5 * len(e) + 25, (name, chi2, len(e))  # about the cell count if exact


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1 and expected_tokens(1.0, 3) == 4
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert chain_tokens(None, 0.5, 2) == pytest.approx(1.75) and chain_tokens(0.9, 0.5, 0) == 1
    assert chain_tokens(0.9, 0.5, 2) == pytest.approx(1 + 0.9 * 1.5)  # 1 + a1 + a1 * a


def test_calibration_starts_at_the_heads_word_and_learns_the_truth():
    cal = Calibration()
    assert cal(0.95) == pytest.approx(0.95) and cal(0.05) == pytest.approx(0.05) and cal(1.0) == pytest.approx(0.95)
    rng = np.random.default_rng(0)
    for _ in range(600):  # an overconfident head: what it gives 0.9 is accepted 60% of the time
        cal.observe(0.93, bool(rng.random() < 0.6))
    assert cal(0.91) == pytest.approx(0.6, abs=0.07) and cal(0.15) == pytest.approx(0.15)  # other tenths untouched
    assert cal.chain([0.93, 0.93]) == pytest.approx(cal(0.93) ** 2) and cal.chain([]) == 1.0


def test_a_heads_first_draft_prices_the_pass_and_the_floor_its_chain():
    """The planner takes a head's calibrated chance for the draft it has made already: a sure one is verified, an
    unsure one is not, at the same row estimate; the floor is the plan's rate times one more token's cost."""
    costs = StepCosts()
    for width, seconds in ((1, 1.0), (2, 1.1), (3, 1.2)):
        for _ in range(3):
            costs.record(1, width, seconds)

    class Row:
        spec = type("Spec", (), {"config": SpeculativeConfig("eagle3"), "acceptance": lambda self, key: 0.3,
                                 "drafter": type("D", (), {"seconds_per_token": 0.05})()})()
        params = SamplingParams(max_new_tokens=100)
        generated: list = []

    args = (costs, [Row()], [np.zeros(0, np.int64)], [None], [2])
    assert plan(*args, first=[0.9])[0] > 1
    assert plan(*args, first=[0.05])[0] == 1
    width, tps = plan(*args, first=[0.9])
    assert tps == pytest.approx(chain_tokens(0.9, 0.3, width - 1) / (costs.estimate(1, width) + 0.05 * (width - 2)))
    assert draft_floor(costs, 1, tps, 0.05) == pytest.approx(tps * (0.1 * 1.0 + 0.05))  # slope: 0.1 a token

