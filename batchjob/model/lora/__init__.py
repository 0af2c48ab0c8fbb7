"""LoRA adapters: their PEFT files (files.py, without torch) and their weights applied beside the matmuls
(weights.py)."""
