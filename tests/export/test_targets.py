"""export/lowering/targets.py: one Target per target holds every per-target decision (what it promises the runtimes:
artifact/targets.py, one TargetInfo per target); nothing else branches on a name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from decodert.artifact.targets import TARGET_INFOS, target_info
from decodert.errors import DecodertError
from decodert.export.quantize.quant import QuantConfig
from decodert.export.lowering.targets import ORT, PORTABLE, TARGETS, TRT, get_target
from decodert.export.quantize.weight_layouts import NBITS, QDQ

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = {"export/lowering/targets.py", "artifact/targets.py", "export/quantize/weight_layouts.py", "export/lowering/lowering.py",
           "export/lowering/lower_ort.py", "export/lowering/lower_trt.py"}
NAMES = set(TARGETS) | {NBITS.name, QDQ.name}


def test_each_target_states_its_policy():
    assert (ORT.weight_layout, TRT.weight_layout, PORTABLE.weight_layout) == (NBITS, QDQ, QDQ)
    assert TRT.symmetric_weights and not ORT.symmetric_weights and not PORTABLE.symmetric_weights
    assert TRT.info.runs_on("trt") and PORTABLE.info.runs_on("trt") and not ORT.info.runs_on("trt")
    assert all(t.info.runs_on("ort") for t in TARGETS.values())
    assert TRT.tensorrt_native_since == (10, 15) and TRT.plugin_nodes and not ORT.plugin_nodes
    assert ORT.info.multi_token_rows == 1 and TRT.info.multi_token_rows is None
    assert ORT.encoder_decoder and TRT.encoder_decoder and not PORTABLE.encoder_decoder  # Whisper: ort, and trt engines
    for get in (get_target, target_info):
        with pytest.raises(DecodertError, match="unknown target 'tensorrt'; choose one of: ort, trt, portable"):
            get("tensorrt")


def test_every_described_target_is_exported_and_the_other_way():
    """The runtimes read a target's description (artifact/targets.py), export pairs each with its lowering."""
    assert list(TARGETS) == list(TARGET_INFOS)
    assert all(t.info is TARGET_INFOS[name] and get_target(name) is t for name, t in TARGETS.items())


def test_quant_config_per_target():
    cfg = QuantConfig(bits=4, block_size=32)
    assert TRT.quant_config(cfg).symmetric and not ORT.quant_config(cfg).symmetric  # TensorRT int4 has no zero point
    assert ORT.quant_config(None) is None
    keep = QuantConfig(bits=4, block_size=32, keep_q4_1=True)
    assert ORT.quant_config(keep) is keep
    for t in (TRT, PORTABLE):
        with pytest.raises(DecodertError, match=f"--keep-q4-1 works on the ort target only .* not --target {t.name}"):
            t.quant_config(keep)


def _name_branches(path: Path, root: Path = ROOT) -> list[str]:
    """`x == "trt"` / `x != "nbits"` / `x in ("ort", ...)` comparisons against a target or layout name."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        values = [node.left, *node.comparators]
        consts = [v.value for v in values if isinstance(v, ast.Constant)]
        consts += [e.value for v in values if isinstance(v, (ast.Tuple, ast.List, ast.Set)) for e in v.elts
                   if isinstance(e, ast.Constant)]
        named = [v for v in values if isinstance(v, (ast.Name, ast.Attribute))]
        ident = [v.id if isinstance(v, ast.Name) else v.attr for v in named]
        if NAMES & set(c for c in consts if isinstance(c, str)) and any(i in ("target", "layout", "quant_layout") for i in ident):
            hits.append(f"{path.relative_to(root)}:{node.lineno}")
    return hits


def test_no_target_or_layout_branches_outside_the_target_modules():
    files = [f for f in ROOT.rglob("*.py") if f.relative_to(ROOT).parts[0] not in ("tests", "bench", "scripts")]
    hits = [h for f in files if str(f.relative_to(ROOT)) not in ALLOWED for h in _name_branches(f)]
    assert not hits, "branches on a target/layout name outside export/lowering/targets.py and the lowerings: " + ", ".join(hits)


def test_the_branch_finder_finds_one(tmp_path):
    assert _name_branches(ROOT / "export" / "pipeline.py") == []
    probe = tmp_path / "probe.py"
    probe.write_text('if target == "trt":\n    pass\nif m.quant_layout != "nbits":\n    pass\nif x in ("ort", "trt"):\n    pass\n')
    assert _name_branches(probe, tmp_path) == ["probe.py:1", "probe.py:3"]  # x is not a target or layout
