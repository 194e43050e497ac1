"""`decodert build`: ONNX artifact -> TensorRT(-RTX) engines, and the TensorRT backend's CPU-side checks.

Builds run on CPU with TensorRT-RTX (no GPU needed); running engines needs a GPU (`-m gpu`).
Tiny graphs (tests/trt_graphs.py and tests/tiny.py checkpoints) build in well under a second each.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX not installed: pip install tensorrt-rtx-cu13-libs "
                    "tensorrt-rtx-cu13-bindings")

import trt_graphs  # noqa: E402  (tests/ is on sys.path via conftest)

from decodert.cli import main as cli_main  # noqa: E402
from decodert.errors import DecodertError  # noqa: E402
from decodert.export import trt_build  # noqa: E402
from decodert.export.artifact.artifact_files import file_record  # noqa: E402
from decodert.export.artifact.manifest import Manifest, load_manifest  # noqa: E402
from decodert.export.artifact.records import to_json  # noqa: E402
from decodert.plugins.trt.compat import engine_version_problem, load_trt, parse_version, read_engine  # noqa: E402
from decodert.plugins import cuda_mem  # noqa: E402
from decodert.runtime.backends.trt.engine import contiguous_runs, kv_pairs  # noqa: E402

pytestmark = pytest.mark.trt
gpu = pytest.mark.skipif(cuda_mem.gpu_count() == 0, reason="needs an NVIDIA GPU (cuda-python found none)")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """dtype -> a tiny trt-target artifact with its engines built (once per module)."""
    made: dict[str, Path] = {}

    def get(dtype: str) -> Path:
        if dtype not in made:
            out = trt_graphs.write_artifact(tmp_path_factory.mktemp(f"tiny-{dtype}"), dtype)
            trt_build.build_engines(out, progress=False)
            made[dtype] = out
        return made[dtype]

    return get


def copy_artifact(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def manifest_of(out: Path) -> dict:
    """manifest.json as written (plain JSON, to check or to damage on purpose)."""
    return json.loads((out / "manifest.json").read_text())


def typed_of(out: Path) -> Manifest:
    """The Manifest the runtime reads (export/artifact/manifest.py)."""
    return load_manifest(out, verify="none")


# ---------------------------------------------------------------- trt_compat
def test_load_trt_reports_rtx_capabilities():
    trt, info = load_trt()
    assert info.flavour == "tensorrt_rtx" and info.module_name == "tensorrt_rtx_bindings"
    assert info.version == parse_version(trt.__version__) and info.version >= (1, 7)
    assert info.can_build and info.has_kv_cache_update_layer and info.has_rotary_layer and info.has_attention_layer
    assert not info.weakly_typed_allowed  # RTX networks are always strongly typed
    assert not hasattr(trt.BuilderFlag, "FP16")
    assert not info.has_timing_cache and info.has_runtime_cache and info.has_aliased_io


def test_load_trt_errors_name_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ImportError
    with pytest.raises(DecodertError, match="pip install tensorrt-rtx-cu13-libs tensorrt-rtx-cu13-bindings"):
        load_trt("tensorrt")
    with pytest.raises(DecodertError, match="unknown TensorRT flavour"):
        load_trt("tensorflow")


def test_parse_version_and_engine_version_rules():
    _, info = load_trt()
    same = {"flavour": info.flavour, "version": info.version_str}
    assert parse_version("10.15.1.29") == (10, 15, 1, 29) and parse_version("1.7.1.116.post1") == (1, 7, 1, 116)
    assert engine_version_problem(same, info) is None
    older = {"flavour": info.flavour, "version": "1.6.0.12"}
    assert "1.6.0.12" in engine_version_problem(older, info) and info.version_str in engine_version_problem(older, info)
    assert engine_version_problem(older, info, version_compatible=True) is None
    newer = {"flavour": info.flavour, "version": "1.99.0.1"}
    assert engine_version_problem(newer, info, version_compatible=True) is not None
    assert "tensorrt 10.15.1" in engine_version_problem({"flavour": "tensorrt", "version": "10.15.1"}, info)


# ---------------------------------------------------------------- building
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_build_tiny_graphs(built, dtype):
    out = built(dtype)
    m = manifest_of(out)
    trt, info = load_trt()
    for name in ("prefill", "decode"):
        rec = m["engines"][name]
        blob = (out / rec["file"]).read_bytes()
        assert rec["size"] == len(blob) > 0 and rec["sha256"] == hashlib.sha256(blob).hexdigest()
        assert rec["tensorrt"] == {"flavour": info.flavour, "version": info.version_str, "module": info.module_name}
        assert rec["precision"] == dtype and rec["strongly_typed"] is True
        assert rec["layers"]["KV_CACHE_UPDATE"] == 2 and rec["layers"]["ROTARY_EMBEDDING"] == 2
        assert rec["layers"]["ATTENTION_INPUT"] == 1
        assert rec["target"]["compute_capability"] == "any"
        graph = typed_of(out).graphs[name]
        trt_build.check_io(rec["io"], graph, name)  # the engine I/O is the manifest's contract
        kv = next(t for t in rec["io"]["inputs"] if t["name"] == "past_key.0")
        assert kv == {"name": "past_key.0", "dtype": dtype, "shape": ["batch", 2, 64, 16]}
    assert m["engines"]["decode"]["profile"]["input_ids"] == {"min": [1, 1], "opt": [4, 1], "max": [4, 1]}
    assert m["engines"]["prefill"]["profile"]["input_ids"] == {"min": [1, 1], "opt": [2, 64], "max": [4, 64]}
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]  # atomic writes left no temp files


def test_network_layer_types_of_the_decode_graph(built):
    out = built("fp16")
    trt, _ = load_trt()
    logger = trt.Logger(trt.Logger.ERROR)
    network, _parser = trt_build.parse_onnx(trt, trt.Builder(logger), logger, out / "decode.onnx")
    types = trt_build.network_layer_types(network)
    assert types["KV_CACHE_UPDATE"] == 2 and types["ROTARY_EMBEDDING"] == 2 and types["TOPK"] == 1
    io_ = trt_build.network_io(network, typed_of(out).graphs["decode"])
    assert [t["name"] for t in io_["outputs"]][:2] == ["logits", "next_token"]


def test_progress_bar_draws_on_a_terminal(tmp_path, monkeypatch):
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    out = trt_graphs.write_artifact(tmp_path / "a", "fp16")
    trt_build.build_engines(out, progress=True)
    assert "building prefill.engine" in err.getvalue() and "building decode.engine" in err.getvalue()


def test_progress_lines_without_a_terminal(tmp_path, monkeypatch, capsys):
    """Output redirected: plain lines (here from the start: no delay), naming the phase, and a last one per engine."""
    from decodert.export import progress

    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    out = trt_graphs.write_artifact(tmp_path / "a", "fp16")
    trt_build.build_engines(out, progress=True)
    err = capsys.readouterr().err
    for name in ("prefill", "decode"):
        assert f"decodert: building {name}.engine: " in err and "step" in err
        assert any(line.startswith(f"decodert: building {name}.engine: ") and line.endswith(" s done") for line in err.splitlines())
    assert "\r" not in err  # no bar


def test_timing_cache_is_recorded(tmp_path):
    out = trt_graphs.write_artifact(tmp_path / "a", "fp16")
    cache = tmp_path / "timing.cache"
    engines = trt_build.build_engines(out, timing_cache=cache, progress=False, max_batch=2, max_seq=32)
    _, info = load_trt()
    if info.has_timing_cache:
        assert cache.is_file() and engines["decode"].timing_cache == str(cache)
    else:  # a no-op in TensorRT-RTX: say so instead of writing an empty file
        assert not cache.exists() and engines["decode"].timing_cache.startswith("ignored")
    assert engines["prefill"].profile["input_ids"]["max"] == [2, 32]


# ---------------------------------------------------------------- bad input
def test_precision_must_match_the_exported_dtype(built):
    with pytest.raises(DecodertError, match="--bf16 does not match the exported dtype 'fp16'") as e:
        trt_build.build_engines(built("fp16"), precision="bf16", progress=False)
    assert e.value.exit_code == 2


def test_max_seq_beyond_the_export_is_refused(built):
    with pytest.raises(DecodertError, match="--max-seq 65 must be between 1 and the exported max_seq 64"):
        trt_build.build_engines(built("fp16"), max_seq=65, progress=False)


def test_missing_manifest_and_ort_target(tmp_path):
    with pytest.raises(DecodertError, match="manifest.json"):
        trt_build.build_engines(tmp_path, progress=False)
    out = trt_graphs.write_artifact(tmp_path / "a", "fp16")
    m = manifest_of(out)
    m["target"] = "ort"
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DecodertError, match="re-export with --target trt"):
        trt_build.build_engines(out, progress=False)


def test_unparsable_graph_names_the_node(tmp_path, capsys):
    out = trt_graphs.write_artifact(tmp_path / "a", "fp16")
    model = onnx.load(str(out / "decode.onnx"), load_external_data=False)
    node = next(n for n in model.graph.node if n.name == "/model/layers.0/residual")
    node.op_type, node.domain = "NoSuchOp", "decodert"  # no TensorRT importer, no plugin
    model.opset_import.append(onnx.helper.make_opsetid("decodert", 1))
    onnx.save(model, str(out / "decode.onnx"))
    m = manifest_of(out)
    m["files"]["decode.onnx"] = to_json(file_record(out / "decode.onnx"))
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DecodertError, match="node '/model/layers.0/residual' \\(NoSuchOp\\)"):
        trt_build.build_engines(out, progress=False)
    assert cli_main(["build", str(out), "--no-progress"]) == 2  # the CLI path: one line, exit 2
    assert capsys.readouterr().err.startswith("decodert: error: ")


def test_truncated_engine_is_refused(built, tmp_path):
    out = copy_artifact(built("fp16"), tmp_path / "a")
    blob = (out / "decode.engine").read_bytes()
    (out / "decode.engine").write_bytes(blob[: len(blob) // 2])
    _, info = load_trt()
    with pytest.raises(DecodertError, match="truncated or damaged") as e:
        read_engine(out, typed_of(out), "decode", info)
    assert e.value.exit_code == 2
    (out / "decode.engine").write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))  # same size, one bit off
    with pytest.raises(DecodertError, match="sha256 does not match"):
        read_engine(out, typed_of(out), "decode", info)


def test_engine_from_another_tensorrt_version_is_refused(built, tmp_path):
    out = copy_artifact(built("fp16"), tmp_path / "a")
    m = manifest_of(out)
    m["engines"]["prefill"]["tensorrt"]["version"] = "1.5.0.1"
    (out / "manifest.json").write_text(json.dumps(m))
    _, info = load_trt()
    with pytest.raises(DecodertError, match=f"built with tensorrt_rtx 1.5.0.1 but tensorrt_rtx {info.version_str}"):
        read_engine(out, typed_of(out), "prefill", info)
    from decodert.runtime.backends.trt.backend import TrtBackend

    with pytest.raises(DecodertError, match="1.5.0.1"):  # refused before any GPU work
        TrtBackend(out, typed_of(out))


def test_kv_pairs_are_only_the_cache_tensors(built):
    pairs = kv_pairs(typed_of(built("fp16")).graphs["decode"])
    assert pairs == [("past_key.0", "present_key.0"), ("past_value.0", "present_value.0")]  # not past_lengths


def test_contiguous_runs():
    assert list(contiguous_runs([3, 0, 1, 5])) == [[(1, 0), (2, 1)], [(0, 3)], [(3, 5)]]
    assert list(contiguous_runs([0, 1, 2])) == [[(0, 0), (1, 1), (2, 2)]]


# ---------------------------------------------------------------- real exports
@pytest.mark.parametrize("family", ["llama", "llama3", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "gemma2", "smollm3"])
def test_export_and_build_every_family(tiny_checkpoint, tmp_path, family):
    from decodert.export.pipeline import export_model

    out = tmp_path / family
    export_model(tiny_checkpoint(family), out, target="trt", dtype="fp16", max_seq=64, max_batch=2, progress=False)
    engines = trt_build.build_engines(out, progress=False)
    m = typed_of(out)
    layers = m.model.num_layers
    for name, rec in engines.items():
        assert rec.layers["KV_CACHE_UPDATE"] == 2 * layers, (family, name)
        assert rec.layers["ROTARY_EMBEDDING"] == 2 * layers, (family, name)
        if m.model.spec().attention.softcap is None:
            assert rec.layers["ATTENTION_INPUT"] == layers, (family, name)
        else:  # TensorRT's attention layer has no soft-capping: the decomposed body, no attention layer
            assert "ATTENTION_INPUT" not in rec.layers, (family, name)
        assert m.engines[name] == rec  # what build_engines returns is what the manifest records
        trt_build.check_io(rec.io, m.graphs[name], name)


def test_export_and_build_bf16(tiny_checkpoint, tmp_path):
    from decodert.export.pipeline import export_model

    export_model(tiny_checkpoint("qwen3"), tmp_path / "q", target="trt", dtype="bf16", max_seq=32, progress=False)
    engines = trt_build.build_engines(tmp_path / "q", precision="bf16", progress=False)
    assert {t["dtype"] for t in engines["decode"].io["inputs"] if t["name"].startswith("past_key")} == {"bf16"}


def test_export_and_build_fp32_and_int4(tiny_checkpoint, tmp_path):
    """fp32 uses the decomposed attention (no Attention layer); int4 weights build as block dequantize."""
    from decodert.export.pipeline import export_model
    from decodert.export.quantize.quant import QuantConfig

    src = tiny_checkpoint("llama")
    export_model(src, tmp_path / "f32", target="trt", dtype="fp32", max_seq=32, progress=False)
    engines = trt_build.build_engines(tmp_path / "f32", progress=False)
    assert engines["decode"].layers["KV_CACHE_UPDATE"] == 4 and "ATTENTION_INPUT" not in engines["decode"].layers
    export_model(src, tmp_path / "q4", target="trt", dtype="fp16", max_seq=32, progress=False,
                 quant=QuantConfig(bits=4, block_size=32))
    engines = trt_build.build_engines(tmp_path / "q4", progress=False)
    assert engines["decode"].layers["DEQUANTIZE"] >= 8 and engines["decode"].layers["ATTENTION_INPUT"] == 2


@pytest.mark.slow
def test_build_smollm2(request, tmp_path):
    """SmolLM2-135M (30 layers) fp16: about 35 s of building and 1.5 GB of RAM here."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("slow (about a minute): run with -m slow")
    from decodert.export.pipeline import export_model

    smollm2_gguf = request.getfixturevalue("smollm2_gguf")
    export_model(smollm2_gguf, tmp_path / "s", target="trt", dtype="fp16", max_seq=512, max_batch=4, progress=False)
    engines = trt_build.build_engines(tmp_path / "s", progress=False)
    assert engines["decode"].layers["KV_CACHE_UPDATE"] == 60 and engines["prefill"].layers["ATTENTION_INPUT"] == 30


# ---------------------------------------------------------------- running engines (GPU)
def test_ort_reference_decode_equals_longer_prefill(built):
    """The CPU reference `verify` compares against: decode after prefill == prefill of the longer prompt."""
    from decodert.tools.verify import OrtGraphReference

    out = built("fp16")
    m = typed_of(out)
    a = OrtGraphReference(out, m, 2)
    first, _ = a.prefill([np.array([5, 6, 7, 8, 9]), np.array([10, 11, 12])])
    nxt, logits = a.decode(first)
    b = OrtGraphReference(out, m, 2)
    full_next, full_logits = b.prefill([np.array([5, 6, 7, 8, 9, first[0]]), np.array([10, 11, 12, first[1]])])
    np.testing.assert_array_equal(nxt, full_next)
    np.testing.assert_allclose(logits, full_logits, atol=2e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_engines_match_onnxruntime(built, cuda_graphs):
    from decodert.tools.verify import verify

    res = verify(built("fp16"), steps=8, rows=3, cuda_graphs=cuda_graphs)
    assert res["greedy_agreement"] == 1.0 and res["max_rel_logit_err"] < 2e-2, res
    assert (res["backend_stats"]["graph_launches"] >= 6) == cuda_graphs, res


@pytest.mark.gpu
@gpu
def test_slot_placement_and_move_slot(built):
    from decodert.runtime.backends.trt.backend import TrtBackend

    out = built("fp16")
    prompts = [np.array([5, 6, 7, 8, 9]), np.array([10, 11, 12])]
    with TrtBackend(out, typed_of(out)) as be:
        cache = be.allocate(4)
        a = be.prefill(cache, [0, 1], prompts, want_logits=True)
        b = be.prefill(cache, [3, 2], prompts, want_logits=True)  # other slots, reversed: offset-bound run
        np.testing.assert_array_equal(a.next_token, b.next_token)
        np.testing.assert_allclose(a.logits, b.logits, atol=1e-3)
        da = be.decode(cache, [0, 1], a.next_token, want_logits=True)  # prefix: bound context
        db = be.decode(cache, [3, 2], b.next_token, want_logits=True)  # non-prefix: runs
        np.testing.assert_array_equal(da.next_token, db.next_token)
        be.move_slot(cache, 3, 1)  # slot 1 now holds slot 3's row (= prompt 0 + one token)
        assert cache.lengths[1] == 6 and cache.lengths[3] == 0  # a moved row leaves its slot empty
        np.testing.assert_array_equal(cache.held(1), cache.held(0))
        x = be.decode(cache, [1], da.next_token[:1], want_logits=True)
        y = be.decode(cache, [0], da.next_token[:1], want_logits=True)
        np.testing.assert_array_equal(x.next_token, y.next_token)
        np.testing.assert_allclose(x.logits, y.logits, atol=1e-3)


@pytest.mark.gpu
@gpu
def test_long_prompt_prefills_in_chunks(tmp_path):
    from decodert.runtime.backends.trt.backend import TrtBackend
    from decodert.tools.verify import OrtGraphReference

    out = trt_graphs.write_artifact(tmp_path / "a", "fp16")
    trt_build.build_engines(out, max_seq=16, progress=False)  # prefill profile: at most 16 tokens a call
    m = typed_of(out)
    prompt = (np.arange(40) * 7 % 128).astype(np.int64)
    with TrtBackend(out, m) as be:
        assert be.max_prefill == 16
        got = be.prefill(be.allocate(1), [0], [prompt], want_logits=True)
    want_next, want_logits = OrtGraphReference(out, m, 1).prefill([prompt])
    np.testing.assert_array_equal(got.next_token, want_next)
    np.testing.assert_allclose(got.logits, want_logits, atol=2e-2)
