"""Checkpoint readers: HF safetensors folders and GGUF files as lazy tensors, tokenizers, precision and sampling defaults."""
