"""LoRA adapters: PEFT folders read into canonical form (peft.py), the graph's adapter slots (layout.py)."""
