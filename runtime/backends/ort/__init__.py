"""The ONNX Runtime backend: the prefill/decode graphs bound in place, the verify pass (its sessions'
options and thread pins: runtime/backends/ort_session.py)."""
