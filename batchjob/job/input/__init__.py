"""The input side: reading rows (Parquet, JSONL, OpenAI Batch), building prompts, planning the work."""
