"""scripts/graph_hashes.py, the refactors' byte-identity check: its records are deterministic and every
difference is reported."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "graph_hashes.py"


def _script():
    spec = importlib.util.spec_from_file_location("graph_hashes", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_records_of_one_family_are_deterministic_and_differences_are_listed(tmp_path):
    gh = _script()
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    args = ["--only", "llama", "--variants", "ort:fp32,trt:int4,portable:fp32:lora", "--work", str(tmp_path / "w")]
    assert gh.main([*args, "--out", str(first)]) == 0
    records = json.loads(first.read_text())
    assert sorted(records) == ["llama/ort:fp32", "llama/portable:fp32:lora", "llama/trt:int4"]
    for record in records.values():
        assert {"prefill.onnx", "decode.onnx", "verify.onnx", "weights.bin"} <= set(record["files"])
        assert record["model"]["family"] == "llama" and "model" not in record["manifest"]
    assert gh.main([*args, "--out", str(second), "--compare", str(first)]) == 0  # byte-identical twice
    changed = copy.deepcopy(records)
    changed["llama/trt:int4"]["files"]["weights.bin"] = "0" * 64
    changed["llama/ort:fp32"]["manifest"]["max_seq"] = 65
    changed["llama/ort:fp32"]["model"]["rms_norm_eps"] = 1e-3
    lines = gh.differences(records, changed)
    assert lines == ["llama/ort:fp32: manifest.max_seq differs",
                     "llama/ort:fp32: the manifest's model reads back as a different ModelSpec",
                     f"llama/trt:int4: weights.bin {records['llama/trt:int4']['files']['weights.bin']} -> {'0' * 64}"]
