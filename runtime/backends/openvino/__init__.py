"""OpenVINO as a candidate for a phase of an artifact (runtime/backends/placement.py): its execution provider in ONNX Runtime."""
