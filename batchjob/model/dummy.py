"""`load_format: dummy` (vLLM's name): random weights with a real model's architecture, so that speed and memory can
be measured without weights on disk.

The architecture comes from an HF config.json (a file, or a folder holding one) or from a config shipped here:
`smollm2-135m-instruct` (the built-in model's) and `llama-3-8b`. Weights are drawn from a seeded generator in a
fixed order, so the same seed on the same device gives the same model; projections are N(0, initializer_range) as
HF initialises them, norms are ones, so that the residual stream keeps a sensible scale and greedy decoding does
not collapse to one token."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from batchjob.model.builtin import DEFAULT_MODEL
from batchjob.model.config import GEMMA_ARCHITECTURES, ModelConfig, weight_shapes
from batchjob.model.errors import ModelError, ModelNotFoundError
from batchjob.model.loader import LoadedModel, load_model, reading_model
from batchjob.model.tokenizer import Tokenizer
from batchjob.model.vision.config import IDEFICS3

CONFIGS_DIR = Path(__file__).parent / "configs"


def dummy_config_path(model: str) -> Path:
    """The config.json behind a dummy model name or path."""
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return path
    shipped = CONFIGS_DIR / f"{model}.json"
    if shipped.is_file():
        return shipped
    names = sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))
    raise ModelNotFoundError(
        f"load_format dummy: no config for {model!r}; give an HF config.json (or its folder) or one of {names}"
    )


def dummy_tensors(
    c: ModelConfig, seed: int, std: float = 0.02, device: torch.device | str = "cpu", dtype=torch.float32
) -> Iterator[tuple[str, torch.Tensor]]:
    """Drawn on `device` in fp32 one tensor at a time (then cast), so an 8B model never sits in fp32 at once; a
    consumer that writes each tensor away holds one at a time."""
    g = torch.Generator(device=device).manual_seed(seed)
    for name, shape in weight_shapes(c).items():
        if name.endswith("norm.weight"):  # Gemma's norms scale by 1 + w: zeros there, as transformers draws them
            fill = torch.zeros if c.architecture in GEMMA_ARCHITECTURES else torch.ones
            yield name, fill(shape, dtype=dtype, device=device)
        elif name.endswith(".bias"):
            yield name, torch.zeros(shape, dtype=dtype, device=device)
        else:
            yield name, (std * torch.randn(shape, generator=g, device=device)).to(dtype)


def dummy_weights(
    c: ModelConfig, seed: int, std: float = 0.02, device: torch.device | str = "cpu", dtype=torch.float32
) -> dict[str, torch.Tensor]:
    return dict(dummy_tensors(c, seed, std, device, dtype))


def synthetic_tokenizer() -> Tokenizer:
    """Byte-level with no merges: any text encodes to byte ids 0..255; generated ids above 255 decode to nothing."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = HFTokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend, bos_token=None, eos_token=None, chat_template=None)


@functools.cache  # the check builds several engines; each would try the built-in (and pip, offline) again
def _tokenizer(vocab_size: int) -> Tokenizer:
    """The built-in model's tokenizer where it loads (from the local cache) and fits the vocabulary, else bytes."""
    try:
        tok = load_model(DEFAULT_MODEL).tokenizer
    except (ModelError, OSError):
        return synthetic_tokenizer()
    return tok if tok.vocab_size <= vocab_size else synthetic_tokenizer()


@dataclass(frozen=True)
class DummySpec:
    """What a dummy model is before its weights are drawn: its architecture, the config file it came from, the
    draw's seed and scale, and the digest that names the draw."""

    config: ModelConfig
    path: Path
    seed: int
    std: float
    digest: str

    @property
    def tokenizer(self) -> Tokenizer:
        return _tokenizer(self.config.vocab_size)

    def tensors(self, device: torch.device | str = "cpu", dtype=torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        return dummy_tensors(self.config, self.seed, self.std, device, dtype)


def dummy_spec(model: str, seed: int = 0) -> DummySpec:
    path = dummy_config_path(model)
    with reading_model(path):
        raw = json.loads(path.read_text())
        if (raw.get("architectures") or [None])[0] == IDEFICS3:
            raise ValueError("load_format dummy draws text models only, not a vision-language model's tower")
        config = ModelConfig.from_hf(raw)
    digest = hashlib.sha256(f"dummy:{seed}:".encode() + path.read_bytes()).hexdigest()
    return DummySpec(config, path, seed, raw.get("initializer_range", 0.02), digest)


def load_dummy(
    model: str, seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> LoadedModel:
    spec = dummy_spec(model, seed)
    return LoadedModel(spec.config, dict(spec.tensors(device, dtype)), spec.tokenizer, spec.path, spec.digest)
