"""Backends behind one protocol (ONNX Runtime, TensorRT) and the KV cache they write: the one owner of what a cache row holds."""
