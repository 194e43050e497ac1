"""The generate loop and continuous batching over the fake backend (runtime/decoding/generate.py, scheduler.py, llm.py)."""

from pathlib import Path

import numpy as np
import pytest

from fake_backend import FakeBackend, fake_manifest, make_llm, make_tokenizer, reference_tokens, scripted_llm  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.runtime.llm import LLM, Request  # noqa: E402
from decodert.runtime.decoding.sampling import SamplingParams  # noqa: E402

PROMPTS = ["hello world", "the quick brown fox jumps", "a", "héllo wörld: accents", "lazy dog", "STOP here."]


def test_greedy_matches_reference_model():
    llm = make_llm(max_seq=64)
    for prompt in PROMPTS[:3]:
        r = llm.generate(prompt, max_new_tokens=12)
        assert r.token_ids == reference_tokens(llm.backend, llm.encode(prompt).tolist(), 12)
        assert r.finish_reason == "length" and len(r.token_ids) == 12
    assert all(not want for _, _, want in llm.backend.calls), "greedy must not ask for logits"


def test_batched_equals_single():
    llm = make_llm(max_batch=4)
    singles = [llm.generate(p, max_new_tokens=10) for p in PROMPTS[:4]]
    llm.backend.calls.clear()
    batched = llm.generate(PROMPTS[:4], max_new_tokens=10)
    assert [r.token_ids for r in batched] == [r.token_ids for r in singles]
    assert [r.text for r in batched] == [r.text for r in singles]
    assert llm.backend.calls[0] == ("prefill", (0, 1, 2, 3), False)  # one prefill call for all rows


def test_continuous_batching_six_requests_two_slots():
    llm = make_llm(max_batch=2)
    lengths = [3, 9, 1, 6, 4, 7]
    singles = [llm.generate(p, max_new_tokens=n) for p, n in zip(PROMPTS, lengths)]
    llm.backend.calls.clear()
    results = llm.generate_many([Request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(PROMPTS, lengths)])
    assert [r.token_ids for r in results] == [r.token_ids for r in singles]
    assert [len(r.token_ids) for r in results] == lengths
    calls = llm.backend.calls
    assert max(len(slots) for kind, slots, _ in calls if kind != "move") <= 2
    assert sum(len(slots) for kind, slots, _ in calls if kind == "prefill") == 6
    assert any(kind == "move" for kind, _, _ in calls), "finished rows must be compacted away"
    assert llm.backend.rows_decoded() == sum(n - 1 for n in lengths)  # no row decoded after it finished


def test_finished_rows_are_not_decoded():
    llm = make_llm(max_batch=2)
    llm.generate_many([{"prompt": "hello", "max_new_tokens": 2}, {"prompt": "a", "max_new_tokens": 10}])
    decodes = [slots for kind, slots, _ in llm.backend.calls if kind == "decode"]
    assert decodes[0] == (0, 1) and all(s == (0,) for s in decodes[1:])
    assert len(decodes) == 9 and llm.backend.rows_decoded() == 10
    assert ("move", (1, 0), False) in llm.backend.calls  # the long request moved into slot 0


def test_mixed_params_per_request():
    llm = make_llm(max_batch=2)
    reqs = [{"prompt": "hello", "max_new_tokens": 5},
            {"prompt": "a", "max_new_tokens": 8, "temperature": 0.9, "seed": 3},
            {"prompt": "lazy dog", "max_new_tokens": 4, "repetition_penalty": 1.5}]
    single = [llm.generate(r["prompt"], **{k: v for k, v in r.items() if k != "prompt"}) for r in reqs]
    many = llm.generate_many(reqs)
    assert [r.token_ids for r in many] == [r.token_ids for r in single]


def test_seeded_sampling_reproducible_and_batch_invariant():
    llm = make_llm(max_batch=3)
    a = llm.generate("hello", max_new_tokens=15, temperature=1.0, top_p=0.95, seed=11)
    b = llm.generate("hello", max_new_tokens=15, temperature=1.0, top_p=0.95, seed=11)
    c = llm.generate("hello", max_new_tokens=15, temperature=1.0, top_p=0.95, seed=12)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    batch = llm.generate(["a", "hello", "lazy dog"], max_new_tokens=15, temperature=1.0, top_p=0.95, seed=11)
    assert batch[1].token_ids == a.token_ids
    assert all(want for kind, _, want in llm.backend.calls if kind != "move"), "sampling needs logits"


def test_repetition_penalty_asks_for_logits_and_changes_greedy():
    llm = make_llm()
    plain = llm.generate("hello world", max_new_tokens=20)
    llm.backend.calls.clear()
    penalised = llm.generate("hello world", max_new_tokens=20, repetition_penalty=5.0)
    assert all(want for kind, _, want in llm.backend.calls)
    assert penalised.token_ids != plain.token_ids
    assert len(set(penalised.token_ids)) == 20  # a strong penalty forbids repeats


def test_cache_full_finishes_with_length():
    llm = make_llm(max_seq=16)
    ids = llm.encode("the quick brown fox jumps").tolist()[:10]
    r = llm.generate(ids, max_new_tokens=100)
    assert r.finish_reason == "length" and len(ids) + len(r.token_ids) == 16
    assert r.token_ids == reference_tokens(llm.backend, ids, 100)
    one = llm.generate(list(range(3, 18)), max_new_tokens=100)  # max_seq - 1 prompt tokens
    assert len(one.token_ids) == 1 and one.finish_reason == "length"


def test_prompt_too_long_names_max_seq_before_any_work():
    llm = make_llm(max_seq=16)
    with pytest.raises(DecodertError, match="--max-seq 16"):
        llm.generate(list(range(3, 19)))
    with pytest.raises(DecodertError, match="--max-seq"):
        llm.generate(["hi", list(range(3, 30))])
    assert llm.backend.calls == []


@pytest.mark.parametrize("call", [
    lambda llm: llm.generate("hi", temperature=-1),
    lambda llm: llm.generate("hi", top_p=0),
    lambda llm: llm.generate("hi", top_k=-2),
    lambda llm: llm.generate("hi", min_p=2),
    lambda llm: llm.generate("hi", repetition_penalty=0),
    lambda llm: llm.generate("hi", bogus=1),
    lambda llm: llm.generate(""),
    lambda llm: llm.generate([]),
    lambda llm: llm.generate(["ok", ""]),
    lambda llm: llm.generate([5, 10**6]),
    lambda llm: llm.stream("hi", top_p=3),
    lambda llm: llm.generate_many([{"prompt": "ok"}, {"prompt": "x", "temperature": -1}]),
    lambda llm: llm.generate_many([Request()]),
])
def test_invalid_input_rejected_before_any_work(call):
    llm = make_llm()
    with pytest.raises(DecodertError) as info:
        call(llm)
    assert "\n" not in str(info.value)
    assert llm.backend.calls == []


def test_eos_and_stop_token_ids_finish_with_stop():
    llm, script = scripted_llm("hello world")
    r = llm.generate("a", max_new_tokens=50)
    assert r.finish_reason == "stop" and r.text == "hello world" and r.token_ids == script
    r2 = llm.generate("lazy", max_new_tokens=50, stop_token_ids=[script[1]])
    assert r2.finish_reason == "stop" and r2.token_ids == script[:2]
    assert r2.text == llm.tokenizer.decode(script[:1])


def test_stop_string_across_tokens_never_streamed():
    text = "the quick brown fox jumps over"
    llm, script = scripted_llm(text)
    stream = llm.stream("a", max_new_tokens=50, stop=["n fox", "zzz"])
    deltas = list(stream)
    assert "".join(deltas) == "the quick brow"
    assert stream.result.finish_reason == "stop" and stream.result.text == "the quick brow"
    assert len(stream.result.token_ids) < len(script) - 2  # stopped early
    pieces = [llm.tokenizer.decode([t]) for t in stream.result.token_ids]
    assert not any("n fox" in p for p in pieces), "the stop string must span tokens for this test"


def test_stream_emoji_byte_tokens_without_replacement_chars():
    text = "héllo 😀 wörld 🦊!"
    llm, script = scripted_llm(text)
    assert len(llm.tokenizer.encode("😀").ids) == 4
    stream = llm.stream("a", max_new_tokens=100)
    deltas = list(stream)
    assert "".join(deltas) == text == stream.result.text
    assert not any("\ufffd" in d for d in deltas)
    assert "😀" in deltas and "🦊" in deltas


def test_stream_and_generate_agree_and_metrics_filled():
    llm = make_llm()
    r = llm.generate("hello world", max_new_tokens=9)
    stream = llm.stream("hello world", max_new_tokens=9)
    text = "".join(stream)
    assert text == stream.result.text == r.text and stream.result.token_ids == r.token_ids
    m = r.metrics
    assert m.prompt_tokens == len(llm.encode("hello world")) and m.generated_tokens == 9
    assert m.ttft_s > 0 and m.total_s >= m.ttft_s and m.prompt_tps > 0 and m.decode_tps > 0
    assert m.tpot_ms > 0 and m.peak_rss_mb > 10
    assert set(r.to_dict()) == {"text", "token_ids", "finish_reason", "metrics"}


def test_abandoned_stream_leaves_llm_usable():
    llm = make_llm(max_batch=1)
    stream = llm.stream("hello", max_new_tokens=30)
    next(stream)
    stream.close()
    r = llm.generate("hello world", max_new_tokens=5)
    assert r.token_ids == reference_tokens(llm.backend, llm.encode("hello world").tolist(), 5)
    stream = llm.stream("hello", max_new_tokens=30)
    next(stream)
    r = llm.generate("a", max_new_tokens=5)  # ends the unfinished stream: it must not touch the cache again
    assert r.token_ids == reference_tokens(llm.backend, llm.encode("a").tolist(), 5)
    assert list(stream) == [] and stream.result is None


def test_bos_added_when_manifest_says_so():
    llm = make_llm(add_bos_token=True)
    assert llm.encode("hello")[0] == 1 and llm.encode("hello", add_bos=False)[0] != 1
    assert llm.encode([5, 6]).tolist() == [5, 6]


def test_load_errors_are_one_line(tmp_path):
    from decodert.runtime.backends.loading import open_backend, open_tokenizer

    with pytest.raises(DecodertError, match="manifest.json"):
        LLM.load(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(DecodertError, match="JSON"):
        LLM.load(tmp_path)
    with pytest.raises(DecodertError, match="tokenizer.json not found"):
        open_tokenizer(tmp_path, fake_manifest(FakeBackend()))
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(DecodertError, match="cannot load tokenizer"):
        open_tokenizer(tmp_path, None)
    with pytest.raises(DecodertError, match="no TensorRT engines"):
        open_backend(tmp_path, fake_manifest(FakeBackend()), "trt")
    with pytest.raises(DecodertError, match="unknown backend"):
        open_backend(tmp_path, fake_manifest(FakeBackend()), "cuda")


def test_close_closes_the_backend():
    llm = make_llm()
    closed = []
    llm.backend.close = lambda: closed.append(True)
    with llm:
        llm.generate("hi", max_new_tokens=2)
    assert closed == [True]


def test_injected_backend_without_manifest():
    tok = make_tokenizer()
    llm = LLM(FakeBackend(vocab_size=tok.get_vocab_size()), tok)
    assert len(llm.generate("hello", max_new_tokens=3).token_ids) == 3
    np.testing.assert_array_equal(llm.encode("hello"), tok.encode("hello").ids)


# -- end to end: export a tiny model, run it on the ORT backend, compare with transformers ------
E2E_PROMPTS = ["The quick brown fox", "Hello world! How are", "def add(a, b):", "Once upon a time there", "12, 345 and"]


def _export_tiny(tiny_checkpoint, root, family):
    pytest.importorskip("transformers")
    from decodert.export.pipeline import export_model

    ckpt = tiny_checkpoint(family)  # tests/conftest.py: made once per session
    export_model(ckpt, root / "art", target="ort", dtype="fp32", max_seq=64, max_batch=3, progress=False)
    return ckpt, root / "art"


def _transformers_greedy(ckpt, prompts, n):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    out = []
    for ids in prompts:
        x = torch.tensor([ids])
        y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n, pad_token_id=0)
        out.append(y[0, len(ids):].tolist())
    return out


def _check_against_transformers(ckpt, art):
    llm = LLM.load(art)  # auto: no engines in the folder -> ort
    assert llm.backend.name == "ort"
    prompts = [llm.encode(p).tolist() for p in E2E_PROMPTS]
    expected = _transformers_greedy(ckpt, prompts, 20)
    singles = [llm.generate(ids, max_new_tokens=20).token_ids for ids in prompts]
    assert singles == expected
    assert [r.token_ids for r in llm.generate(prompts[:3], max_new_tokens=20)] == expected[:3]  # one batch
    many = llm.generate_many([Request(ids, SamplingParams(max_new_tokens=20 - 3 * i)) for i, ids in enumerate(prompts)])
    assert [r.token_ids for r in many] == [e[: 20 - 3 * i] for i, e in enumerate(expected)]  # 5 through 3 slots
    return llm


def test_e2e_tiny_llama_matches_transformers(tiny_checkpoint, tmp_path):
    llm = _check_against_transformers(*_export_tiny(tiny_checkpoint, tmp_path, "llama"))
    text = "".join(llm.stream("Hello world", max_new_tokens=8, temperature=0.8, seed=1))
    assert text == llm.generate("Hello world", max_new_tokens=8, temperature=0.8, seed=1).text


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "phi3", "llama3"])
def test_e2e_tiny_families_match_transformers(tiny_checkpoint, tmp_path, family):
    _check_against_transformers(*_export_tiny(tiny_checkpoint, tmp_path, family))


@pytest.mark.gpu
@pytest.mark.trt
def test_e2e_tiny_llama_on_tensorrt(tiny_checkpoint, tmp_path):
    """The loop over TrtBackend (fp16 engines): agrees with transformers, continuous batching == single."""
    pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX not installed")
    from decodert.export.pipeline import export_model
    from decodert.export.trt_build import build_engines
    from decodert.plugins import cuda_mem

    if cuda_mem.gpu_count() == 0:
        pytest.skip("needs an NVIDIA GPU")
    ckpt = tiny_checkpoint("llama")
    export_model(ckpt, tmp_path / "art", target="trt", dtype="fp16", max_seq=64, max_batch=3, progress=False)
    build_engines(tmp_path / "art", progress=False)
    with LLM.load(tmp_path / "art") as llm:  # auto: engines + GPU -> trt
        assert llm.backend.name == "trt"
        prompts = [llm.encode(p).tolist() for p in E2E_PROMPTS]
        expected = _transformers_greedy(ckpt, prompts, 12)
        singles = [llm.generate(ids, max_new_tokens=12).token_ids for ids in prompts]
        agree = np.mean([a == b for s, e in zip(singles, expected) for a, b in zip(s, e)])
        assert agree >= 0.8, (singles, expected)  # fp16 may flip a near-tie, then diverge
        reqs = [Request(ids, SamplingParams(max_new_tokens=12 - 2 * i)) for i, ids in enumerate(prompts)]
        many = llm.generate_many(reqs)
        assert [r.token_ids for r in many] == [s[: 12 - 2 * i] for i, s in enumerate(singles)]


@pytest.mark.slow
def test_e2e_smollm2_matches_transformers(smollm2_gguf, smollm2_hf_model, tmp_path):
    """The real SmolLM2-135M-Instruct: chat template, prompt ids and 32 greedy tokens as transformers."""
    import torch

    from decodert.export.pipeline import export_model

    model, hf_tok = smollm2_hf_model
    export_model(smollm2_gguf, tmp_path / "art", target="ort", dtype="fp32", max_seq=256, max_batch=2, progress=False)
    llm = LLM.load(tmp_path / "art")
    chats = [[{"role": "user", "content": q}] for q in ("List three fruits with emoji 🍎.", "What is 2+2?")]
    results = llm.generate_many([Request(messages=m, params=SamplingParams(max_new_tokens=32)) for m in chats])
    for messages, result in zip(chats, results):
        text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert llm.apply_chat_template(messages) == text
        ids = hf_tok(text, add_special_tokens=False).input_ids
        assert llm.encode(text, add_bos=False).tolist() == ids
        x = torch.tensor([ids])
        y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=32)
        assert result.token_ids == y[0, len(ids):].tolist()
        deltas = list(llm.stream_chat(messages, max_new_tokens=32, temperature=0))
        assert "".join(deltas) == result.text and not any("\ufffd" in d for d in deltas)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="VmHWM is Linux's")
def test_peak_rss_is_this_process_own_not_a_forked_parents():
    """A worker forked from a large parent reports its own peak (ru_maxrss carries the parent's across fork)."""
    import os

    from decodert.runtime.decoding.metrics import peak_rss_mb

    big = np.ones(256 * 1024 * 1024 // 8)  # 256 MiB touched here
    parent = peak_rss_mb()
    del big
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, str(peak_rss_mb()).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = float(os.read(read, 64))
    assert parent >= 256 and child < parent - 128
