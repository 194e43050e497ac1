"""decodert: export LLM checkpoints to prefill/decode ONNX graphs and TensorRT engines, run them lean."""

from decodert.artifact.version import __version__  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402

__all__ = ["DecodertError", "LLM", "__version__"]


def __getattr__(name: str):
    # `from decodert import LLM` (the façade: a checkpoint is exported on first load) without importing
    # onnxruntime at package import time.
    if name == "LLM":
        from decodert.api import LLM

        return LLM
    raise AttributeError(name)
