"""dtype names shared by the kernels and the TensorRT plugin (Triton reads ``str(dtype)``)."""

from __future__ import annotations

ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "uint8": 1}


def dtype_name(buf) -> str:
    """"float16" for torch.float16 / a DevPtr("float16") / numpy float16."""
    return str(buf.dtype).split(".")[-1]


def precision(buf) -> str:
    """tl.dot input precision: exact float32 products for float32 caches, tensor cores otherwise."""
    return "ieee" if dtype_name(buf) == "float32" else "tf32"
