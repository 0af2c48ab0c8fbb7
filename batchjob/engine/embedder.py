"""The embedding API: Embedder(folder, **config).embed(texts), as vLLM's LLM(model, task="embed").embed(prompts).

Inputs are sorted by length and packed into forward passes of up to max_num_batched_tokens tokens whose rows x longest
is at most MAX_PADDING times their tokens, so that a pass holds texts of near lengths (a BERT encoder's attention pads
to the longest on a CPU; a decoder's paged attention reads each sequence alone) and one long text among short ones
runs in a pass of its own; results come back in input order. On a CPU (torch ops) or a CUDA device (Triton
kernels), as the generation engine picks them (model_runner.pick_device, pick_ops_backend, pick_dtype)."""

from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import replace
from typing import Literal

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer as HFTokenizer

from batchjob.engine.config import EmbedderConfig
from batchjob.engine.host_memory import keep_freed_memory
from batchjob.engine.model_runner import device_numerics, load_ops, pick_device, pick_dtype, pick_ops_backend
from batchjob.engine.outputs import EmbedderStats, EmbeddingOutput, EmbeddingRequestOutput
from batchjob.env import configure_threads
from batchjob.model.arithmetic import arithmetic_label, arithmetic_path
from batchjob.model.cpu_native import native_ops_for
from batchjob.model.decoder_embedding import DecoderEmbeddingModel
from batchjob.model.encoder import Encoder, Tokenized, load_encoder
from batchjob.model.errors import ModelNotFoundError
from batchjob.model.loader import folder_digest, locate_model

__all__ = ["Embedder", "EmbedderConfig", "EmbeddingRequestOutput"]


# A pass's rows x longest over its tokens, at most: a pass of near lengths. Its attention on a CPU was one SDPA call
# padded to the longest, where one 256-token text among 1,500 one-word ones padded them all to 256 tokens (5.6x the
# CPU time and 2.6x the peak memory of the job without a bound; docs/benchmarks.md); it is now a call per length
# (ops.varlen_attention), which near lengths keep few.
MAX_PADDING = 1.25


def embedding_batches(lengths: list[int], budget: int, max_padding: float = MAX_PADDING) -> list[list[int]]:
    """Indices into `lengths`, shortest first, cut into passes of at most `budget` tokens (a longer one alone) whose
    rows x longest is at most `max_padding` times their tokens."""
    batches: list[list[int]] = []
    tokens = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        n = lengths[i]  # the pass's longest, as the indices come shortest first
        if not batches or tokens + n > budget or (len(batches[-1]) + 1) * n > max_padding * (tokens + n):
            batches.append([])
            tokens = 0
        batches[-1].append(i)
        tokens += n
    return batches


class Embedder:
    """Sentence embeddings from a local sentence-transformers folder of a BERT-family encoder or of a decoder
    (Llama, Qwen2, Mistral: Qwen3-Embedding, gte-Qwen2), as its config.json says."""

    def __init__(self, model: str, **config):
        self.config = EmbedderConfig(**config)
        self.device = pick_device(self.config)
        if self.device.type == "cpu":
            configure_threads(self.config.num_threads or os.cpu_count() or 1)
            keep_freed_memory()
        self.dtype = pick_dtype(self.config, self.device)
        self.ops_backend = pick_ops_backend(self.config, self.device)
        location = locate_model(model)  # a folder, a built-in name or a Hub id
        path = self.model_path = location.path
        if not path.is_dir():
            raise ModelNotFoundError(
                f"model {model!r} is not a sentence-transformers folder ({path}): an Embedder takes one"
            )
        self.encoder: Encoder = load_encoder(path, self.dtype, load_ops(self.ops_backend), self.device)
        self.prompt = self._resolve_prompt()
        # the tokens of each text that pooling may leave out (the folder's include_prompt)
        self._prompt_length = self.encoder.prompt_length(self.prompt) if self.prompt else 0
        self._request_counter = itertools.count()
        self._stats = EmbedderStats()
        self._left_tokenizer: HFTokenizer | None = None
        # What decides the numbers, for a job's fingerprint: every file of the folder, by name, and how it is computed.
        self.model_digest = folder_digest(path, [p for p in path.rglob("*") if p.is_file()])
        self.model_revision = location.revision
        ops = self.ops_backend
        decoder = isinstance(self.encoder.model, DecoderEmbeddingModel)  # BERT's ops have no C++ form
        if ops == "torch" and decoder and native_ops_for(self.device, self.dtype) is not None:
            ops += "+cpp"  # as the generation engine names it: the C++ kernels sum in other orders than torch's
        dtype = str(self.dtype).removeprefix("torch.")
        self.numerics = {
            "device": device_numerics(self.device),
            "dtype": dtype,
            "ops_backend": ops,
            "task": "embed",
            **arithmetic_label(arithmetic_path(dtype, task="embed")),
        }
        config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
        self._matryoshka = config.get("is_matryoshka") or config.get("matryoshka_dimensions")

    def _resolve_prompt(self) -> str | None:
        """As sentence-transformers' encode resolves its prompt and prompt_name."""
        c, prompts = self.config, self.encoder.prompts
        if c.prompt is not None:
            return c.prompt
        name = c.prompt_name or self.encoder.default_prompt_name
        if name is None:
            return None
        if name not in prompts:
            raise ValueError(f"prompt_name {name!r} is not one of the model's prompts: {sorted(prompts)}")
        return prompts[name]

    @property
    def stats(self) -> EmbedderStats:
        """A copy of the counts so far: forward passes, embedded tokens, padded tokens."""
        return replace(self._stats)

    @property
    def max_seq_length(self) -> int:
        return self.encoder.max_seq_length

    @property
    def dimension(self) -> int:
        """The length of an embedding."""
        return self.encoder.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.encoder.model.config.vocab_size

    def can_shorten_to(self, dimensions: int) -> bool:
        """Whether the model was trained to give its embeddings' first `dimensions` values meaning of their own (a
        Matryoshka model: config.json's is_matryoshka or matryoshka_dimensions, as vLLM reads them)."""
        if dimensions == self.dimension:
            return True
        allowed = self._matryoshka
        return dimensions < self.dimension and (allowed is True or dimensions in (allowed or ()))

    def shorten(self, embedding: list[float], dimensions: int) -> list[float]:
        """The embedding's first `dimensions` values, normalised again if the model normalises (as OpenAI's API and
        vLLM give a shortened embedding)."""
        vector = torch.tensor(embedding[:dimensions])
        return (F.normalize(vector, dim=0) if self.encoder.pooling.normalize else vector).tolist()

    def tokenize(self, texts: list[str], truncation_side: Literal["right", "left"] = "right") -> list[Tokenized]:
        """Token ids as embed() reads them, the prompt (if any) before each text, special tokens included, cut to
        max_seq_length keeping the text's start (right, as sentence-transformers does) or its end (left); `truncated`
        says whether anything was cut."""
        texts = [(self.prompt or "") + t for t in texts]
        if truncation_side == "right":
            return self.encoder.tokenize(texts)
        if self._left_tokenizer is None:
            self._left_tokenizer = HFTokenizer.from_str(self.encoder.tokenizer.to_str())
            self._left_tokenizer.enable_truncation(self.max_seq_length, direction="left")
        return [Tokenized(e.ids, bool(e.overflowing)) for e in self._left_tokenizer.encode_batch(texts)]

    def embed(self, prompts: str | list[str] | list[list[int]], use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One output per prompt, in input order. A text is tokenized with the model's special tokens and cut at
        max_seq_length (`truncated` says so); an empty text is its special tokens alone ([CLS] [SEP] for BERT) and
        gets an embedding as sentence-transformers gives it. The prompt (config prompt or prompt_name) is put before
        every text and counts in max_seq_length. A token-id list is taken as it is, no prompt added: it must be
        non-empty and at most max_seq_length long. use_tqdm shows a tqdm.auto bar with prompts done and input
        tokens/s."""
        from tqdm.auto import tqdm

        if isinstance(prompts, str):
            prompts = [prompts]
        inputs = self._tokenized(prompts)
        outputs: list[EmbeddingRequestOutput | None] = [None] * len(inputs)
        start, tokens = time.perf_counter(), 0
        with tqdm(total=len(inputs), desc="Processed prompts", unit="req", disable=not use_tqdm) as bar:
            for batch in embedding_batches([len(t.token_ids) for t in inputs], self.config.max_num_batched_tokens):
                batch_ids = [inputs[i].token_ids for i in batch]
                prompt_lengths = [self._prompt_length if isinstance(prompts[i], str) else 0 for i in batch]
                vectors = self.encoder.embed(batch_ids, prompt_lengths).tolist()
                self._stats.forward_passes += 1
                self._stats.embedded_tokens += sum(map(len, batch_ids))
                self._stats.padded_tokens += len(batch_ids) * max(map(len, batch_ids))
                for i, vector in zip(batch, vectors):
                    request_id = str(next(self._request_counter))
                    ids = inputs[i].token_ids
                    outputs[i] = EmbeddingRequestOutput(request_id, EmbeddingOutput(vector), ids, inputs[i].truncated)
                    tokens += len(ids)
                bar.set_postfix_str(f"input {tokens / (time.perf_counter() - start):,.0f} tok/s", refresh=False)
                bar.update(len(batch))
        return outputs

    def _tokenized(self, prompts: list[str] | list[list[int]]) -> list[Tokenized]:
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        out = dict(zip(texts, self.tokenize([prompts[i] for i in texts])))
        vocab = self.encoder.model.config.vocab_size
        for i, ids in enumerate(prompts):
            if i in out:
                continue
            if not 0 < len(ids) <= self.max_seq_length:
                raise ValueError(f"prompt {i}: {len(ids)} token ids; expected 1 to {self.max_seq_length}")
            if not all(0 <= t < vocab for t in ids):
                raise ValueError(f"prompt {i}: a token id outside the vocabulary (0 to {vocab - 1})")
            out[i] = Tokenized(list(ids), truncated=False)
        return [out[i] for i in range(len(prompts))]
