"""The TensorRT backend (``tensorrt`` 10.x/11.x and ``tensorrt_rtx``): engines, their contexts and CUDA graphs, the
verify pass, image and M-RoPE inputs, refitting adapters."""
