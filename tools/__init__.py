"""Tools over artifacts that are not the runtime: the benchmark harness and the engine-vs-ONNX Runtime check."""
