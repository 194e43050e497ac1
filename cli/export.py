"""``decodert export SRC -o OUT``: a checkpoint (HF folder or .gguf) -> prefill/decode ONNX graphs + weights."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from decodert.errors import DecodertError
from decodert.export.fetch import SMOLLM2
from decodert.artifact.manifest import MANIFEST


def add_parser(sub: Any) -> None:
    e = sub.add_parser("export", help="convert a checkpoint (HF folder or .gguf) to prefill/decode ONNX graphs",
                       description="Write an artifact folder: prefill.onnx, decode.onnx and verify.onnx sharing "
                                   "weights.bin, the tokenizer and manifest.json. An artifact already at -o is "
                                   "replaced only with --force.")
    e.add_argument("src", help="Hugging Face model folder or GGUF file ('smollm2': the SmolLM2-135M-Instruct GGUF "
                              "`decodert run` downloads into the cache)")
    e.add_argument("-o", "--out", required=True, help="artifact folder to write")
    e.add_argument("--force", action="store_true",
                   help="replace the artifact already in the -o folder (its engines too; without --force that is an error)")
    e.add_argument("--target", choices=["ort", "trt", "portable"], default="ort",
                   help="what the graphs are lowered for: ort = ONNX Runtime contrib ops, the fast CPU path; trt = "
                        "TensorRT / TensorRT-RTX (then `decodert build`); portable = standard ONNX ops only "
                        "(default ort)")
    e.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="fp32",
                   help="dtype of the activations and of the weights kept in float (default fp32; fp16 / bf16 "
                        "suit --target trt engines on a GPU)")
    e.add_argument("--max-seq", type=int, default=None, help="tokens per sequence the cache holds (default: min(context, 2048))")
    e.add_argument("--max-batch", type=int, default=4, help="sequences decoded together at most (default 4)")
    e.add_argument("--quant", choices=["int4", "int8"],
                   help="weight-only block quantization of the linear layers. From a GGUF with --block-size 32, "
                        "Q4_0 weights are transcoded exactly to symmetric int4 (in int8 exports too: smaller and exact) "
                        "and Q8_0 weights to symmetric int8 (in int4 exports only with --keep-q8); every other "
                        "weight is dequantized and rounded to nearest")
    e.add_argument("--block-size", type=int, default=32, help="quantization block along the input dim (default 32)")
    e.add_argument("--accuracy-level", type=int, default=None, choices=[0, 1, 2, 3, 4],
                   help="ort target: 0 = fp32 compute, 4 = int8 activations (faster; may flip near-tie tokens); "
                        "default 0 for int4, 4 for int8")
    e.add_argument("--symmetric", action="store_true", help="no zero points (always on for --target trt)")
    e.add_argument("--keep-q4-1", action="store_true",
                   help="ort target, int4: keep GGUF Q4_1 weights exact (zero point 0 + a per-block minimum "
                        "term in the graph; SmolLM2 perplexity 37.5, with --keep-q8 35.4, instead of 44.0; decode "
                        "23-34%% slower)")
    e.add_argument("--no-scale-search", action="store_true",
                   help="block scales from min/max only (faster export; by default a least-squares search "
                        "lowers the rounding error, SmolLM2 int4 perplexity 46.9 -> 44.0)")
    e.add_argument("--no-quant-lm-head", action="store_true", help="keep the output projection in float")
    e.add_argument("--keep-q8", action="store_true",
                   help="--quant int4 from a GGUF: keep Q8_0 weights 8-bit and exact instead of rounding them to 4 bits")
    e.add_argument("--kv-dtype", choices=["fp32", "fp16", "bf16", "int8", "fp8", "int4"], default=None,
                   help="the KV cache's element type (default: --dtype). int8 / int4 keep per-channel scales "
                        "calibrated at export on a built-in text (1/4 and 1/8 of an fp32 cache); ort: int8, int4, "
                        "fp16; portable: all (Q/DQ around the cache); trt: --dtype only")
    e.add_argument("--plugins", choices=["auto", "always", "never"], default="auto",
                   help="trt target: decodert plugin nodes (CachedAttention, RMSNorm) instead of native layers; "
                        "auto = plugins only for a TensorRT without them (< 10.15, e.g. Jetson)")
    e.add_argument("--trt-version", default=None,
                   help="trt target: the TensorRT the engines are built with, e.g. 10.3 (default: the installed one)")
    e.add_argument("--lora-slots", type=int, default=0,
                   help="LoRA adapters the graphs take at run time, each row of a batch its own "
                        "(LLM.load(adapters=...), `decodert serve --lora`); ort and portable targets (default 0: none)")
    e.add_argument("--lora-rank", type=int, default=16,
                   help="with --lora-slots: the highest adapter rank a slot holds (default 16)")
    e.add_argument("--merge-lora", action="append", default=[], metavar="DIR",
                   help="a PEFT LoRA adapter folder to merge into the weights (repeatable): one fused model")
    e.add_argument("--embeddings", action="store_true", default=None,
                   help="also write embed.onnx (the last hidden state, no K/V: LLM.embed, /v1/embeddings); "
                        "on by default for an embedding checkpoint (a sentence-transformers folder)")
    e.add_argument("--hidden-states", action="store_true",
                   help="the graphs also return the last hidden state, which a draft head reads (export the "
                        "target with it, then its head with --target-artifact); without it the graphs are unchanged")
    e.add_argument("--hidden-layers", default=None, metavar="eagle3|I,J,K",
                   help="the hidden-state outputs carry the inputs of these layers, concatenated: what an EAGLE-3 "
                        "head reads (eagle3: layers 2, N/2, N-3, the heads' default; or the head config's "
                        "eagle_aux_hidden_state_layer_ids); implies --hidden-states")
    e.add_argument("--target-artifact", type=Path, default=None, metavar="TARGET",
                   help="SRC is a draft head checkpoint (gemma4_assistant; an EAGLE-3 head, whose target is exported "
                        "with --hidden-layers), or the target's own Qwen3.5 checkpoint whose mtp.* layer is the head: "
                        "export it for this target artifact (exported with --hidden-states); the head records the "
                        "target and is refused beside another")
    e.add_argument("--openvino-prefill", action="store_true",
                   help="--target ort: also write prefill.portable.onnx, the prefill graph the OpenVINO execution "
                        "provider takes (`pip install 'decodert[openvino]'`); at first load decodert measures it "
                        "against the ort prefill and keeps the faster (docs/features/placement.md)")
    e.set_defaults(func=run_export)


def quant_config(args: argparse.Namespace) -> Any:
    """The QuantConfig ``--quant`` and its options ask for (None without --quant)."""
    from decodert.export.quantize.quant import QuantConfig

    if not args.quant:
        return None
    bits = int(args.quant[3:])
    # ONNX Runtime 1.32 has no fast fp32-compute int8 MatMulNBits kernel on CPU (~2 s/step), so int8 defaults to 4
    level = args.accuracy_level if args.accuracy_level is not None else (4 if bits == 8 else 0)
    return QuantConfig(bits=bits, block_size=args.block_size, accuracy_level=level,
                       symmetric=args.symmetric, lm_head=not args.no_quant_lm_head, keep_q8=args.keep_q8,
                       keep_q4_1=args.keep_q4_1, scale_search=not args.no_scale_search)


def run_export(args: argparse.Namespace) -> int:
    from decodert.artifact.lora_layout import LoraLayout
    from decodert.export.pipeline import export_model

    from decodert.export.heads import is_head_checkpoint

    if args.target_artifact is not None or is_head_checkpoint(args.src):
        return run_head_export(args)
    check_replace(Path(args.out), args.force)
    src = args.src
    if src == SMOLLM2 and not Path(src).exists():
        from decodert.export.fetch import smollm2_gguf

        src = smollm2_gguf()
    quant = quant_config(args)
    m = export_model(src, args.out, target=args.target, dtype=args.dtype, max_seq=args.max_seq,
                     max_batch=args.max_batch, quant=quant, plugins=args.plugins, trt_version=args.trt_version,
                     kv_dtype=args.kv_dtype,
                     lora=LoraLayout(args.lora_slots, args.lora_rank) if args.lora_slots else None,
                     merge_lora=args.merge_lora, embeddings=args.embeddings, hidden_states=args.hidden_states,
                     hidden_layers=args.hidden_layers,
                     openvino_prefill=args.openvino_prefill)
    if isinstance(m, dict):  # an encoder-decoder export (export/seq2seq_export.py): its seq2seq.json record
        spec = m["spec"]
        print(f"exported {m['family']} ({m['dtype']}, {spec['encoder_layers']} + {spec['decoder_layers']} layers, "
              f"encoder.onnx + decoder.onnx) to {args.out}")
        return 0
    print(summary(m, args.out))
    return 0


def run_head_export(args: argparse.Namespace) -> int:
    """``decodert export HEAD --target-artifact TARGET -o OUT`` (export/heads/; HEAD may be the target's own
    checkpoint folder, whose MTP layer is the head)."""
    from decodert.export.heads import HEAD_MANIFEST, export_head

    if args.target_artifact is None:
        raise DecodertError(f"{args.src} is a draft head checkpoint; export it with --target-artifact TARGET "
                            "(the target artifact it drafts for, exported with --hidden-states)")
    out = Path(args.out)
    if (out / HEAD_MANIFEST).is_file() and not args.force:
        raise DecodertError(f"-o {out} already holds a head; add --force to replace it (or choose another -o)")
    if out.exists() and any(out.iterdir()) and not (out / HEAD_MANIFEST).is_file():
        raise DecodertError(f"-o {out} is a folder with other files; choose an empty or new folder")
    if args.keep_q8 or args.keep_q4_1:
        raise DecodertError("--keep-q8 / --keep-q4-1 are for GGUF targets; a draft head is quantized from its float weights")
    record = export_head(args.src, out, args.target_artifact, quant=quant_config(args))
    quant = f", int{record['quant']['bits']} linears" if record.get("quant") else ""
    print(f"exported {record['family']} head ({record['dtype']}{quant}) for {args.target_artifact} to {out}")
    return 0


def check_replace(out: Path, force: bool) -> None:
    """An artifact already in ``out`` is replaced only with --force (and then said so on stderr);
    a folder holding other files is refused first, --force or not (export/artifact/destination.py)."""
    from decodert.export.artifact import destination

    destination.prepare(out)
    if not (out / MANIFEST).is_file():
        return
    if not force:
        raise DecodertError(f"-o {out} already holds an artifact; add --force to replace it (or choose another -o)")
    print(f"decodert: replacing the artifact in {out} (--force)", file=sys.stderr)


def summary(m: Any, out: Any) -> str:
    """What was written (``m``: the Manifest): the weights' precision (not only the activations'
    dtype) and, for a quantized export, how many weights were transcoded exactly (GGUF only) or rounded."""
    from decodert.export.artifact.inspect import weight_precision

    stored = list(m.quant.per_weight.values()) if m.quant else []
    weights = weight_precision(m)
    lines = [f"exported {m.model.family} ({m.target}, weights {weights}, max_seq {m.max_seq}, "
             f"{(m.weights.bytes or 0) / 1e6:.0f} MB) to {out}"]
    if stored:
        exact = sum(w.source == "transcoded" for w in stored)
        if m.source is not None and m.source.kind == "gguf":
            lines.append(f"quantized {len(stored)} weights: {exact} transcoded exactly from GGUF blocks, "
                         f"{len(stored) - exact} rounded to nearest")
        else:
            lines.append(f"quantized {len(stored)} weights, rounded to nearest")
    return "\n".join(lines)
