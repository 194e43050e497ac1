"""Triton GPU kernels behind the decodert TensorRT plugins (and runnable on CPU with TRITON_INTERPRET=1).

    rope_kv.py           fused RoPE (q and k) + write k/v rows into the cache at past_lengths + s
    decode_attention.py  S == 1: split-K (flash-decoding) partial softmax per split + reduce; one
                         program per (row, kv head, split) serves all the kv head's q heads (GQA)
    prefill_attention.py S >= 1: causal flash attention over the cache after the write
    rms_norm.py          RMSNorm, optionally fused with the residual add
    launch.py            device-pointer wrappers, the TensorRT stream, workspace layout, and
                         cached_attention(): the whole op from the kernels above
"""
