"""Damaged inputs end in a one-line DecodertError (exit code 2 from the CLI), never a crash, hang or traceback.

Property tests (hypothesis, a few dozen examples per format, derandomised so CI is stable) and the
regression cases the long fuzzer (scripts/fuzz.py) found. Targets run in a worker subprocess with a
time limit and an address-space limit (tests/helpers/fuzz_harness.py): a segfault, hang or MemoryError is a
reported failure, not a dead pytest.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fuzz_harness import GOOD, PLANS, Fuzzer, dump_json, gguf_field  # noqa: E402
from fuzz_samples import make_samples  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402

EXAMPLES = 60  # per format (~5 s each on 2 cores); scripts/fuzz.py runs thousands


@pytest.fixture(scope="module")
def fuzzer(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    f = Fuzzer(make_samples(root / "samples"), root / "cases", timeout=60)
    yield f
    f.close()


class DataChooser:
    def __init__(self, data):
        self.data = data

    def integer(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))


@pytest.mark.parametrize("target", list(PLANS))
@settings(max_examples=EXAMPLES, deadline=60_000, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_damaged_input_is_a_one_line_error(fuzzer, target, data):
    out = fuzzer.case(target, DataChooser(data))
    assert out.status in GOOD, out.report()


# -- the harness notices what it must ---------------------------------------------------------------
@pytest.mark.parametrize("kind, status", [("crash", "crash"), ("hang", "hang"), ("memory", "bug"), ("raise", "bug")])
def test_harness_reports_crash_hang_memory_and_tracebacks(tmp_path, kind, status):
    f = Fuzzer({}, tmp_path, timeout=5 if kind == "hang" else 60)
    try:
        out = f.worker.run("selftest", tmp_path / kind, f.timeout)
    finally:
        f.close()
    assert out.status == status, out.report()
    assert kind != "memory" or "MemoryError" in out.message


# -- regression cases found by scripts/fuzz.py ---------------------------------------------------------
def _nested_gguf(depth: int) -> bytes:
    """A header with one key whose value is an array of arrays ... ``depth`` deep."""
    value = struct.pack("<IQ", 0, 0)  # innermost: empty uint8 array
    for _ in range(depth - 1):
        value = struct.pack("<IQ", 9, 1) + value
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"a" + struct.pack("<I", 9) + value


HANG = [("item type of 'tokenizer.ggml.token_type'", 0), ("length of 'tokenizer.ggml.token_type'", 2**62)]


@pytest.mark.parametrize("edit", [
    HANG,  # a uint8 array of 2**62 items: GGUFReader read the file, then empty views past its end forever
    ("length of 'tokenizer.ggml.tokens'", 2**62),
    ("length of 'tokenizer.ggml.merges'", 2**40),
    ("tensor count", 2**40),
    ("dim 1 of tensor 'token_embd.weight'", 2**40),  # a tensor far larger than the file
    ("n_dims of tensor 'output.weight'", 2**31),
    ("type of tensor 'blk.0.ffn_down.weight'", 9999),
    ("length of name of tensor 3", 2**63),
    ("data offset of tensor 'output_norm.weight'", 2**63),
])
def test_gguf_header_regressions(fuzzer, edit):
    data = gguf_field(fuzzer.samples["gguf"].read_bytes(), *(edit if isinstance(edit, list) else [edit]))
    out = fuzzer.run_bytes("gguf", "mini.gguf", data)
    assert out.status == "error", out.report()


def test_gguf_deeply_nested_arrays_and_bad_utf8(fuzzer):
    assert fuzzer.run_bytes("gguf", "mini.gguf", _nested_gguf(50_000)).status == "error"
    data = fuzzer.samples["gguf"].read_bytes()
    at = data.index(b"llama", 40)  # general.architecture's value
    out = fuzzer.run_bytes("gguf", "mini.gguf", data[:at] + b"\xff\xfe" + data[at + 2:])
    assert out.status == "error" and "UTF-8" in out.message, out.report()


def test_gguf_tokenizer_metadata_of_wrong_shape():
    from decodert.export.checkpoints.gguf_tokenizer import build_tokenizer

    base = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"]}
    for extra in ({"tokenizer.ggml.merges": ["zz qq"]}, {"tokenizer.ggml.bos_token_id": 10**6, "tokenizer.ggml.add_bos_token": True},
                  {"tokenizer.ggml.token_type": [1]}, {"tokenizer.ggml.tokens": ["a", 5]},
                  {"tokenizer.ggml.pre": ["x"]}, {"tokenizer.ggml.scores": ["x", "y", "z"]}):
        with pytest.raises(DecodertError) as e:
            build_tokenizer({**base, **extra}, "x.gguf")
        assert "\n" not in str(e.value) and "x.gguf" in str(e.value)


def _safetensors(header: object, payload: bytes = b"\0" * 8) -> bytes:
    raw = dump_json(header) if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(raw)) + raw + payload


@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": [2**32, 2**32], "data_offsets": [0, 0]},  # int64 product overflowed to 0
    {"dtype": "F32", "shape": [-1, -2], "data_offsets": [0, 8]},
    {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]},
    {"dtype": "F32", "shape": [2], "data_offsets": [0.5, 8]},
    {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]},
    {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]},
    {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 2**82]},
    "__deeply_nested__",
])
def test_safetensors_header_regressions(fuzzer, entry):
    out = fuzzer.run_bytes("safetensors", "model.safetensors", _safetensors({"model.embed_tokens.weight": entry}))
    assert out.status == "error", out.report()


@pytest.mark.parametrize("change", [{"hidden_size": "abc"}, {"num_hidden_layers": 10**12}, {"num_attention_heads": 0},
                                    {"head_dim": 7}, {"rope_scaling": "__deeply_nested__"}, {"vocab_size": -5}])
def test_config_json_regressions(fuzzer, change):
    config = json.loads((fuzzer.samples["hf"] / "config.json").read_text())
    out = fuzzer.run_bytes("safetensors", "config.json", dump_json({**config, **change}))
    assert out.status == "error", out.report()


@pytest.mark.parametrize("path, value, expected", [
    (("kv", "num_layers"), 10**9, "error"), (("kv", "num_layers"), 1, "error"), (("max_seq",), True, "error"),
    (("graphs", "prefill", "file"), "../hf/model.safetensors", "error"), (("tokenizer", "file"), "/etc/passwd", "error"),
    (("model", "vocab_size"), 10**6, "error"), (("graphs", "decode", "inputs", 0, "shape"), "x", "error"),
    (("files",), "__deeply_nested__", "error"), (("model", "eos_token_ids"), 1.5, "error"),
    (("model", "bos_token_id"), "1", "error"), (("dtype",), "fp16", "ok"), (("kv", "dtype"), "fp16", "error"),
    (("source",), None, "ok"), (("model", "family"), None, "ok"),  # only shown by inspect: was a KeyError there
])  # dtype "fp16" over an fp32 artifact is ok since kv_dtype (issue 37): the cache's type is kv_dtype, which the
#     graphs' I/O check, and nothing an fp32 artifact binds depends on ``dtype`` alone
def test_manifest_regressions(fuzzer, path, value, expected):
    manifest = json.loads((fuzzer.samples["art"] / "manifest.json").read_text())
    node = manifest
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    out = fuzzer.run_bytes("manifest", "manifest.json", dump_json(manifest))
    assert out.status == expected, out.report()


def test_engine_record_of_wrong_type(fuzzer):
    manifest = json.loads((fuzzer.samples["eng"] / "manifest.json").read_text())
    manifest["engines"]["prefill"]["tensorrt"] = 1.5
    assert fuzzer.run_bytes("engine", "manifest.json", dump_json(manifest)).status == "error"


def test_onnx_damage_reaches_inspect_and_runtime_as_errors(fuzzer):
    data = (fuzzer.samples["art"] / "prefill.onnx").read_bytes()
    for damaged in (data[: len(data) // 2], data[:100] + b"\xff" * 50 + data[150:]):
        out = fuzzer.run_bytes("onnx", "prefill.onnx", damaged)
        assert out.status == "error", out.report()


def test_external_data_location_that_is_not_utf8(fuzzer):
    data = (fuzzer.samples["art"] / "prefill.onnx").read_bytes()
    out = fuzzer.run_bytes("onnx", "prefill.onnx", data.replace(b"weights.bin", b"weights\xaebin", 1))
    assert out.status == "error" and "not text" in out.message, out.report()  # was a TypeError (bytes path)


def test_a_graph_that_loads_but_cannot_run_is_a_one_line_error(fuzzer):
    """Bit flips in constants (a Split size of 2**61, a bad Reshape) load fine and fail in onnxruntime's run."""
    from decodert.runtime.llm import LLM

    class Failing:
        def __init__(self, session):
            self.session = session

        def __getattr__(self, name):
            return getattr(self.session, name)

        def run_with_iobinding(self, io):
            raise RuntimeError("Error in execution: Non-zero status code returned while running Split node.\nmore")

    llm = LLM.load(fuzzer.samples["art"])
    llm.backend.sessions = {k: Failing(v) for k, v in llm.backend.sessions.items()}
    with pytest.raises(DecodertError, match="failed running the prefill graph .*Split node") as e:
        llm.generate("hello", max_new_tokens=2)
    assert "\n" not in str(e.value) and llm.slots_in_use == 0


# -- the CLI: exit code 2, one line on stderr, no traceback ---------------------------------------------
def test_cli_export_of_a_damaged_gguf_exits_2_without_traceback(fuzzer, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(gguf_field(fuzzer.samples["gguf"].read_bytes(), *HANG))
    res = subprocess.run([sys.executable, "-m", "decodert", "export", str(bad), "-o", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("decodert: error: ") and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [["inspect", "{art}"], ["generate", "{art}", "--prompt", "hi", "--full-verify"],
                                  ["generate", "{art}", "--prompt", "hi"], ["export", "{art}/weights.bin", "-o", "{tmp}/o"]])
def test_cli_on_a_damaged_artifact_exits_2(fuzzer, tmp_path, capsys, argv):
    import shutil

    from decodert.cli import main

    art = shutil.copytree(fuzzer.samples["art"], tmp_path / "art")
    with open(art / "weights.bin", "r+b") as f:
        f.truncate(1000)
    assert main([a.format(art=art, tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("decodert: error: ") and err.count("\n") == 1, err
