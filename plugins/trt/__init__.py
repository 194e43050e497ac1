"""The TensorRT side of decodert plugin ops: version compatibility, the plugin base class and creators, the enqueue
that runs a Triton kernel on the engine stream."""
