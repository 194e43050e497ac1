"""sha256 of every graph and weights file of every family x target x precision: a refactor's byte-identity check.

    python scripts/graph_hashes.py --out before.json               # every source, every variant
    python scripts/graph_hashes.py --out after.json --compare before.json
    python scripts/graph_hashes.py --only llama,lfm2 --variants ort:fp32,trt:int4

Each source is a tiny random checkpoint of tests/helpers/tiny.py (every family of CONFIGS, HYBRID_CONFIGS and OWN_CONFIGS),
a tiny vision-language checkpoint (tests/helpers/tiny_vision.py, tiny_gemma3_vision.py, tiny_qwen_vl.py: their vision.onnx
too) or a tiny GGUF (tests/helpers/tiny.py's make_tiny_gguf); each is exported once per variant (target ort | trt | portable
| trt-plugins, precision fp32 | int4, plus a few settings of their own: an int8 KV cache, LoRA slots, fp16) into a
temporary folder. The record of an export is the sha256 of every file it wrote but manifest.json, the manifest
without its model section, its creation time and its source path (``manifest``: compared whole), and the model
section itself (``model``: compared as the ModelSpec it reads back, so a new spec layout that converts the old one
compares equal). An export that fails records its error line, which must stay the same too.

``--compare`` exits 1 and lists every difference; the records are deterministic (seeded checkpoints), so any
difference is a change in what the export writes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "helpers"))  # tests/helpers/tiny*.py importable as modules, as conftest.py does

# name -> (target, precision, extra export_model arguments)
VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    f"{t}:{p}": (t.split("-")[0], p, {"plugins": "always"} if t == "trt-plugins" else {"plugins": "never"}
                 if t == "trt" else {})
    for t in ("ort", "trt", "portable", "trt-plugins") for p in ("fp32", "int4")
}
EXTRA_VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {  # settings that reach more of the spec, few sources
    "ort:fp32:kv-int8": ("ort", "fp32", {"kv_dtype": "int8"}),
    "portable:fp32:lora": ("portable", "fp32", {"lora": (2, 4)}),
    "ort:fp16": ("ort", "fp16", {}),
}
EXTRA_SOURCES = ("llama", "gemma3", "qwen3_5", "gemma4")


def sources() -> dict[str, Callable[[Path], Path]]:
    """Source name -> make(folder) -> the checkpoint path (an HF folder or a .gguf file)."""
    import tiny
    from tiny_gemma3_vision import make_tiny_gemma3_vlm
    from tiny_qwen_vl import make_tiny_qwen_vl
    from tiny_vision import make_tiny_vlm

    made: dict[str, Callable[[Path], Path]] = {}
    for family in (*tiny.CONFIGS, *tiny.HYBRID_CONFIGS, *tiny.OWN_CONFIGS):
        made[family] = lambda d, f=family: tiny.make_tiny_checkpoint(f, d / f)
    for family in tiny.FAMILIES:  # every family with a GGUF writer
        made[f"gguf-{family}"] = lambda d, f=family: tiny.make_tiny_gguf(f, d / f"{f}.gguf")
    made["gguf-llama-q4_0"] = lambda d: tiny.make_tiny_gguf("llama", d / "llama-q4_0.gguf", "Q4_0")
    made["vlm-idefics3"] = lambda d: make_tiny_vlm(d / "idefics3")
    made["vlm-smolvlm"] = lambda d: make_tiny_vlm(d / "smolvlm", kind="smolvlm")
    made["vlm-gemma3"] = lambda d: make_tiny_gemma3_vlm(d / "gemma3")
    for kind in ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe"):
        made[f"vlm-{kind}"] = lambda d, k=kind: make_tiny_qwen_vl(d / k, kind=k)
    return made


def export_record(src: Path, out: Path, target: str, precision: str, extra: dict[str, Any]) -> dict[str, Any]:
    """Export ``src`` into ``out`` and hash what it wrote (or the error line of a failed export)."""
    from decodert.errors import DecodertError
    from decodert.artifact.lora_layout import LoraLayout
    from decodert.export.pipeline import export_model
    from decodert.export.quantize.quant import QuantConfig

    extra = dict(extra)
    if "lora" in extra:
        slots, rank = extra.pop("lora")
        extra["lora"] = LoraLayout(slots=slots, rank=rank)
    dtype = "fp32" if precision == "int4" else precision
    quant = QuantConfig(bits=4) if precision == "int4" else None
    try:
        export_model(src, out, target=target, dtype=dtype, max_seq=64, max_batch=2, progress=False, quant=quant,
                     **extra)
    except DecodertError as e:
        return {"error": str(e)}
    except Exception as e:  # noqa: BLE001 - a checker's refusal is a record too (it must stay the same)
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"}
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())
             if p.is_file() and p.name != "manifest.json"}
    manifest = json.loads((out / "manifest.json").read_text())
    model = manifest.pop("model")
    for key in ("created",):
        manifest.pop(key, None)
    manifest.get("source", {}).pop("path", None)
    if manifest.get("lora"):
        manifest["lora"].pop("merged", None)
    return {"files": files, "manifest": manifest, "model": model}


def run(names: list[str], variants: dict[str, tuple[str, str, dict[str, Any]]], work: Path,
        log: Callable[[str], None], extras: dict[str, tuple[str, str, dict[str, Any]]] | None = None
        ) -> dict[str, dict[str, Any]]:
    """Every source of ``names`` exported in every variant (and EXTRA_SOURCES in ``extras`` too) -> records."""
    extras = extras or {}
    made = sources()
    records: dict[str, dict[str, Any]] = {}
    for name in names:
        folder = work / name
        folder.mkdir(parents=True, exist_ok=True)
        start = time.time()
        src = made[name](folder)
        chosen = {**variants, **(extras if name in EXTRA_SOURCES else {})}
        for variant, (target, precision, extra) in chosen.items():
            out = folder / f"out-{variant.replace(':', '-')}"
            records[f"{name}/{variant}"] = export_record(src, out, target, precision, extra)
            shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)
        log(f"{name}: {len(chosen)} exports in {time.time() - start:.0f}s")
    return records


def differences(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> list[str]:
    """One line per difference; the model sections compare as the ModelSpec each reads back as."""
    from decodert.models.spec import ModelSpec

    lines = []
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key), after.get(key)
        if a is None or b is None:
            lines.append(f"{key}: only {'after' if a is None else 'before'}")
            continue
        if a.get("error") != b.get("error"):
            lines.append(f"{key}: error {a.get('error')!r} -> {b.get('error')!r}")
            continue
        for name in sorted(set(a.get("files", {})) | set(b.get("files", {}))):
            if a["files"].get(name) != b["files"].get(name):
                lines.append(f"{key}: {name} {a['files'].get(name)} -> {b['files'].get(name)}")
        if a.get("manifest") != b.get("manifest"):
            for section in sorted(set(a["manifest"]) | set(b["manifest"])):
                if a["manifest"].get(section) != b["manifest"].get(section):
                    lines.append(f"{key}: manifest.{section} differs")
        if "model" in a and ModelSpec.from_dict(a["model"]) != ModelSpec.from_dict(b["model"]):
            lines.append(f"{key}: the manifest's model reads back as a different ModelSpec")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, help="write the records (JSON) here")
    ap.add_argument("--compare", type=Path, help="compare with records written before; exit 1 on any difference")
    ap.add_argument("--only", help="comma-separated source names (default: all)")
    ap.add_argument("--variants", help=f"comma-separated variants (default: {', '.join(VARIANTS)}; and for "
                    f"{', '.join(EXTRA_SOURCES)} also {', '.join(EXTRA_VARIANTS)})")
    ap.add_argument("--work", type=Path, help="scratch folder (default: a temporary one)")
    ap.add_argument("--list", action="store_true", help="print the source names and exit")
    args = ap.parse_args(argv)
    names = list(sources())
    if args.list:
        print("\n".join(names))
        return 0
    if args.only:
        unknown = sorted(set(args.only.split(",")) - set(names))
        if unknown:
            ap.error(f"unknown source {unknown[0]!r}; --list names them")
        names = args.only.split(",")
    variants, extras = VARIANTS, EXTRA_VARIANTS
    if args.variants:
        every = {**VARIANTS, **EXTRA_VARIANTS}
        unknown = sorted(set(args.variants.split(",")) - set(every))
        if unknown:
            ap.error(f"unknown variant {unknown[0]!r}; choose from {', '.join(every)}")
        variants, extras = {k: every[k] for k in args.variants.split(",")}, {}
    work = args.work or Path(tempfile.mkdtemp(prefix="graph_hashes-"))
    try:
        records = run(names, variants, work, lambda line: print(line, file=sys.stderr, flush=True), extras)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.out:
        args.out.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
    if args.compare:
        before = json.loads(args.compare.read_text())
        before = {k: v for k, v in before.items() if k in records}  # a run over some sources compares those
        lines = differences(before, records)
        print("\n".join(lines) if lines else f"{len(records)} exports byte-identical")
        return 1 if lines else 0
    if not args.out:
        json.dump(records, sys.stdout, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
