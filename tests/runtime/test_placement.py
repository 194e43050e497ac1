"""Per-phase placement (runtime/backends/placement.py): the settings, the cache file and its key, the refusals;
and, where the OpenVINO execution provider is installed, a prefill on it over the cache buffers the ort decode
reads: the same greedy tokens as the one-session ort backend, chunks over a non-empty cache, batches, verify."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from decodert.errors import DecodertError
from decodert.artifact.manifest import load_manifest, write_manifest
from decodert.export.pipeline import export_model
from decodert.runtime.backends import placement
from decodert.runtime.llm import LLM

PROMPTS = ["The capital of France is", "Write a short poem about the sea.", "def fib(n):"]
EXACT = '{"INFERENCE_PRECISION_HINT": "f32"}'  # OpenVINO in f32: a random tiny model's flat logits leave no ties to flip


@pytest.fixture(autouse=True)
def _auto_means_auto(monkeypatch):
    """tests/conftest.py turns "auto" off for the rest of the suite; here it measures."""
    monkeypatch.delenv(placement.ENV, raising=False)


@pytest.fixture(scope="module")
def tiny_arts(tiny_checkpoint, tmp_path_factory):
    """A tiny llama exported for ort without and with the portable prefill (fp32, and int4 with it)."""
    hf = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("placement")
    arts = {}
    for name, kw in {"plain": {}, "ov": {"openvino_prefill": True}}.items():
        arts[name] = root / name
        export_model(hf, arts[name], target="ort", max_seq=256, max_batch=4, progress=False, **kw)
    return arts


def test_settings_are_checked():
    assert placement.parse(None) == placement.parse("ort") == placement.parse("off") == "off"
    assert placement.parse("prefill=openvino,decode=ort") == {"prefill": "openvino", "decode": "ort"}
    assert placement.parse({"prefill": "ort"}) == {"prefill": "ort"}
    for bad in ("fastest", {"verify": "openvino"}, {"prefill": "tensorrt"}, 3, {}):
        with pytest.raises(DecodertError, match="placement"):
            placement.parse(bad)


def test_off_and_single_are_todays_backend(tiny_arts, monkeypatch):
    """Without OpenVINO there is nothing to measure: one session, no file written; "off" the same."""
    from decodert.runtime.backends.openvino import ep, native

    monkeypatch.setattr(native, "available", lambda: False)
    monkeypatch.setattr(ep, "provider", lambda: None)
    for setting in ("auto", "off"):
        llm = LLM.load(tiny_arts["plain"], placement=setting)
        be = llm.backend
        assert be.sessions["decode"] is be.sessions["prefill"] and be.placed == {"prefill": "ort", "decode": "ort"}
        assert be.placement.source == ("single" if setting == "auto" else "off")
        llm.close()
    assert not (tiny_arts["plain"] / placement.FILE).exists()
    assert placement.openvino_refusal(load_manifest(tiny_arts["ov"])) is None
    assert "no portable prefill" in placement.openvino_refusal(load_manifest(tiny_arts["plain"]))
    assert placement.openvino_refusal(load_manifest(tiny_arts["plain"]), "openvino-native") is None


def test_the_environment_says_what_auto_means(monkeypatch):
    monkeypatch.setenv(placement.ENV, "off")
    assert placement.parse("auto") == "off" and placement.parse("measure") == "measure"
    monkeypatch.setenv(placement.ENV, "prefill=openvino-native")
    assert placement.parse("auto") == {"prefill": "openvino-native"}
    monkeypatch.setenv(placement.ENV, "sideways")
    with pytest.raises(DecodertError, match=r"^\$DECODERT_PLACEMENT: placement must be"):
        placement.parse("auto")


def test_the_cache_key_and_file(tiny_arts, tmp_path, monkeypatch):
    key = placement.machine_key(tiny_arts["ov"])
    assert {"cpu", "flags", "cores", "threads", "onnxruntime", "openvino_ep", "decodert", "manifest"} <= set(key)
    file = tmp_path / "p.json"
    assert placement.write_cached(file, key, {"prefill": "openvino", "decode": "ort"}, {}) == file
    assert placement.read_cached(file, key)["phases"]["prefill"] == "openvino"
    assert placement.read_cached(file, {**key, "cores": key["cores"] + 1}) is None  # another machine: measure again
    assert placement.read_cached(file, {**key, "onnxruntime": "0.0"}) is None
    file.write_text("{not json")
    assert placement.read_cached(file, key) is None
    # a read-only artifact folder: the file goes under $DECODERT_CACHE/placement/
    monkeypatch.setenv("DECODERT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(placement.os, "access", lambda p, mode: False)
    assert placement.cache_file(tiny_arts["ov"]).parent == tmp_path / "cache" / "placement"


def test_the_manifest_checks_a_phase_graph(tiny_arts, tiny_checkpoint, tmp_path):
    import shutil

    art = tmp_path / "art"
    shutil.copytree(tiny_arts["ov"], art)
    m = load_manifest(art)
    pg = m.phase_graphs["prefill.portable"]
    assert pg.weights == m.weights.file  # fp32: the portable graph reads the ort weights.bin, nothing more on disk
    assert sorted(p.name for p in art.iterdir() if p.suffix == ".bin") == ["weights.bin"]
    bad = m.replace(phase_graphs={"prefill.other": pg})
    with pytest.raises(DecodertError, match="phase_graphs.prefill.other must be named"):
        write_manifest(art, bad)
    with pytest.raises(DecodertError, match="--openvino-prefill adds"):
        export_model(tiny_checkpoint("llama"), tmp_path / "y", target="portable", openvino_prefill=True, progress=False)


# ---- on the OpenVINO execution provider ---------------------------------------------------------------
@pytest.fixture
def ov(monkeypatch):
    pytest.importorskip("onnxruntime_ep_openvino")
    from decodert.runtime.backends.openvino import ep

    if ep.provider() is None:
        pytest.skip("the OpenVINO execution provider does not load here")
    monkeypatch.setenv("DECODERT_OPENVINO_CONFIG", EXACT)
    return ep


@pytest.fixture
def ov_runtime(monkeypatch):
    """OpenVINO's own runtime (openvino-native / -sdpa / -paged need no execution provider: the EP's plugin lists no
    device on some CPUs, e.g. an AMD EPYC, where OpenVINO itself runs)."""
    pytest.importorskip("openvino")
    monkeypatch.setenv("DECODERT_OPENVINO_CONFIG", EXACT)


def _greedy(llm, prompts=PROMPTS, n=24, **kw):
    return [r.token_ids for r in llm.generate(list(prompts), max_new_tokens=n, temperature=0, **kw)]


def test_an_openvino_prefill_gives_ort_tokens(ov, tiny_arts, monkeypatch):
    """Prefill on OpenVINO (alone and batched, whole and in chunks over a non-empty cache), decode on MLAS:
    the one-session backend's greedy tokens, and the cache records exactly the ids it holds."""
    plain = LLM.load(tiny_arts["ov"], placement="off", prefix_cache_mb=0)
    want = _greedy(plain)
    want_one = [_greedy(plain, [p])[0] for p in PROMPTS]
    plain.close()
    monkeypatch.setenv("DECODERT_PREFILL_CHUNK", "4")  # every prompt runs in chunks: later ones over a cache
    for chunk in ("4", "512"):
        monkeypatch.setenv("DECODERT_PREFILL_CHUNK", chunk)
        llm = LLM.load(tiny_arts["ov"], placement={"prefill": "openvino"}, prefix_cache_mb=0)
        assert llm.backend.placed == {"prefill": "openvino", "decode": "ort"}
        assert [_greedy(llm, [p])[0] for p in PROMPTS] == want_one
        assert _greedy(llm) == want  # three rows prefilled in one call
        r = llm.generate(PROMPTS[0], max_new_tokens=4, temperature=0)
        assert "prefill=openvino decode=ort" in r.metrics.summary()
        cache = llm.backend.allocate(1)
        ids = np.arange(5, 40, dtype=np.int64)
        llm.backend.prefill(cache, [0], [ids], False)
        assert cache.held(0).tolist() == ids.tolist()
        llm.close()


@pytest.mark.parametrize("name", ["openvino", "openvino-native", "openvino-sdpa", "openvino-paged"])
def test_speculation_keeps_its_tokens_on_the_placement(request, tiny_arts, name):
    request.getfixturevalue("ov" if name == "openvino" else "ov_runtime")
    plain = LLM.load(tiny_arts["ov"], placement="off", prefix_cache_mb=0)
    text = ["one two three four one two three four one two three", *PROMPTS]
    want = _greedy(plain, text, 32)
    plain.close()
    llm = LLM.load(tiny_arts["ov"], placement={"prefill": name}, prefix_cache_mb=0)
    assert _greedy(llm, text, 32, speculative="ngram") == _greedy(llm, text, 32) == want
    llm.close()


@pytest.mark.parametrize("name", ["openvino-native", "openvino-sdpa", "openvino-paged"])
def test_a_native_openvino_prefill_gives_ort_tokens(ov_runtime, tiny_arts, name):
    """OpenVINO's runtime over the ort prefill graph (its attention as OpenVINO's frontend translates it, or
    lowered to its SDPA or its PagedAttention): each row's whole prompt in one call, the new rows copied into the cache (a fresh row
    and one that holds K/V already); the decode on MLAS reads them."""
    plain = LLM.load(tiny_arts["plain"], placement="off", prefix_cache_mb=0)
    want = _greedy(plain)
    llm = LLM.load(tiny_arts["plain"], placement={"prefill": name}, prefix_cache_mb=0)
    assert llm.backend.placed == {"prefill": name, "decode": "ort"}
    runner = llm.backend.phase_sessions[name]["prefill"]
    assert runner.warmed_s > 0  # warmed at load (its prompts run over a scratch cache, not the rows below)
    if runner.paged:  # its blocks made for the whole cache at load
        assert all(t.shape[0] * runner.block >= llm.backend.max_seq for t in runner.blocks_held().values())
    assert _greedy(llm) == want
    ids = np.arange(5, 45, dtype=np.int64)
    outs = []
    for be in (plain.backend, llm.backend):  # 30 tokens, then 10 more over the row's cache
        cache = be.allocate(1)
        be.prefill(cache, [0], [ids[:30]], False)
        outs.append(be.prefill(cache, [0], [ids[30:]], True).logits[0])
        assert cache.held(0).tolist() == ids.tolist()
        step = be.decode(cache, [0], np.array([7], np.int64), True)
        outs.append(step.logits[0])
    assert np.abs(outs[0] - outs[2]).max() < 1e-3 and np.abs(outs[1] - outs[3]).max() < 1e-3
    with pytest.raises(DecodertError, match="runs the prefill only"):
        llm.backend.place("decode", name)
    plain.close()
    llm.close()


def test_auto_measures_once_and_reads_the_cache(ov, tiny_arts, tmp_path):
    import shutil

    art = tmp_path / "art"
    shutil.copytree(tiny_arts["ov"], art)
    llm = LLM.load(art, placement="auto")
    first = llm.backend.placement
    assert first.source == "measured" and Path(first.file) == art / placement.FILE
    data = json.loads((art / placement.FILE).read_text())
    assert set(data["figures"]["prefill"]) == {"ort", "openvino", "openvino-native", "openvino-sdpa", "openvino-paged"}
    assert data["phases"] == dict(first.phases)
    assert all("short_ms" in v for v in data["figures"]["prefill"].values())
    llm.close()
    again = LLM.load(art, placement="auto")
    assert again.backend.placement.source == "cached" and again.backend.placed == dict(first.phases)
    again.close()
    data["key"]["cores"] = -1  # another machine's measurement
    (art / placement.FILE).write_text(json.dumps(data))
    third = LLM.load(art, placement="auto")
    assert third.backend.placement.source == "measured"
    third.close()
    assert placement.describe_artifact(art).startswith("prefill=")


def test_a_graph_openvino_refuses_is_never_chosen(ov, tiny_arts):
    """The ort target's prefill (com.microsoft ops) does not open on the OpenVINO EP: a one-line error, and
    the measurement records the refusal and keeps ort."""
    from decodert.runtime.backends.ort.backend import OrtBackend
    from decodert.runtime.backends.ort_session import session_options

    with pytest.raises(DecodertError, match="OpenVINO execution provider cannot take the graph"):
        ov.open_session(tiny_arts["ov"] / "prefill.onnx", session_options(None))
    m = load_manifest(tiny_arts["plain"])
    be = OrtBackend(tiny_arts["plain"], m)
    prompts = placement.parity_prompts(tiny_arts["plain"], m, 8, 20)
    phases, figures = placement.measure(be, {"prefill": ["ort", "openvino"], "decode": ["ort"]}, prompts)
    assert phases == {"prefill": "ort", "decode": "ort"}
    assert "no portable prefill graph" in figures["prefill"]["openvino"]["refused"]


def test_int4_prefill_on_openvino(ov, tiny_checkpoint, tmp_path, monkeypatch):
    """int4: the portable graph gets its own weights (qdq layout); greedy tokens of ort's, or a first difference
    only where ort scores the two tokens within placement.TIE (a near tie int4 rounding may flip)."""
    from decodert.export.quantize.quant import QuantConfig

    art = tmp_path / "int4"
    export_model(tiny_checkpoint("llama"), art, target="ort", max_seq=256, quant=QuantConfig(bits=4, accuracy_level=4),
                 openvino_prefill=True, progress=False)
    assert load_manifest(art).phase_graphs["prefill.portable"].weights == "weights.portable.bin"
    monkeypatch.delenv("DECODERT_OPENVINO_CONFIG")  # OpenVINO's defaults, as users get them
    _check_within_ties(art, PROMPTS)


@pytest.fixture(scope="module")
def int4_art(tiny_checkpoint, tmp_path_factory):
    from decodert.export.quantize.quant import QuantConfig

    art = tmp_path_factory.mktemp("placed-int4") / "int4"
    export_model(tiny_checkpoint("llama"), art, target="ort", max_seq=256, max_batch=3,
                 quant=QuantConfig(bits=4, accuracy_level=4), progress=False)
    return art


def test_int4_prefill_on_openvino_runtime(ov_runtime, int4_art, monkeypatch):
    """int4 on OpenVINO's own runtime (OpenVINO's defaults, as users get them): ort's greedy tokens within ties."""
    monkeypatch.delenv("DECODERT_OPENVINO_CONFIG")
    for name in ("openvino-native", "openvino-sdpa", "openvino-paged"):
        _check_within_ties(int4_art, PROMPTS, name=name)


def test_no_phase_on_ort_releases_its_sessions(ov_runtime, int4_art, monkeypatch):
    """Prefill on openvino-paged and decode on native-cpu: nothing runs on the ort sessions, so they are closed (the
    int4 weights are not held a third time); every row's tokens in a batch are its tokens alone, speculation keeps
    them and verifies on the C step; placing a phase back on ort opens them again, with the same tokens."""
    from decodert.runtime.backends import native

    if native.build.refusal():
        pytest.skip(native.build.refusal())
    monkeypatch.delenv("DECODERT_OPENVINO_CONFIG")
    llm = LLM.load(int4_art, placement={"prefill": "openvino-paged", "decode": "native-cpu"}, prefix_cache_mb=0)
    be = llm.backend
    assert "ort" not in be.phase_sessions and not be.sessions
    text = ["one two three four one two three four one two three", *PROMPTS]
    alone = [_greedy(llm, [p], 32)[0] for p in text]
    assert _greedy(llm, text, 32) == alone
    assert _greedy(llm, text, 32, speculative="ngram") == alone
    be.place("decode", "ort")
    assert "ort" in be.phase_sessions and be.sessions["prefill"] is be.sessions["decode"]
    ort_decode = [_greedy(llm, [p], 32)[0] for p in text]
    llm.close()
    on_ort = LLM.load(int4_art, placement={"prefill": "openvino-paged", "decode": "ort"}, prefix_cache_mb=0)
    assert "ort" in on_ort.backend.phase_sessions
    assert [_greedy(on_ort, [p], 32)[0] for p in text] == ort_decode
    on_ort.close()


def _check_within_ties(art, prompts, n=24, name="openvino"):
    plain = LLM.load(art, placement="off", prefix_cache_mb=0)
    placed = LLM.load(art, placement={"prefill": name}, prefix_cache_mb=0)
    for prompt in prompts:
        want, got = _greedy(plain, [prompt], n)[0], _greedy(placed, [prompt], n)[0]
        if want != got:
            i = next(j for j, (a, b) in enumerate(zip(want, got)) if a != b)
            ids = np.array(plain.tokenizer.encode(prompt, add_special_tokens=False).ids + want[:i], np.int64)
            cache = plain.backend.allocate(1)
            logits = plain.backend.prefill(cache, [0], [ids], True).logits[0]
            assert logits[want[i]] - logits[got[i]] <= placement.TIE, (prompt, i, want, got)
    plain.close()
    placed.close()


@pytest.mark.slow
def test_smollm2_on_openvino(ov, smollm2_gguf, tmp_path, monkeypatch):
    """The real model as users get it: fp32 (OpenVINO in f32) the same greedy tokens; int4 (OpenVINO's own default
    precision, bf16 on an AMX CPU) within ties."""
    from decodert.export.quantize.quant import QuantConfig

    monkeypatch.delenv("DECODERT_OPENVINO_CONFIG")
    texts = ["The capital of France is", "Write a short poem about the sea and the wind.", "def fib(n):"]
    fp32 = tmp_path / "fp32"
    export_model(smollm2_gguf, fp32, target="ort", max_seq=1024, max_batch=2, openvino_prefill=True, progress=False)
    plain = LLM.load(fp32, placement="off", prefix_cache_mb=0)
    want = [_greedy(plain, [t], 32)[0] for t in texts]
    for name in ("openvino", "openvino-native", "openvino-sdpa", "openvino-paged"):
        placed = LLM.load(fp32, placement={"prefill": name}, prefix_cache_mb=0)
        assert [_greedy(placed, [t], 32)[0] for t in texts] == want, name
        placed.close()
    plain.close()
    int4 = tmp_path / "int4"
    export_model(smollm2_gguf, int4, target="ort", max_seq=1024, max_batch=2, openvino_prefill=True, progress=False,
                 quant=QuantConfig(bits=4, accuracy_level=4))
    _check_within_ties(int4, texts, 32)
    _check_within_ties(int4, texts, 32, name="openvino-native")
    _check_within_ties(int4, texts, 32, name="openvino-sdpa")
    _check_within_ties(int4, texts, 32, name="openvino-paged")


def test_without_the_package_one_info_line(tiny_arts, monkeypatch, capsys):
    from decodert.runtime.backends.openvino import ep, native

    monkeypatch.setattr(ep, "provider", lambda: None)
    monkeypatch.setattr(native, "available", lambda: False)
    monkeypatch.setattr(placement, "_noted", [])
    llm = LLM.load(tiny_arts["ov"], placement="auto")
    assert llm.backend.placement.source == "single" and llm.backend.placed["prefill"] == "ort"
    llm.close()
    LLM.load(tiny_arts["ov"], placement="auto").close()
    assert capsys.readouterr().err.count("OpenVINO is not installed") == 1
    assert os.environ.get("DECODERT_OPENVINO_CONFIG") is None


@pytest.mark.parametrize("family, reason", [("lfm2", "per-layer states"), ("qwen3_moe", "mixture-of-experts")])
def test_hybrid_and_moe_stay_on_ort_with_the_reason(tiny_checkpoint, tmp_path, family, reason):
    """Kinds OpenVINO was not checked on: no OpenVINO candidate, whatever is installed; the reason is recorded."""
    art = tmp_path / family
    export_model(tiny_checkpoint(family), art, target="ort", max_seq=128, max_batch=2, progress=False)
    m = load_manifest(art)
    assert reason in placement.openvino_refusal(m, "openvino-native")
    assert placement.candidates(m) == {"prefill": ["ort"], "decode": ["ort"]}
    llm = LLM.load(art, placement="auto")
    assert llm.backend.placement.source == "single" and not (art / placement.FILE).exists()
    llm.close()


def test_a_vision_model_stays_on_ort_with_the_reason(tmp_path):
    from tiny_gemma3_vision import make_tiny_gemma3_vlm

    art = tmp_path / "vlm"
    export_model(make_tiny_gemma3_vlm(tmp_path / "hf"), art, target="ort", max_seq=128, max_batch=2, progress=False)
    m = load_manifest(art)
    assert "image inputs" in placement.openvino_refusal(m, "openvino-native")
    assert placement.candidates(m)["prefill"] == ["ort"]
