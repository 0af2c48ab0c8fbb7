"""`batchjob bench --loras N`: rows over many LoRA adapters in one engine (bench.py)."""
