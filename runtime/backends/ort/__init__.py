"""The ONNX Runtime backend: session options and thread pins, the prefill/decode graphs bound in place, the verify
pass."""
