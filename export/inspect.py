"""``decodert inspect OUT``: the manifest and a summary of each graph (ops, I/O, weight bytes)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import onnx

from decodert.export.manifest import load_manifest


def graph_summary(path: Path) -> dict[str, Any]:
    model = onnx.load(str(path), load_external_data=False)
    ops = Counter(f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in model.graph.node)
    weight_bytes = 0
    for t in model.graph.initializer:
        info = {e.key: e.value for e in t.external_data}
        weight_bytes += int(info["length"]) if "length" in info else len(t.raw_data)
    return {"opsets": {o.domain or "ai.onnx": o.version for o in model.opset_import},
            "nodes": len(model.graph.node), "ops": dict(sorted(ops.items())), "weight_bytes": weight_bytes}


def inspect_artifact(folder: str | Path) -> str:
    folder = Path(folder)
    m = load_manifest(folder, verify="fast")
    spec = m["model"]
    lines = [
        f"artifact   {folder}",
        f"model      {spec['family']}: {spec['num_layers']} layers, hidden {spec['hidden_size']}, "
        f"heads {spec['num_heads']}/{spec['num_kv_heads']} x {spec['head_dim']}, vocab {spec['vocab_size']}",
        f"target     {m['target']}  dtype {m['dtype']}  max_seq {m['max_seq']}  max_batch {m['max_batch']}",
        f"weights    {m['weights']['file']}  {m['weights']['bytes'] / 2**20:.1f} MiB",
        f"source     {m['source']['kind']}: {m['source']['path']}",
        f"made by    decodert {m.get('decodert_version')} onnx {m.get('onnx_version')} on {m.get('created')}",
    ]
    for kind in ("prefill", "decode"):
        g = m["graphs"][kind]
        s = graph_summary(folder / g["file"])
        lines.append(f"\n{kind}: {g['file']}  {s['nodes']} nodes  opsets {s['opsets']}")
        lines.append("  ops     " + ", ".join(f"{k} x{v}" for k, v in s["ops"].items()))
        for io_kind in ("inputs", "outputs"):
            shown = [io for io in g[io_kind] if not io["name"].startswith(("past_", "present_")) or io["name"].endswith(".0")]
            text = ", ".join(f"{io['name']} {io['dtype']}{io['shape']}" for io in shown)
            lines.append(f"  {io_kind:7} {text}" + (f" (+ {len(g[io_kind]) - len(shown)} more per layer)" if len(shown) < len(g[io_kind]) else ""))
    if m.get("engines"):
        lines.append("\nengines: " + ", ".join(m["engines"]))
    lines.append("\nfiles:   " + ", ".join(f"{k} ({v['size']} B)" for k, v in m["files"].items()))
    return "\n".join(lines)
