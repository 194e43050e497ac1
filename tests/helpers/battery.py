"""The checks every family's tiny checkpoint runs, written once (test-only helper).

A family's test file declares its entries and the checks that apply to it, by the classes it lists:

    class TestBattery(battery.Parity, battery.Runtime, battery.TrtBuild, battery.TrtEmulator):
        entries = (Family("lfm2", max_seq=160, lengths=(11, 5, 1)),)

and pytest collects those checks in that file, one item per entry (and per target, quantization or case).
Adding a family is adding one test file. The checks:

- ``Parity``: every target's fp32 artifact against transformers: teacher-forced logits of one row and of a
  ragged batch, greedy tokens of the batch and of each row alone.
- ``Runtime`` (the ort artifact): continuous batching over more requests than slots; speculative == plain
  (n-gram and a fixed draft, alone and batched, and on into max_seq); a session's turns == re-prefill.
- ``TrtBuild``: the fp16 trt export (and each quantization the entry lists) built by TensorRT-RTX: each
  engine's io is the manifest's graph's, its record what the build returned, K and V written by the K/V
  layers only; then the entry's own ``trt_layers`` check of the engines.
- ``TrtEmulator``: the trt backend (tests/helpers/trt_emulator.py runs the engines' graphs on the CPU)
  gives the ort backend's tokens: single requests, an uneven batch, fixed-width speculation (without a replay
  prefill where the states allow).
- ``States`` (hybrids): the manifest's layer kinds, K/V layers, states and their io names, the ops of each
  target's graphs; the ort backend's states written in place by the graph.
- ``Refused``: config edits that export refuses in one line.
- ``LlamaCppGguf``: the GGUF llama.cpp's converter writes (the entry's ``gguf`` writer) exports to
  transformers' logits, and llama.cpp (llama-cpp-python) reads it as transformers' model.

Checkpoints, transformers models and fp32 exports are made once per session (``Artifacts``, the
``family_artifacts`` fixture of tests/conftest.py) and shared with the families' own tests.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from parity import backend, decodert_greedy, hf_reference, logits_parity, random_prompts

TOL = 1e-4  # max|diff| / max|ref| of the logits, every check against transformers
TARGETS = ("ort", "trt", "portable")
GROUNDED = ("Fix the spelling: 'The quick brown fox jumsp over the lazzy dog.' Corrected: "
            "'The quick brown fox jumps over the lazy dog.'")


@dataclass(frozen=True, eq=False)
class Family:
    """One battery entry: a tiny checkpoint (tests/helpers/tiny.py) and what its checks need to know."""

    name: str  # the items' id; the tiny config unless ``tiny`` names another
    tiny: str = ""
    overrides: dict[str, Any] = field(default_factory=dict)  # config fields over the tiny config
    max_seq: int = 128  # of the shared fp32 exports (max_batch 4)
    targets: tuple[str, ...] = TARGETS  # Parity's
    lengths: tuple[int, ...] = (11, 4, 7)  # Parity's prompts (random ids, ``seed``)
    steps: int = 16  # Parity's decode steps (greedy tokens: steps + 1)
    seed: int = 0
    drafts_hit: bool = True  # Runtime: some n-gram drafts are accepted (False: the tiny model's greedy text repeats none)
    trt_quants: tuple[Any, ...] = (None,)  # TrtBuild's: None (fp16 weights) or a QuantConfig
    trt_layers: Callable[[dict, Any, Any], None] | None = None  # (engines, manifest, quant): the family's own check
    emulator: str = "fp32"  # TrtEmulator: fp32 (the shared trt export, against the ort one), fp16 (its own), "": not run
    replays: bool = False  # TrtEmulator: a rejected draft replays the accepted tokens (recurrent states: no windows)
    kinds: tuple[str, ...] = ()  # States: the manifest's layer kinds
    kv_layers: tuple[int, ...] = ()  # States: the layers that keep K/V
    states: tuple[tuple[int, str, tuple], ...] = ()  # States: (layer, name, shape) in graph io order
    ops: tuple[tuple[str, str, frozenset, frozenset], ...] = ()  # States: (target, graph, ops present, ops absent)
    refused: tuple[tuple[dict[str, Any], str], ...] = ()  # Refused: (config edits (None: drop the key), message)
    gguf: Callable[[Path, Path], Path] | None = None  # LlamaCppGguf: (checkpoint, path) -> the GGUF written
    gguf_overrides: dict[str, Any] = field(default_factory=dict)  # the GGUF's checkpoint, over ``overrides``
    llama_cpp_tol: float = 1e-3  # LlamaCppGguf: llama.cpp's logits against transformers', relative

    @property
    def checkpoint(self) -> str:
        return self.tiny or self.name


class Artifacts:
    """Tiny checkpoints, their transformers models and fp32 exports, each made once per session."""

    def __init__(self, tiny_checkpoint: Callable[..., Path], tmp_path_factory: Any) -> None:
        self._checkpoint, self._tmp = tiny_checkpoint, tmp_path_factory
        self._models: dict[tuple, Any] = {}
        self._exports: dict[tuple, Path] = {}

    def source(self, entry: Family, **extra: Any) -> Path:
        """The entry's HF checkpoint (``extra``: config fields over its overrides)."""
        return self._checkpoint(entry.checkpoint, **{**entry.overrides, **extra})

    def model(self, entry: Family, **extra: Any) -> Any:
        """transformers' float32 model of ``source(entry, **extra)``, in eval mode."""
        import torch
        from transformers import AutoModelForCausalLM

        src = self.source(entry, **extra)
        if src not in self._models:
            self._models[src] = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        return self._models[src]

    def artifact(self, entry: Family, target: str) -> Path:
        """The entry's fp32 export for ``target`` (max_seq ``entry.max_seq``, max_batch 4)."""
        from decodert.export.pipeline import export_model

        src = self.source(entry)
        key = (src, target, entry.max_seq)
        if key not in self._exports:
            out = self._tmp.mktemp(f"{entry.name}-{target}") / "artifact"
            export_model(src, out, target=target, dtype="fp32", max_seq=entry.max_seq, max_batch=4, progress=False)
            self._exports[key] = out
        return self._exports[key]


def checks(argnames: str, rows: Callable[[tuple[Family, ...]], list]) -> Callable:
    """Mark a battery check: ``rows(entries)`` gives its parameter sets (``pytest.param``) for ``argnames``."""
    def mark(fn: Callable) -> Callable:
        fn.battery_rows = (argnames, rows)
        return fn
    return mark


def each(entries: tuple[Family, ...]) -> list:
    return [pytest.param(e, id=e.name) for e in entries]


def _quant_id(quant: Any) -> str:
    return "fp16" if quant is None else f"int{quant.bits}-b{quant.block_size}{'-sym' if quant.symmetric else ''}"


class Battery:
    """What every check class shares: its items are parametrized over the ``entries`` of the test class."""

    entries: tuple[Family, ...] = ()

    def pytest_generate_tests(self, metafunc: Any) -> None:
        argnames, rows = getattr(metafunc.function, "battery_rows", (None, None))
        if argnames is None:
            return
        params = rows(self.entries)
        if not params:
            raise ValueError(f"{type(self).__name__} in {metafunc.module.__name__} takes {metafunc.function.__name__} "
                             "but none of its entries declares what that check needs")
        metafunc.parametrize(argnames, params)


# ---- the checks --------------------------------------------------------------------------------------------------
class Parity(Battery):
    @checks("entry,target", lambda es: [pytest.param(e, t, id=f"{e.name}-{t}") for e in es for t in e.targets])
    def test_logits_and_greedy_match_transformers(self, family_artifacts, entry, target):
        """Teacher-forced logits (one row, then a ragged batch) and greedy tokens (the batch, each row alone)."""
        out, model = family_artifacts.artifact(entry, target), family_artifacts.model(entry)
        prompts = random_prompts(entry.lengths, entry.seed, vocab=model.config.vocab_size)
        refs = [hf_reference(model, p, entry.steps + 1) for p in prompts]
        assert logits_parity(out, refs[:1], prompts[:1], steps=entry.steps) < TOL  # batch 1
        assert logits_parity(out, refs, prompts, steps=entry.steps) < TOL  # ragged batch, rows right-padded
        be, want = backend(out), [toks for toks, _ in refs]
        assert decodert_greedy(be, prompts, entry.steps + 1) == want
        assert [decodert_greedy(be, [p], entry.steps + 1)[0] for p in prompts] == want  # the uneven batch = singles


class Runtime(Battery):
    @checks("entry", each)
    def test_continuous_batching_equals_singles(self, family_artifacts, entry):
        """More requests (5) than slots (4): rows finish at different steps, new ones take their slots (and their
        states, in hybrids); every request's tokens equal its single run's."""
        from decodert.runtime.decoding.sampling import SamplingParams
        from decodert.runtime.llm import LLM, Request

        rng = np.random.default_rng(7)
        ps = [rng.integers(3, 512, n) for n in (3, 70, 8, 1, 12)]
        lens = (9, 4, 14, 6, 3)
        with LLM.load(family_artifacts.artifact(entry, "ort"), backend="ort") as llm:
            singles = [llm.generate(p, max_new_tokens=n, temperature=0).token_ids for p, n in zip(ps, lens)]
            got = llm.generate_many([Request(p, SamplingParams(max_new_tokens=n, temperature=0))
                                     for p, n in zip(ps, lens)])
        assert [r.token_ids for r in got] == singles

    @checks("entry", each)
    def test_speculative_equals_plain(self, family_artifacts, entry):
        """Greedy speculative tokens are the plain greedy ones: n-gram drafts alone and batched, a fixed-width draft
        over five rows (four slots), and into max_seq (or eos) with the finish reason."""
        from decodert.runtime.decoding.sampling import SamplingParams
        from decodert.runtime.llm import LLM, Request
        from decodert.runtime.speculation.speculative import SpeculativeConfig

        with LLM.load(family_artifacts.artifact(entry, "ort"), backend="ort") as llm:
            rng = np.random.default_rng(4)
            vocab = llm.backend.vocab_size
            ps = [llm.encode("Hello world! How are you today?"), llm.encode(GROUNDED), np.tile(rng.integers(3, vocab, 6), 4),
                  rng.integers(3, vocab, 9), np.tile(rng.integers(3, vocab, 3), 5)]
            plain = [llm.generate(p, max_new_tokens=48).token_ids for p in ps]
            assert [llm.generate(p, max_new_tokens=48, speculative="ngram").token_ids for p in ps] == plain
            ngram = llm.generate_many([Request(p, SamplingParams(max_new_tokens=48), speculative="ngram") for p in ps])
            assert [r.token_ids for r in ngram] == plain
            fixed = SpeculativeConfig(adaptive=False, draft_len=6)
            batch = llm.generate_many([Request(p, SamplingParams(max_new_tokens=48), speculative=fixed) for p in ps])
            assert [r.token_ids for r in batch] == plain
            if entry.drafts_hit:
                assert max(r.metrics.accepted_per_step for r in batch) > 1.0  # some drafts were accepted
            tail = [llm.generate(p, max_new_tokens=200, speculative=fixed) for p in ps[2:]]  # into max_seq (or eos)
            want = [llm.generate(p, max_new_tokens=200) for p in ps[2:]]
        assert [(r.token_ids, r.finish_reason) for r in tail] == [(r.token_ids, r.finish_reason) for r in want]

    @checks("entry", each)
    def test_session_turns_equal_reprefill(self, family_artifacts, entry):
        """Each session turn's tokens equal a full re-prefill of the conversation so far."""
        from decodert.runtime.llm import LLM

        with LLM.load(family_artifacts.artifact(entry, "ort"), backend="ort") as llm:
            session = llm.session(system="be brief")
            for question in ("Hello world!", "How are you today?", "The quick brown fox"):
                r = session.chat(question, max_new_tokens=8)
                again = llm.generate(llm.prepare(session.history[:-1], chat=True).ids, max_new_tokens=8)
                assert r.token_ids == again.token_ids


class TrtBuild(Battery):
    @pytest.mark.trt
    @checks("entry,quant", lambda es: [pytest.param(e, q, id=f"{e.name}-{_quant_id(q)}") for e in es
                                        for q in e.trt_quants])
    def test_trt_engines_build_with_tensorrt_rtx(self, family_artifacts, entry, quant, tmp_path):
        """fp16 (TensorRT-RTX's precision; the weights int4 where ``quant`` says) engines of every graph."""
        pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX not installed")
        from decodert.export import trt_build
        from decodert.artifact.manifest import load_manifest
        from decodert.export.pipeline import export_model

        out = tmp_path / "trt"
        export_model(family_artifacts.source(entry), out, target="trt", dtype="fp16", max_seq=64, max_batch=2,
                     progress=False, quant=quant)
        engines = trt_build.build_engines(out, progress=False)
        m = load_manifest(out)
        assert {"prefill", "decode"} <= set(engines)
        for name, rec in engines.items():
            trt_build.check_io(rec.io, m.graphs[name], name)
            assert m.engines[name] == rec, name  # what build_engines returns is what the manifest records
            assert rec.layers["KV_CACHE_UPDATE"] == 2 * m.kv.num_layers, (name, rec.layers)  # K and V, K/V layers only
        if entry.trt_layers is not None:
            entry.trt_layers(engines, m, quant)


def attention_engines(engines: dict, m: Any, quant: Any) -> None:
    """Attention-only families: RoPE on every layer's q and k, and TensorRT's attention layer on each, except
    where it cannot go (soft-capping: the decomposed body)."""
    layers = m.model.num_layers
    for name, rec in engines.items():
        assert rec.layers["ROTARY_EMBEDDING"] == 2 * layers, (name, rec.layers)
        if m.model.spec().attention.softcap is None:
            assert rec.layers["ATTENTION_INPUT"] == layers, (name, rec.layers)
        else:  # TensorRT's attention layer has no soft-capping
            assert "ATTENTION_INPUT" not in rec.layers, (name, rec.layers)


def recurrent_engines(engines: dict, m: Any, quant: Any) -> None:
    """Hybrids with a recurrent state: it stays float32 in the fp16 engines, and prefill's token loop became a
    TensorRT loop."""
    assert {(s.name, s.dtype) for s in m.kv.states} == {("conv", None), ("recurrent", "fp32")}
    assert any("LOOP" in kind or "RECURRENCE" in kind for kind in engines["prefill"].layers), engines["prefill"].layers


class TrtEmulator(Battery):
    @checks("entry", lambda es: each(tuple(e for e in es if e.emulator)))
    def test_trt_backend_on_the_emulator(self, family_artifacts, entry, tmp_path, monkeypatch):
        """The trt backend binds the cache (K/V and states) in its own buffers: the ort backend's greedy tokens for
        single requests, an uneven batch (rows end, slots move) and fixed-width speculation at batch 2, whose
        rejections take their states from the verify pass (no replay prefill) unless ``entry.replays``."""
        import trt_emulator

        from decodert.export.pipeline import export_model
        from decodert.runtime.decoding.sampling import SamplingParams
        from decodert.runtime.llm import LLM, Request
        from decodert.runtime.speculation.speculative import SpeculativeConfig

        if entry.emulator == "fp16":  # TensorRT's precision; the reference: the same graphs on the ort backend
            art = ref = tmp_path / "fp16"
            export_model(family_artifacts.source(entry), art, target="trt", dtype="fp16", max_seq=64, max_batch=2,
                         progress=False)
        else:  # the shared fp32 trt export (a copy: the emulated engines are written into it), against the ort one
            art, ref = shutil.copytree(family_artifacts.artifact(entry, "trt"), tmp_path / "trt"), \
                family_artifacts.artifact(entry, "ort")
        trt_emulator.emulate_engines(art)
        trt_emulator.install(monkeypatch)
        rng = np.random.default_rng(2)
        ps = [np.tile(rng.integers(3, 512, 5), 3), rng.integers(3, 512, 9), rng.integers(3, 512, 2)]
        with LLM.load(ref, backend="ort") as reference, LLM.load(art, backend="trt") as llm:
            want = [reference.generate(p, max_new_tokens=20, temperature=0).token_ids for p in ps]
            assert [llm.generate(p, max_new_tokens=20, temperature=0).token_ids for p in ps] == want
            uneven = [SamplingParams(max_new_tokens=n, temperature=0) for n in (20, 5, 12)]
            got = llm.generate_many([Request(p, sp) for p, sp in zip(ps, uneven)])
            assert [r.token_ids for r in got] == [w[: sp.max_new_tokens] for w, sp in zip(want, uneven)]
            fixed = SpeculativeConfig(adaptive=False, draft_len=6)
            reqs = [Request(p, SamplingParams(max_new_tokens=20, temperature=0), speculative=fixed) for p in ps[:2]]
            prefills, real = [], llm.backend.prefill
            llm.backend.prefill = lambda cache, slots, ids, want_logits: prefills.append(len(slots)) or real(
                cache, slots, ids, want_logits)
            assert [r.token_ids for r in llm.generate_many(reqs)] == want[:2]
            assert llm.backend.stats["verify_runs"] > 0
            if not entry.replays:  # the prompts only: K/V rewinds, conv states come from the pass's windows
                assert sum(prefills) == 2, prefills


class States(Battery):
    @checks("entry", lambda es: each(tuple(e for e in es if e.states)))
    def test_manifest_records_kinds_and_state_shapes(self, family_artifacts, entry):
        """The layer kinds, the K/V layers, every state's layer, name and shape in io order, their graph inputs
        (and no K/V for the layers without), and the ops each target lowers the layers to."""
        import onnx

        from decodert.artifact.manifest import load_manifest

        m = load_manifest(family_artifacts.artifact(entry, "ort"))
        assert m.kv.layer_kinds == entry.kinds and m.kv.layers == entry.kv_layers
        assert m.kv.num_layers == len(entry.kv_layers)
        assert [(s.layer, s.name, s.shape) for s in m.kv.states] == list(entry.states)
        names = {t.name for t in m.graphs["decode"].inputs}
        assert {f"past_{name}.{layer}" for layer, name, _ in entry.states} <= names
        assert {n for n in names if n.startswith("past_key.")} == {f"past_key.{i}" for i in entry.kv_layers}
        for target, graph, present, absent in entry.ops:
            path = family_artifacts.artifact(entry, target) / f"{graph}.onnx"
            ops = {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}
            assert present <= ops and not ops & absent, (target, graph, present - ops, ops & absent)

    @checks("entry", lambda es: each(tuple(e for e in es if e.states)))
    def test_ort_binds_the_states_in_place(self, family_artifacts, entry):
        """The ort backend's state buffers [rows, ...] are the graph's outputs, written in place for every row."""
        be = backend(family_artifacts.artifact(entry, "ort"))
        cache = be.allocate(2)
        be.prefill(cache, [0, 1], random_prompts((7, 3)), want_logits=False)
        assert [s.shape for s in cache.states] == [(2, *shape[1:]) for _, _, shape in entry.states]
        assert all(np.abs(s[r]).max() > 0 for s in cache.states for r in (0, 1))


class Refused(Battery):
    @checks("entry,edits,match", lambda es: [pytest.param(e, edits, match, id=f"{e.name}-{i}") for e in es
                                             for i, (edits, match) in enumerate(e.refused)])
    def test_what_export_cannot_map_is_one_line(self, family_artifacts, entry, edits, match, tmp_path):
        from decodert.errors import DecodertError
        from decodert.export.pipeline import export_model

        src = shutil.copytree(family_artifacts.source(entry), tmp_path / "m")
        config = json.loads((src / "config.json").read_text())
        for key, value in edits.items():
            config.pop(key, None) if value is None else config.__setitem__(key, value)
        (src / "config.json").write_text(json.dumps(config))
        with pytest.raises(DecodertError, match=match) as e:
            export_model(src, tmp_path / "out", max_seq=32, progress=False)
        assert "\n" not in str(e.value)


class LlamaCppGguf(Battery):
    @checks("entry", lambda es: each(tuple(e for e in es if e.gguf)))
    def test_gguf_as_llama_cpp_writes_it_exports_to_transformers_logits(self, family_artifacts, entry, tmp_path):
        from decodert.artifact.manifest import load_manifest
        from decodert.export.pipeline import export_model

        src, model = family_artifacts.source(entry, **entry.gguf_overrides), family_artifacts.model(entry, **entry.gguf_overrides)
        path = entry.gguf(src, tmp_path / f"tiny-{entry.name}.gguf")
        prompt = random_prompts((13,), seed=3)[0]
        out = tmp_path / "out"
        export_model(path, out, target="ort", dtype="fp32", max_seq=32, max_batch=1, progress=False)
        if entry.kinds:
            assert load_manifest(out).kv.layer_kinds == entry.kinds
        assert logits_parity(out, [hf_reference(model, prompt, 9)], [prompt], steps=8) < TOL

    @checks("entry", lambda es: each(tuple(e for e in es if e.gguf)))
    def test_llama_cpp_reads_the_gguf_as_transformers_model(self, family_artifacts, entry, tmp_path):
        """llama.cpp itself (llama-cpp-python) gives transformers' logits on the file: the layout and metadata are
        llama.cpp's, not only decodert's reading of them."""
        llama_cpp = pytest.importorskip("llama_cpp")
        import torch

        src, model = family_artifacts.source(entry, **entry.gguf_overrides), family_artifacts.model(entry, **entry.gguf_overrides)
        path = entry.gguf(src, tmp_path / f"tiny-{entry.name}.gguf")
        prompt = random_prompts((13,), seed=3)[0]
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2,
                              type_k=0, type_v=0)  # an F32 KV cache (its default F16 moves logits by 1e-3)
        llm.eval(list(map(int, prompt)))
        with torch.no_grad():
            want = model(torch.tensor([list(map(int, prompt))])).logits[0, -1].numpy()
        assert np.abs(np.asarray(llm.scores[len(prompt) - 1]) - want).max() < entry.llama_cpp_tol * np.abs(want).max()
