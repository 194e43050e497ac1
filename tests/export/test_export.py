"""Export: greedy parity over 64 tokens, the graphs and the manifest, each target's ops, plugins, the CLI's bad inputs,
atomic replacement; the real SmolLM2 GGUF against transformers (every tiny family x target: the battery,
tests/helpers/battery.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import onnx
import pytest

from decodert.cli import main as cli_main
from decodert.artifact.manifest import load_manifest
from decodert.export.pipeline import export_model
from battery import Family
from parity import backend, decodert_greedy, hf_reference, logits_parity, random_prompts

TARGETS = ("ort", "trt", "portable")
TOL = 1e-4


@pytest.fixture(scope="module")
def exported(family_artifacts):
    """(family, target) -> (its fp32 export, max_seq 128, max_batch 4; transformers' model): the battery's."""
    def get(family: str, target: str):
        entry = Family(family)
        return family_artifacts.artifact(entry, target), family_artifacts.model(entry)

    return get


@pytest.mark.parametrize("target", TARGETS)
def test_tiny_greedy_64_and_batched_equals_single(exported, target):
    out, model = exported("llama", target)
    prompts = random_prompts((5, 12, 8), 3, vocab=model.config.vocab_size)
    be = backend(out)
    batched = decodert_greedy(be, prompts, 64)
    for p, row in zip(prompts, batched):
        assert decodert_greedy(be, [p], 64)[0] == row
        assert hf_reference(model, p, 64)[0] == row


@pytest.mark.parametrize("target", TARGETS)
def test_graphs_check_and_manifest(exported, target):
    out, _ = exported("qwen3", target)
    m = load_manifest(out, verify="full")
    assert m.target == target and m.kv.inplace is True
    for kind in ("prefill", "decode"):
        onnx.checker.check_model(str(out / m.graphs[kind].file), full_check=True)
        graph = onnx.load(str(out / m.graphs[kind].file), load_external_data=False).graph
        assert [i.name for i in graph.input] == [i.name for i in m.graphs[kind].inputs]
        assert [o.name for o in graph.output] == [o.name for o in m.graphs[kind].outputs]
        # both graphs share weights.bin; nothing is embedded twice
        locations = {e.value for t in graph.initializer for e in t.external_data if e.key == "location"}
        assert locations == {"weights.bin"}
    assert set(m.files) >= {"prefill.onnx", "decode.onnx", "weights.bin", "tokenizer.json"}


def test_target_ops(exported):
    """Each target lowers attention and norms to the ops it promises."""
    expect = {"ort": {"GroupQueryAttention", "SkipSimplifiedLayerNormalization"},
              # fp32: TensorRT has no fp32 Attention kernel, so the trt graph decomposes attention
              "trt": {"TensorScatter", "RotaryEmbedding", "RMSNormalization", "Softmax"},
              "portable": {"ScatterND", "Softmax"}}
    for target, ops in expect.items():
        out, _ = exported("llama", target)
        graph = onnx.load(str(out / "decode.onnx"), load_external_data=False).graph
        used = {n.op_type for n in graph.node}
        assert ops <= used, (target, ops - used)
        if target == "portable":
            assert {n.domain for n in graph.node} == {""}
        if target == "trt":
            assert "Attention" not in used


def test_trt_fp16_uses_the_attention_op(tiny_checkpoint, tmp_path):
    export_model(tiny_checkpoint("llama"), tmp_path / "a", target="trt", dtype="fp16", max_seq=32, progress=False)
    graph = onnx.load(str(tmp_path / "a" / "decode.onnx"), load_external_data=False).graph
    assert {"Attention", "TensorScatter", "RotaryEmbedding"} <= {n.op_type for n in graph.node}


def test_plugin_export_runs_on_onnx_runtime(exported, tiny_checkpoint, tmp_path):
    """A --plugins always artifact (decodert::CachedAttention nodes) runs through OrtBackend as is."""
    _, model = exported("llama", "trt")
    out = tmp_path / "plug"
    export_model(tiny_checkpoint("llama"), out, target="trt", max_seq=64, progress=False, plugins="always")
    graph = onnx.load(str(out / "decode.onnx"), load_external_data=False).graph
    assert "CachedAttention" in {n.op_type for n in graph.node if n.domain == "decodert"}
    prompts = random_prompts((6, 3), vocab=model.config.vocab_size)
    assert logits_parity(out, [hf_reference(model, p, 5) for p in prompts], prompts, steps=4) < TOL


def test_export_cli_bad_inputs(tmp_path, tiny_checkpoint, capsys):
    out = tmp_path / "out"
    assert cli_main(["export", str(tmp_path / "missing"), "-o", str(out)]) == 2
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt_bigcode_xl"}))
    assert cli_main(["export", str(bad), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("decodert: error: ") for line in err)
    assert "unknown architecture" in err[1]
    src = tiny_checkpoint("llama")
    assert cli_main(["export", str(src), "-o", str(out), "--max-seq", "100000"]) == 2
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_export_replaces_artifact_atomically(tmp_path, tiny_checkpoint):
    src, out = tiny_checkpoint("llama"), tmp_path / "art"
    export_model(src, out, target="ort", max_seq=32, progress=False)
    export_model(src, out, target="portable", max_seq=32, progress=False)
    assert load_manifest(out).target == "portable"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(Exception, match="not a decodert artifact"):
        export_model(src, tmp_path / "other", progress=False)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


# ---- the real model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_exports(smollm2_gguf, tmp_path_factory):
    outs = {}
    for target in TARGETS:
        out = tmp_path_factory.mktemp(f"smollm2-{target}") / "artifact"
        export_model(smollm2_gguf, out, target=target, dtype="fp32", max_seq=256, max_batch=4, progress=False)
        outs[target] = out
    return outs


@pytest.mark.parametrize("target", TARGETS)
def test_smollm2_logits_and_greedy_match_transformers(smollm2_exports, smollm2_reference, target):
    prompts, refs = smollm2_reference
    out = smollm2_exports[target]
    assert logits_parity(out, refs, prompts, steps=16) < TOL  # ragged batch of 3
    batched = decodert_greedy(backend(out), prompts, 64)
    assert batched == [toks for toks, _ in refs]  # greedy 64, every row
    assert decodert_greedy(backend(out), prompts[1:2], 64)[0] == batched[1]  # batched == single


def test_smollm2_export_streams_weights(smollm2_gguf, tmp_path):
    """Peak RSS of a whole export stays under 1.5x the fp32 weights it writes (not the model twice)."""
    out = tmp_path / "art"
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork+exec, so the child would report
    # the peak of this (large) pytest process instead of its own.
    code = ("import re, sys; from decodert.cli import main; "
            f"rc = main(['export', {str(smollm2_gguf)!r}, '-o', {str(out)!r}, '--max-seq', '256']); "
            "print(int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) * 1024); "
            "sys.exit(rc)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    peak = int(res.stdout.strip().splitlines()[-1])
    weights = load_manifest(out).weights.bytes
    assert weights > 500e6 and peak < 1.5 * weights, (peak / 2**20, weights / 2**20)
