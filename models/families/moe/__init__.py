"""Mixture-of-experts families: one file per family."""
