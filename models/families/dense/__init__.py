"""Attention-only transformers: one file per family."""
