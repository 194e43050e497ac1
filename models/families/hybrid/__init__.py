"""Hybrid families: attention beside convolutions, Gated DeltaNet or Mamba2 layers, one file per family."""
