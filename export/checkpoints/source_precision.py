"""What ``decodert run`` (and ``LLM.load`` of a checkpoint) exports: the checkpoint's own precision.

A quantized GGUF is not blown up to fp32 where its own precision keeps the answers (Q4_1 is the
exception, below). The rule, by the block type most of the linear weights are stored in
(``keep_precision``; every quantized choice uses MatMulNBits accuracy level 4, the fast
int8-activation kernels of ONNX Runtime CPU):

    Q4_0         int4, transcoded exactly (Q8_0 weights such as the head kept exact too)
    Q4_1         fp32, dequantized exactly. Kept as int4 (--keep-q4-1 --keep-q8, perplexity 35.4 vs
                 34.0) the fast level-4 kernels round activations to int8, and that flips SmolLM2's
                 flagship answer (greedy "L'Etoile de la Cite ..." instead of Paris; 6/20 seeds say
                 Paris vs 15/20 at fp32); level 0 keeps the answer but is 11x slower per step
                 (docs/benchmarks/history.md, "First run"). `--quant int4` asks for the small export.
    Q8_0         int8, transcoded exactly
    Q4_K Q5_K Q6_K  int8, rounded to nearest (16-64 levels per block onto 256: near exact)
    F32 F16 BF16, an HF folder   fp32 (float weights stay float)
    GPTQ / AWQ HF folder         int4, its blocks transcoded exactly (accuracy level 0; output projection float)
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from decodert.export.quantize.quant import QuantConfig

_INT4 = {"accuracy_level": 4, "bits": 4, "keep_q8": True}
POLICY: dict[str, tuple[QuantConfig | None, str]] = {
    "Q4_0": (QuantConfig(**_INT4), "int4: Q4_0 blocks transcoded exactly"),
    "Q4_1": (None, "fp32: Q4_1 blocks dequantized exactly (int4 at the fast accuracy level changes answers; --quant int4 for 4-bit)"),
    "Q8_0": (QuantConfig(bits=8, accuracy_level=4), "int8: Q8_0 blocks transcoded exactly"),
    **{k: (QuantConfig(bits=8, accuracy_level=4), f"int8: {k} blocks rounded to 8 bits") for k in ("Q4_K", "Q5_K", "Q6_K")},
}
FLOAT = "fp32: float weights"


def linear_types(ckpt: Any) -> Counter:
    """How many quantizable linear weights (not the embedding or head) are stored in each type."""
    quant = QuantConfig(lm_head=False)
    stored = getattr(ckpt, "stored_type", None)
    if stored is None:
        return Counter()
    return Counter(stored(name) for name in ckpt.names() if quant.applies_to(name))


def keep_precision(ckpt: Any) -> tuple[QuantConfig | None, str]:
    """(the QuantConfig that keeps ``ckpt``'s precision, or None for fp32; a short description)."""
    native = ckpt.native_quant() if hasattr(ckpt, "native_quant") else None
    if native is not None:  # GPTQ / AWQ (export/quantize/quant_packed.py)
        return native, f"int4: {ckpt.packed_format.method.upper()} blocks transcoded exactly"
    types = linear_types(ckpt)
    if not types:
        return None, FLOAT
    main = types.most_common(1)[0][0]
    return POLICY.get(main, (None, FLOAT if main in ("F32", "F16", "BF16") else f"fp32: {main} weights"))
