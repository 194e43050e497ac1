"""decodert's own CPU decode step (runtime/backends/native/, placement's ``native-cpu``) against the ort decode graph
it reads: logits and the K/V rows it writes on tiny random int4 llama-family artifacts over many steps and positions,
the same greedy tokens through the placement, the cache record, refusals; and SmolLM2 int4's greedy tokens over a
128 + 128 run (``-m slow``). Skipped where the C library cannot be had (no compiler, no AVX-512 VNNI)."""

import numpy as np
import pytest

from decodert.errors import DecodertError
from decodert.artifact.manifest import load_manifest
from decodert.export.pipeline import export_model
from decodert.export.quantize.quant import QuantConfig
from decodert.runtime.backends import placement
from decodert.runtime.backends.native import build, step
from decodert.runtime.backends.ort.backend import OrtBackend
from decodert.runtime.llm import LLM

# the native step's tolerance against the ort decode graph's logits: both quantize the activations to int8 per
# block of 32, but an input a rounding apart upstream (another summation order) can round one int8 step the
# other way, moving a step's logits by up to about 2% of their largest; most steps agree to float rounding
REL_TOL, EXACT_TOL, EXACT_SHARE = 0.03, 1e-4, 0.8


@pytest.fixture(scope="module", autouse=True)
def _library():
    why = build.refusal()
    if why:
        pytest.skip(why)


@pytest.fixture(autouse=True)
def _auto_means_auto(monkeypatch):
    monkeypatch.delenv(placement.ENV, raising=False)


@pytest.fixture(scope="module")
def int4_arts(tiny_checkpoint, tmp_path_factory):
    """Tiny int4 (accuracy level 4) ort exports: untied llama, tied (GatherBlockQuantized embedding), qwen2 (qkv
    bias), llama3 (rope scaling, head_dim 32, no grouping)."""
    root = tmp_path_factory.mktemp("native")
    arts = {}
    for family in ("llama", "llama_tied", "qwen2", "llama3"):
        arts[family] = root / family
        export_model(tiny_checkpoint(family), arts[family], target="ort", max_seq=256, max_batch=2, progress=False,
                     quant=QuantConfig(bits=4, accuracy_level=4))
    return arts


def _relative(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / max(np.abs(ref).max(), 1e-6))


@pytest.mark.parametrize("family", ["llama", "llama_tied", "qwen2", "llama3"])
def test_logits_and_cache_rows_are_the_ort_graphs(int4_arts, family):
    """Slot 1 of a two-row cache, a prompt prefilled by ort, then 150 steps of random tokens (positions 17..166):
    every step's logits within REL_TOL of the ort decode graph's on the same cache, most within EXACT_TOL, the
    argmax ort's or a near tie, and the K/V it wrote at each position ort's for the same inputs."""
    art = int4_arts[family]
    m = load_manifest(art)
    be = OrtBackend(art, m, threads=2, separate_decode=True)  # the exported decode graph itself
    native = step.NativeDecode(art, m, threads=2)
    rng = np.random.default_rng(0)
    ours, theirs = be.allocate(2), be.allocate(2)
    prompt = rng.integers(0, m.model.vocab_size, 17)
    for cache in (ours, theirs):
        be.prefill(cache, [1], [prompt], False)
    exact, tokens = 0, rng.integers(0, m.model.vocab_size, 150)
    for i, token in enumerate(tokens):
        ref = be.decode(theirs, [1], np.array([token]), True)
        best, logits = native.step(ours, 1, int(token))
        ours.commit([1], [np.array([token])])
        err = _relative(logits, ref.logits[0])
        assert err <= REL_TOL, (i, err)
        exact += err <= EXACT_TOL
        chosen = int(ref.next_token[0])
        assert best == int(np.argmax(logits)) and (best == chosen or ref.logits[0, chosen] - ref.logits[0, best] <= placement.TIE)
        pos = int(theirs.lengths[1]) - 1
        for mine, want in zip(ours.buffers, theirs.buffers):
            assert _relative(mine[1, :, pos], want[1, :, pos]) <= REL_TOL, (i, pos)
            mine[1, :, pos] = want[1, :, pos]  # the next step reads the same cache on both sides
        assert not ours.buffers[0][0].any()  # the other row untouched
    assert exact >= EXACT_SHARE * len(tokens), exact
    assert list(ours.held(1)) == list(theirs.held(1))


def test_placed_decode_gives_ort_tokens_and_records_the_cache(int4_arts):
    """LLM.load(placement={"decode": "native-cpu"}): the one-session backend's greedy tokens (within ties) alone,
    a batch's exactly its rows' alone (every row of a step in one C call, each as it runs alone), and every row
    holds exactly the ids it ran."""
    art = int4_arts["llama_tied"]
    plain = LLM.load(art, placement="off", prefix_cache_mb=0)
    placed = LLM.load(art, placement={"decode": "native-cpu"}, prefix_cache_mb=0)
    assert placed.backend.placed == {"prefill": "ort", "decode": "native-cpu"}
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time"]
    for prompt in prompts:
        want = plain.generate(prompt, max_new_tokens=40, temperature=0).token_ids
        got = placed.generate(prompt, max_new_tokens=40, temperature=0).token_ids
        if want != got:  # int8 rounding may flip a near tie: then ort scores the two tokens within TIE
            i = next(j for j, (a, b) in enumerate(zip(want, got)) if a != b)
            ids = np.array(plain.tokenizer.encode(prompt, add_special_tokens=False).ids + want[:i], np.int64)
            logits = plain.backend.prefill(plain.backend.allocate(1), [0], [ids], True).logits[0]
            assert logits[want[i]] - logits[got[i]] <= placement.TIE, (prompt, i)
    batch = [r.token_ids for r in placed.generate(prompts, max_new_tokens=24, temperature=0)]
    assert batch == [placed.generate(p, max_new_tokens=24, temperature=0).token_ids for p in prompts]
    be = placed.backend
    cache = be.allocate(1)
    ids = np.array(placed.tokenizer.encode("Hello world", add_special_tokens=False).ids, np.int64)
    be.prefill(cache, [0], [ids], False)
    fed = [5, 9, 11]
    for token in fed:
        be.decode(cache, [0], np.array([token]), False)
    assert list(cache.held(0)) == list(ids) + fed
    r = placed.generate(prompts[0], max_new_tokens=4, temperature=0)
    assert "decode=native-cpu" in r.metrics.summary()
    plain.close()
    placed.close()


def test_measured_placement_times_the_native_candidate(int4_arts, tmp_path):
    """"measure" checks native-cpu's parity against ort and times it; the choice and its figures are cached."""
    import shutil

    art = tmp_path / "art"
    shutil.copytree(int4_arts["llama"], art)
    m = load_manifest(art)
    assert "native-cpu" in placement.candidates(m)["decode"]
    llm = LLM.load(art, placement="measure", prefix_cache_mb=0)
    fig = llm.backend.placement.figures["decode"]
    assert "step_ms" in fig["native-cpu"] and "step_ms" in fig["ort"], fig
    assert llm.backend.placed["decode"] in ("ort", "native-cpu")
    assert (art / placement.FILE).exists()
    llm.close()


def test_refusals_name_the_reason(int4_arts, tiny_checkpoint, tmp_path, monkeypatch):
    """fp32 weights, accuracy level 0, a hybrid: no candidate, with the reason; a decode graph with another op
    is refused when the step opens; no compiler or no VNNI: the library says so in one line."""
    fp32 = tmp_path / "fp32"
    export_model(tiny_checkpoint("llama"), fp32, target="ort", max_seq=64, max_batch=1, progress=False)
    assert "int4 block-32" in placement.native_refusal(load_manifest(fp32))
    assert "native-cpu" not in placement.candidates(load_manifest(fp32))["decode"]
    level0 = tmp_path / "level0"
    export_model(tiny_checkpoint("llama"), level0, target="ort", max_seq=64, max_batch=1, progress=False,
                 quant=QuantConfig(bits=4, accuracy_level=0))
    assert "accuracy-level 4" in placement.native_refusal(load_manifest(level0))
    with pytest.raises(DecodertError, match="no native decode step"):
        step.NativeDecode(fp32, load_manifest(fp32))
    import onnx

    graph = onnx.load(str(int4_arts["llama"] / "decode.onnx"), load_external_data=False).graph
    inits = {t.name: t for t in graph.initializer}
    step.read_graph(graph, inits)  # the real graph matches
    sig = next(n for n in graph.node if n.op_type == "Sigmoid")
    sig.op_type = "Tanh"
    with pytest.raises(DecodertError, match="Tanh nodes"):
        step.read_graph(graph, inits)
    sig.op_type = "Sigmoid"
    gqa = next(n for n in graph.node if n.op_type == "GroupQueryAttention")
    gqa.attribute.append(onnx.helper.make_attribute("softcap", 30.0))
    with pytest.raises(DecodertError, match="softcap"):
        step.read_graph(graph, inits)
    monkeypatch.setattr(build, "_built", {})
    monkeypatch.setattr(build, "cpu_flags", lambda: {"avx2"})
    assert "lacks avx512f" in build.refusal()
    monkeypatch.setattr(build, "_built", {})
    monkeypatch.setattr(build, "cpu_flags", lambda: set(build.CPU_FLAGS))
    monkeypatch.setattr(build, "compiler", lambda: None)
    assert "no C compiler" in build.refusal()


@pytest.mark.slow
def test_smollm2_int4_greedy_tokens_are_ort_s(smollm2_gguf, tmp_path):
    """The real model: a 128-token prompt and 128 greedy steps, the native step's tokens exactly ort's."""
    art = tmp_path / "int4"
    export_model(smollm2_gguf, art, target="ort", max_seq=512, max_batch=1, progress=False,
                 quant=QuantConfig(bits=4, accuracy_level=4))
    m = load_manifest(art)
    be = OrtBackend(art, m, threads=2)
    native = step.NativeDecode(art, m, threads=2)
    from decodert.runtime.backends.placement import TEXT
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(art / m.tokenizer.file)).encode(TEXT * 2, add_special_tokens=False).ids[:128]
    assert len(ids) == 128
    runs = []
    for native_step in (False, True):
        cache = be.allocate(1)
        token = int(be.prefill(cache, [0], [np.array(ids, np.int64)], False).next_token[0])
        tokens = [token]
        for _ in range(128):
            if native_step:
                best, _ = native.step(cache, 0, token)
                cache.commit([0], [np.array([token])])
                token = best
            else:
                token = int(be.decode(cache, [0], np.array([token]), False).next_token[0])
            tokens.append(token)
        runs.append(tokens)
    assert runs[0] == runs[1]


def test_products_alone_are_the_dequantized_products():
    """``nd_gemv_steps`` (bench/gemv_kernel.py's entry point) runs the step's GEMV outside a model: each product equals
    numpy's over the dequantized int4 weights and the activations rounded to int8 per block of 32 (amax / 127, as
    MatMulNBits at accuracy level 4), with and without zero points, N not a multiple of 16; a K that is not a multiple
    of 32 is refused."""
    import ctypes

    lib, rng, P = build.library(), np.random.default_rng(47), ctypes.c_void_p
    lib.nd_start(2)
    shapes = [(40, 96, True), (16, 64, False), (7, 32, True)]
    packed, xs, ys, refs = [], [], [], []
    for n, k, has_zp in shapes:
        blocks = k // 32
        q = rng.integers(0, 256, (n, blocks, 16), dtype=np.uint8)
        s = (rng.random((n, blocks), dtype=np.float32) * 0.01 + 0.001).astype(np.float32)
        z = rng.integers(0, 256, (n, (blocks + 1) // 2), dtype=np.uint8) if has_zp else None
        x = rng.standard_normal(k).astype(np.float32)
        w = np.empty((n, blocks, 32), np.float32)
        w[:, :, 0::2], w[:, :, 1::2] = q & 15, q >> 4
        zp = np.full((n, blocks), 8.0, np.float32)
        if z is not None:
            both = np.stack([z & 15, z >> 4], -1).reshape(n, -1)
            zp = both[:, :blocks].astype(np.float32)
        amax = np.abs(x.reshape(blocks, 32)).max(1, keepdims=True)
        step_ = amax / np.float32(127)
        xq = np.rint(x.reshape(blocks, 32) / step_) * step_  # the activations as the kernel rounds them
        refs.append(np.einsum("nbj,bj->n", (w - zp[:, :, None]) * s[:, :, None], xq.astype(np.float32)))
        buf = np.zeros(lib.nd_packed_bytes(n, k) + 64, np.uint8)
        packed.append(buf[(-buf.ctypes.data) % 64:][: lib.nd_packed_bytes(n, k)])
        lib.nd_pack(q.ctypes.data, s.ctypes.data, None if z is None else z.ctypes.data, n, k, packed[-1].ctypes.data)
        xs.append(x)
        ys.append(np.full(-(-n // 16) * 16, np.nan, np.float32))
    count = len(shapes)

    def run(ks):
        return lib.nd_gemv_steps(count, (P * count)(*[p.ctypes.data for p in packed]),
                                 (P * count)(*[x.ctypes.data for x in xs]),
                                 (ctypes.c_int * count)(*[n for n, _, _ in shapes]), (ctypes.c_int * count)(*ks),
                                 (P * count)(*[y.ctypes.data for y in ys]))

    assert run([k for _, k, _ in shapes]) == 0
    for (n, _, _), y, ref in zip(shapes, ys, refs):
        np.testing.assert_allclose(y[:n], ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())
    assert run([96, 63, 32]) == -1


def test_forward_is_each_token_alone_bit_for_bit(int4_arts):
    """``NativeDecode.forward``: two rows' next tokens in one pass (more than max_tokens: two C calls, the second
    reading the K/V the first wrote) give the logits and K/V rows of one token a call, bit
    for bit; so do batched steps (one token a row); a token outside the vocabulary is refused and writes nothing."""
    art = int4_arts["qwen2"]  # biases too
    m = load_manifest(art)
    be = OrtBackend(art, m, threads=2)
    native = step.NativeDecode(art, m, threads=2)
    vocab, rows, n = native.recipe.vocab, 2, native.max_tokens // 2 + 7
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, vocab, 9 + 5 * s) for s in range(rows)]
    fed = rng.integers(0, vocab, (rows, n))

    def prefilled():
        cache = be.allocate(rows)
        for s in range(rows):
            be.prefill(cache, [s], [prompts[s]], False)
        return cache

    def run(cache, slots, ids):
        with cache.writing(slots):
            best, logits = native.forward(cache, slots, ids)
            cache.commit(slots, ids)
        return best.copy(), logits.copy()

    alone = prefilled()
    want = np.array([[run(alone, [s], [fed[s, i : i + 1]])[1][0] for i in range(n)] for s in range(rows)])
    together = prefilled()
    best, logits = run(together, list(range(rows)), list(fed))
    assert np.array_equal(logits.reshape(want.shape), want)
    assert np.array_equal(best, want.reshape(rows * n, -1).argmax(-1))
    stepped = prefilled()
    for i in range(n):
        _, logits = run(stepped, list(range(rows)), [fed[s, i : i + 1] for s in range(rows)])
        assert np.array_equal(logits, want[:, i])
    for cache in (together, stepped):
        for a, b in zip(alone.buffers, cache.buffers):
            assert np.array_equal(a, b)
    held = int(together.lengths[0])
    with pytest.raises(DecodertError, match=f"cannot run token {vocab}"):
        native.forward(together, [0], [np.array([1, vocab])])
    assert int(together.lengths[0]) == held
    native.close()


def test_speculation_on_the_native_step_keeps_plain_tokens(int4_arts):
    """The verify pass on a native-cpu decode is the C step over the row's next positions, scoring each as the plain
    step does: n-gram speculation verifies (fewer passes than tokens) and gives the plain step's tokens exactly,
    at batch 1 and in a batch; the same on decode=ort."""
    art = int4_arts["llama_tied"]
    prompts = ["one two three four one two three four one two three", "a b c a b c a b c a b", "x y x y x y x y"]
    for where in ("native-cpu", "ort"):
        llm = LLM.load(art, placement={"decode": where}, prefix_cache_mb=0)
        assert llm.backend.verify_matches_decode
        calls = []
        verify = llm.backend.verify
        llm.backend.verify = lambda *a, **k: calls.append(len(a[2])) or verify(*a, **k)
        for prompt in prompts:
            want = llm.generate(prompt, max_new_tokens=24, temperature=0).token_ids
            assert llm.generate(prompt, max_new_tokens=24, temperature=0, speculative="ngram").token_ids == want
        assert calls, where
        want = [llm.generate(p, max_new_tokens=24, temperature=0).token_ids for p in prompts]
        got = [r.token_ids for r in llm.generate(prompts, max_new_tokens=24, temperature=0, speculative="ngram")]
        assert got == want, where
        llm.close()
