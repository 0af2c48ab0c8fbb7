"""The engine and tokenizer that the job layer needs, as Protocols: `batchjob.engine.Engine` implements them, and so
does the fake engine of the tests (tests/job/test_contracts.py checks both). Torch-free, like the rest of the layer."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

from batchjob.engine.config import EmbedderConfig, EngineConfig
from batchjob.engine.outputs import EmbedderStats, EmbeddingRequestOutput, Request, RequestOutput, StepMetrics
from batchjob.engine.sampling_params import SamplingParams
from batchjob.engine.token_budget import AutoTokenBudget
from batchjob.model.chat_shape import Chat

if TYPE_CHECKING:  # the vision module imports torch, which the CLI loads with the model only
    from batchjob.model.vision.images import ImagePrompter


class Tokenizer(Protocol):
    chat_template: str | None  # the model's (jinja2); None for a model without one, such as most base models

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def escape(self, data: str, special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str: ...

    def encode_chats(self, chats: list[Chat]) -> list[list[int] | Exception]: ...

    def with_template_kwargs(self, kwargs: dict) -> Tokenizer: ...


class JobEngine(Protocol):
    config: EngineConfig  # block_size for planning, max_num_seqs for `plan`
    tokenizer: Tokenizer
    max_model_len: int
    model_digest: str  # sha256 of the weights, for the job's fingerprint
    model_revision: str | None  # the Hub commit, where the model came from the Hub
    numerics: dict[str, str]  # the resolved device, dtypes and ops backend: what else decides the numbers
    lora_digests: dict[str, str]  # each LoRA adapter's content digest, by name (engine.lora)
    image_prompter: ImagePrompter | None  # a vision-language model's processor for prompts with images; else None
    num_kv_blocks: int
    kv_bytes_per_token: int
    kv_pool_sized_by: str  # Engine.kv_pool_sized_by

    @property
    def token_budget(self) -> int: ...

    @property
    def auto_budget(self) -> AutoTokenBudget | None: ...

    def stream(self, requests: Iterable[Request]) -> Iterator[RequestOutput]: ...

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora: str | list[str | None] | None = None,
    ) -> list[RequestOutput]: ...

    def add_step_callback(self, fn: Callable[[StepMetrics], None]) -> None: ...

    def largest_step_host_bytes(self) -> int | None: ...

    def fit_kv_pool(self, num_blocks: int) -> bool: ...

    def abort_all(self) -> None: ...

    def abort_waiting(self) -> None: ...


class TokenizedInput(Protocol):
    token_ids: list[int]
    truncated: bool


class Embedder(Protocol):
    """What an embedding job (task: embed) needs: batchjob.engine.Embedder."""

    config: EmbedderConfig  # max_num_batched_tokens, for how much to hand it at once
    model_digest: str
    model_revision: str | None
    numerics: dict[str, str]

    @property
    def stats(self) -> EmbedderStats: ...  # forward passes and tokens so far, for _SUCCESS's `this_run`

    @property
    def max_seq_length(self) -> int: ...

    @property
    def dimension(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def tokenize(self, texts: list[str], truncation_side: str = "right") -> list[TokenizedInput]: ...

    def can_shorten_to(self, dimensions: int) -> bool: ...

    def shorten(self, embedding: list[float], dimensions: int) -> list[float]: ...

    def embed(self, prompts: list[list[int]], use_tqdm: bool = True) -> list[EmbeddingRequestOutput]: ...


def model_identity(engine: JobEngine | Embedder) -> dict:
    """The fingerprint's parts that are known only once the model is loaded (and its LoRA adapters' digests, by
    name, where it has any)."""
    loras = getattr(engine, "lora_digests", None)
    identity = {"model_digest": engine.model_digest, "model_revision": engine.model_revision}
    return identity | {"numerics": engine.numerics} | ({"lora": loras} if loras else {})
