"""LoRA at export: adapters merged into the weights (merge.py, ``--merge-lora``). The adapter slots and PEFT folders
both sides read are decodert/artifact/ (lora_layout.py, peft.py)."""
