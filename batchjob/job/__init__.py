"""The job runner: a YAML job file in, checkpointed and resumable Parquet (or OpenAI Batch JSONL) out."""
