"""Reliability and security: integrity checks, no code execution from files, resource limits,
threads, Ctrl-C, atomic artifacts and a short soak (docs/RELIABILITY.md)."""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import re
import shutil
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import onnx
import pytest

from fake_backend import FakeBackend, make_llm, reference_tokens  # noqa: E402
from fuzz_samples import add_listed_file, flip_byte  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.artifact.artifact_files import file_record  # noqa: E402
from decodert.artifact.manifest import load_manifest, write_manifest  # noqa: E402
from decodert.runtime.llm import LLM, Request  # noqa: E402
from decodert.runtime.decoding.sampling import SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


# -- no code execution from files ------------------------------------------------------------------
FORBIDDEN = re.compile(r"\bpickle\b|\beval\(|\bexec\(|torch\.load|yaml\.load|allow_pickle\s*=\s*True")


def package_files(root: Path) -> list[Path]:
    """The installed package's sources: top-level modules + the sub-packages pyproject.toml lists."""
    import tomllib

    packages = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    folders = [root / p.split(".", 1)[1].replace(".", "/") for p in packages if "." in p]
    return sorted(root.glob("*.py")) + sorted(f for d in folders for f in d.rglob("*.py"))


def forbidden_uses(root: Path) -> list[str]:
    hits = []
    for path in package_files(root):
        rel = path.relative_to(root)
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if FORBIDDEN.search(line):
                hits.append(f"{rel}:{n}: {line.strip()}")
    return hits


def test_package_source_has_no_pickle_eval_exec(tmp_path):
    planted = tmp_path / "pkg"
    for folder in ("tests", "sub/deep"):
        (planted / folder).mkdir(parents=True)
    (planted / "pyproject.toml").write_text('[tool.setuptools]\npackages = ["pkg", "pkg.sub"]\n')
    (planted / "bad.py").write_text("import pickle\nx = eval('1')\n")
    (planted / "sub" / "deep" / "worse.py").write_text("exec(code)\ntorch.load(f)\n")
    (planted / "tests" / "ok.py").write_text("import pickle\n")
    assert len(forbidden_uses(planted)) == 4  # the scan finds what it must, and skips tests/
    assert len(package_files(ROOT)) > 40
    assert forbidden_uses(ROOT) == []


@pytest.mark.parametrize("template", ["{{ cycler.__init__.__globals__.os.popen('id').read() }}",
                                      "{{ ''.__class__.__mro__[1].__subclasses__() }}",
                                      "{{ self.__init__.__globals__ }}"])
def test_chat_templates_run_sandboxed(template):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from decodert.runtime.chat.chat import compile_template, render_chat

    assert isinstance(compile_template("{{ 1 }}").environment, ImmutableSandboxedEnvironment)
    with pytest.raises(DecodertError, match="unsafe|failed to render"):
        render_chat(template, [{"role": "user", "content": "hi"}])


def _point_external_data(graph: Path, location: str) -> None:
    model = onnx.load(str(graph), load_external_data=False)
    for t in model.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = location
    onnx.save_model(model, str(graph))


@pytest.mark.parametrize("location", ["../secret", "{abs}", "link.bin", "sub/../../secret"])
def test_external_data_outside_the_artifact_is_refused(art, tmp_path, location):
    from decodert.artifact.onnx_check import check_external_data

    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * (4 << 20))
    (art / "link.bin").symlink_to(secret)  # a symlink inside the folder that leads out of it
    _point_external_data(art / "prefill.onnx", location.format(abs=secret))
    with pytest.raises(DecodertError, match="outside the artifact folder"):
        check_external_data(art / "prefill.onnx")
    manifest = load_manifest(art, verify="none")
    # hashes agree: only the location is bad
    write_manifest(art, manifest.replace(files={**manifest.files, "prefill.onnx": file_record(art / "prefill.onnx")}))
    with pytest.raises(DecodertError, match="outside the artifact folder"):
        LLM.load(art, backend="ort", verify="full")


# -- integrity ----------------------------------------------------------------------------------
def test_verify_fast_full_none_name_the_damaged_file(art):
    blob = add_listed_file(art, "blob.bin", np.random.default_rng(0).bytes(3 << 20))
    flip_byte(blob, 3 << 19)  # middle: outside the first and last MiB
    LLM.load(art, verify="fast").close()
    LLM.load(art, verify="none").close()
    with pytest.raises(DecodertError, match=r"blob\.bin: sha256 does not match"):
        LLM.load(art, verify="full")
    flip_byte(blob, 10)  # first MiB: the fast check sees it
    with pytest.raises(DecodertError, match=r"blob\.bin: sha256 does not match"):
        LLM.load(art, verify="fast")
    with open(art / "weights.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(DecodertError, match=r"weights\.bin: size 100 does not match"):
        LLM.load(art)
    with pytest.raises(DecodertError, match="verify='quick'"):
        LLM.load(art, verify="quick")


@pytest.fixture
def trt_artifact(tmp_path):
    pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX not installed")
    import trt_graphs

    return trt_graphs.write_artifact(tmp_path / "trt", "fp16")


# -- resource limits ----------------------------------------------------------------------------
def test_kv_cache_too_big_is_refused_before_allocating(art, monkeypatch):
    from decodert.runtime.backends import memory

    llm = LLM.load(art)
    monkeypatch.setattr(memory, "available_bytes", lambda: 64 << 10)
    with pytest.raises(DecodertError, match=r"KV cache needs .* lower --max-seq or --max-batch"):
        llm.generate("hello", max_new_tokens=2)
    assert llm.engine.cache is None
    monkeypatch.setattr(memory, "available_bytes", lambda: 64 << 30)
    assert len(llm.generate("hello", max_new_tokens=2).token_ids) == 2


def test_tensors_larger_than_the_file_are_refused_before_allocating(samples, tmp_path):
    import struct

    from decodert.export.checkpoints.checkpoint_open import open_checkpoint
    from fuzz_harness import gguf_field

    hf = shutil.copytree(samples["hf"], tmp_path / "hf")
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "F32", "shape": [1 << 20, 1 << 20],
                                                       "data_offsets": [0, 1 << 42]}}).encode()
    (hf / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))
    gguf = tmp_path / "big.gguf"
    gguf.write_bytes(gguf_field(samples["gguf"].read_bytes(), ("dim 1 of tensor 'token_embd.weight'", 1 << 40)))
    for path, match in ((hf, "past the end of the file"), (gguf, "past the end of the file")):
        tracemalloc.start()
        with pytest.raises(DecodertError, match=match):
            open_checkpoint(path)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 32 << 20, peak


# -- threads ------------------------------------------------------------------------------------
class GuardedBackend(FakeBackend):
    """Fails loudly if two threads are ever inside the backend at once (each step sleeps a little)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.inside = threading.Lock()

    def _step(self, method, *args, **kw):
        assert self.inside.acquire(blocking=False), "two threads inside the backend at once"
        try:
            time.sleep(0.0005)
            return method(*args, **kw)
        finally:
            self.inside.release()

    def prefill(self, *args, **kw):
        return self._step(super().prefill, *args, **kw)

    def decode(self, *args, **kw):
        return self._step(super().decode, *args, **kw)


def _guarded_llm(**kw):
    llm = make_llm(**kw)
    llm.backend = GuardedBackend(vocab_size=llm.backend.vocab_size, max_seq=llm.backend.max_seq,
                                 max_batch=llm.backend.max_batch)
    return llm


def test_threads_share_one_llm_safely():
    llm = _guarded_llm(max_batch=2)
    prompts = ["hello world", "the quick brown fox", "a", "lazy dog", "héllo", "STOP here."]
    expected = [reference_tokens(llm.backend, llm.encode(p).tolist(), 12) for p in prompts]
    text = llm.generate(prompts[0], max_new_tokens=12).text
    calls = [lambda p=p: llm.generate(p, max_new_tokens=12).token_ids for p in prompts]
    calls += [lambda: [r.token_ids for r in llm.generate_many([Request(p, SamplingParams(max_new_tokens=12))
                                                               for p in prompts[:3]])]]
    calls += [lambda p=p: "".join(llm.stream(p, max_new_tokens=12)) for p in prompts[:2]]
    with cf.ThreadPoolExecutor(6) as pool:
        results = [f.result() for f in [pool.submit(c) for c in calls * 3]]
    n = len(calls)
    for k in range(3):
        assert results[k * n: k * n + len(prompts)] == expected
        assert results[k * n + len(prompts)] == expected[:3]
        assert results[k * n + len(prompts) + 1] == text
    assert llm.slots_in_use == 0 and not llm.engine.cache.lengths.any()


def test_another_threads_call_waits_for_an_open_stream():
    llm = make_llm()
    expected = reference_tokens(llm.backend, llm.encode("a").tolist(), 3)
    stream = llm.stream("hello", max_new_tokens=30)
    first = next(stream)
    with cf.ThreadPoolExecutor(1) as pool:
        other = pool.submit(lambda: llm.generate("a", max_new_tokens=3).token_ids)
        time.sleep(0.2)
        assert not other.done()  # waiting for the stream, not ending it
        rest = "".join(stream)
        assert other.result(timeout=10) == expected
    assert first + rest == llm.generate("hello", max_new_tokens=30).text
    llm.busy_timeout = 0.2
    stream = llm.stream("hello", max_new_tokens=30)
    next(stream)
    with cf.ThreadPoolExecutor(1) as pool:
        with pytest.raises(DecodertError, match="busy"):
            pool.submit(lambda: llm.generate("a", max_new_tokens=3)).result(timeout=10)
    llm.generate("a", max_new_tokens=3)  # the same thread: ends its own open stream (documented)
    assert list(stream) == [] and llm.slots_in_use == 0


# -- Ctrl-C -------------------------------------------------------------------------------------
def interrupt_on(backend, step: int) -> list[int]:
    """Make ``backend.decode`` raise KeyboardInterrupt on its ``step``-th call (once); returns the counter."""
    real, count = backend.decode, [0]

    def decode(*args, **kw):
        count[0] += 1
        if count[0] == step:
            raise KeyboardInterrupt
        return real(*args, **kw)

    backend.decode = decode
    return count


def _no_slot_held(llm):
    assert llm.slots_in_use == 0 and not np.asarray(llm.engine.cache.lengths).any()


def test_ctrl_c_in_the_decode_loop_leaves_the_llm_usable():
    llm = make_llm(max_batch=2)
    expected = reference_tokens(llm.backend, llm.encode("hello world").tolist(), 10)
    interrupt_on(llm.backend, 4)
    with pytest.raises(KeyboardInterrupt):
        llm.generate("hello world", max_new_tokens=10)
    _no_slot_held(llm)
    assert llm.generate("hello world", max_new_tokens=10).token_ids == expected
    reqs = [Request(p, SamplingParams(max_new_tokens=n)) for p, n in [("a", 9), ("lazy dog", 3), ("hello", 7), ("x", 5)]]
    singles = [llm.generate(r.prompt, max_new_tokens=r.params.max_new_tokens).token_ids for r in reqs]
    interrupt_on(llm.backend, 5)
    with pytest.raises(KeyboardInterrupt):
        llm.generate_many(reqs)
    _no_slot_held(llm)
    assert [r.token_ids for r in llm.generate_many(reqs)] == singles
    stream = llm.stream("hello world", max_new_tokens=10)
    interrupt_on(llm.backend, 3)
    with pytest.raises(KeyboardInterrupt):
        list(stream)
    _no_slot_held(llm)
    assert llm.generate("hello world", max_new_tokens=10).token_ids == expected


def test_ctrl_c_on_the_ort_backend(art):
    fresh = LLM.load(art).generate_many([Request("hello world", SamplingParams(max_new_tokens=12)),
                                         Request("the fox", SamplingParams(max_new_tokens=6))])
    llm = LLM.load(art)
    interrupt_on(llm.backend, 3)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["hello world", "the fox"], max_new_tokens=12)
    _no_slot_held(llm)
    again = llm.generate_many([Request("hello world", SamplingParams(max_new_tokens=12)),
                               Request("the fox", SamplingParams(max_new_tokens=6))])
    assert [r.token_ids for r in again] == [r.token_ids for r in fresh]
    _no_slot_held(llm)


# -- atomic artifacts ---------------------------------------------------------------------------
def _tree(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _interrupt(monkeypatch, module, name, when=lambda *a, **k: True):
    real = getattr(module, name)

    def fake(*args, **kwargs):
        if when(*args, **kwargs):
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, fake)


def _export_steps():
    from decodert.export.artifact import destination
    from decodert.export import pipeline

    return {"build_graph": (pipeline, "build_graph", lambda *a, **k: a[3] == "decode"),  # after weights.bin
            "write_manifest": (pipeline, "write_manifest", lambda *a, **k: True),
            "swap": (destination, "swap_in", lambda tmp, out: True)}  # the final swap (tests/export/test_destination.py: each rename)


@pytest.mark.parametrize("step", ["build_graph", "write_manifest", "swap"])
def test_interrupted_export_leaves_no_artifact_or_the_old_one(samples, tmp_path, monkeypatch, step):
    from decodert.export import pipeline

    out = tmp_path / "out"
    with monkeypatch.context() as m:
        _interrupt(m, *_export_steps()[step])
        with pytest.raises(KeyboardInterrupt):
            pipeline.export_model(samples["hf"], out, max_seq=64, max_batch=2, progress=False)
    assert list(tmp_path.iterdir()) == []  # no folder, no temp folder left behind
    pipeline.export_model(samples["hf"], out, max_seq=64, max_batch=2, progress=False)
    before = _tree(out)
    with monkeypatch.context() as m:
        _interrupt(m, *_export_steps()[step])
        with pytest.raises(KeyboardInterrupt):
            pipeline.export_model(samples["hf"], out, max_seq=128, max_batch=1, progress=False)
    assert _tree(out) == before and [p.name for p in tmp_path.iterdir()] == ["out"]
    assert LLM.load(out, verify="full").max_seq == 64


def test_interrupted_build_leaves_the_old_engines(trt_artifact, monkeypatch):
    from decodert.export import trt_build
    from decodert.plugins.trt.compat import load_trt, read_engine

    def interrupted_build():
        with monkeypatch.context() as m:
            _interrupt(m, trt_build, "build_one", lambda trt, info, out, name, *a: name == "decode")
            with pytest.raises(KeyboardInterrupt):
                trt_build.build_engines(trt_artifact, progress=False)

    before = _tree(trt_artifact)
    interrupted_build()
    assert _tree(trt_artifact) == before  # no engine, no staged file, manifest untouched
    trt_build.build_engines(trt_artifact, progress=False)
    built = _tree(trt_artifact)
    interrupted_build()
    assert _tree(trt_artifact) == built
    manifest = load_manifest(trt_artifact)
    for name in ("prefill", "decode"):
        read_engine(trt_artifact, manifest, name, load_trt()[1])


# -- soak (short): the full run is `python scripts/soak.py` --------------------------------------
def test_soak_short_memory_flat_and_no_slot_leaked(samples):
    cmd = [sys.executable, str(ROOT / "scripts" / "soak.py"), "--artifact", str(samples["art"]), "--tokens", "2000",
           "--max-new-tokens", "200", "--requests", "40", "--rounds", "2", "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    report = json.loads(res.stdout)
    tokens, batching = report["tokens_phase"], report["batching_phase"]
    assert tokens["tokens"] >= 2000 and tokens["rss_growth"] < 0.05, tokens
    assert batching["slots"] == 2 and batching["finished"] == 80, batching
    assert batching["slots_in_use_after"] == [0, 0] and batching["cache_lengths_after"] == [[0, 0]] * 2, batching
    assert batching["rss_growth_after_round_1"] < 0.05, batching
    assert res.returncode == 0 and report["ok"]
