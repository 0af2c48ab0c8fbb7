"""The engine's LoRA adapters: slots on the device, loaded on first use (manager.py)."""
