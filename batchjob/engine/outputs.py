"""What goes into the engine (Request) and what it hands back (RequestOutput, StepMetrics).

Torch-free, so the job layer imports these at the top without loading the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchjob.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from batchjob.model.vision.images import ImagePrompt


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    # With params.prompt_logprobs: the first prompt token whose logprob is wanted (a continuation's or a label's); the
    # blocks of the tokens before position prompt_logprobs_start - 1 may then come from the prefix cache.
    prompt_logprobs_start: int = 1
    # The id of an earlier request of the same stream whose prompt opens with this one's first prompt_logprobs_start
    # - 1 tokens: this one waits for those to be computed, so that it reads them from the prefix cache (the labels of
    # one row share one prefill of the row's prompt).
    after: str | None = None
    # With params.prompt_logprobs: other tokens scored in place of the token at prompt_logprobs_start, from the same
    # row of logits (a classification's other labels' first tokens: one row of the prompt serves every label).
    first_token_alternatives: list[int] = field(default_factory=list)
    # The engine's LoRA adapter (EngineConfig.lora) applied to this request; None: the base model.
    lora: str | None = None
    # A vision-language model's images, as its processor made them (prompt_token_ids are its token_ids).
    images: ImagePrompt | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def total_time(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class TokenLogprob:
    """One output token's log-probability under the model, and the `top_logprobs` likeliest (id, logprob) there;
    for a prompt token, its rank too (vLLM's Logprob.rank: 1 + the number of tokens likelier than it)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None


@dataclass
class CompletionOutput:
    """One of a request's n samples."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    """The top-level text, token_ids, finish_reason and logprobs are the first sample's (vLLM's outputs[0]);
    `outputs` holds all n samples when the engine made them."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "length_capped" | "abort" | "error"
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    # vLLM's: one entry per prompt token, None where none was asked for (always the first, which has no context)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Request.first_token_alternatives' logprobs, in their order (None where the request asked for none)
    alternative_logprobs: list[TokenLogprob] | None = None

    @property
    def samples(self) -> list[CompletionOutput]:
        """All samples; a single one built from the top-level fields when `outputs` is empty."""
        return self.outputs or [CompletionOutput(0, self.text, self.token_ids, self.finish_reason, self.logprobs)]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tpot(self) -> float | None:
        m = self.metrics
        if m is None or m.first_token_time is None or m.finished_time is None or len(self.token_ids) < 2:
            return None
        return (m.finished_time - m.first_token_time) / (len(self.token_ids) - 1)


@dataclass
class StepMetrics:
    step: int
    time: float  # wall-clock at the end of the step
    step_time: float
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    # A 0-1 fraction of the KV blocks in use, as vLLM's SchedulerStats.kv_cache_usage (which its gauge
    # vllm:kv_cache_usage_perc reports unscaled; metrics.prom's batchjob_kv_cache_usage_perc does the same).
    kv_cache_usage: float
    num_preemptions: int  # in this step
    prefix_cache_queries: int  # cumulative, in tokens
    prefix_cache_hits: int  # cumulative, in tokens
    num_waiting: int
    num_running: int
    token_budget: int  # this step's max_num_batched_tokens (under "auto", the level the tuner tried)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass
class EmbedderStats:
    """What an Embedder's embed() ran, summed over its calls."""

    forward_passes: int = 0
    embedded_tokens: int = 0  # the inputs' tokens
    padded_tokens: int = 0  # each pass's rows x its longest input: at most embedder.MAX_PADDING x embedded_tokens


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """One input's sentence embedding, shaped as vLLM's LLM.embed() returns it (`.outputs.embedding`)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]  # what the model read: special tokens included, cut at its max_seq_length
    truncated: bool  # the text had more tokens than the model's max_seq_length; its end was left out

    @property
    def embedding(self) -> list[float]:
        return self.outputs.embedding


@dataclass
class ScoreOutput:
    """One row of Engine.score: teacher-forced, one prefill and no decode. Without labels, the scored tokens (the
    continuation's, or the prompt's after its first) with their logprobs, and the negative log-likelihood over them:
    sum, mean and perplexity (exp of the mean). With labels, each label's logprob as the prompt's continuation (the
    sum over its tokens), the likeliest label, and the labels' probabilities normalised over them."""

    request_id: str
    prompt_token_ids: list[int]  # the tokens read: the prompt, then the continuation (without labels)
    num_scored_tokens: int = 0
    token_logprobs: list[TokenLogprob] | None = None
    sum_nll: float | None = None
    mean_nll: float | None = None
    perplexity: float | None = None
    labels: list[str] | None = None
    label_logprobs: list[float] | None = None
    label: str | None = None
    label_probs: list[float] | None = None
    error: str | None = None
    finish_reason: str | None = None  # "length" when scored, "abort" or "error" otherwise


def row_requests(
    request_id: str,
    prompt_ids: list[int],
    tails: list[list[int]],
    start: int,
    params: SamplingParams,
    labels: bool,
    lora: str | None = None,
) -> list[Request]:
    """One scoring row as engine requests, each id `request_id`-j for what it scores (the j-th tail). A plain row or a
    continuation: one request, scored from `start` on. Labels (each tail one): the first label's request computes the
    prompt and scores every label's first token from its last row (first_token_alternatives); a label of more tokens
    has a request of its own that reads the prompt's blocks from the prefix cache once the first has computed them
    (`after`) and scores its tokens after the first; a one-token label needs no request. Each through `lora`."""
    first = f"{request_id}-0"
    if not labels:
        return [Request(first, prompt_ids + tails[0], params, prompt_logprobs_start=start, lora=lora)]
    if not all(tails):
        raise ValueError("a label of no tokens has nothing to score")
    alternatives = [t[0] for t in tails[1:]]
    lead = Request(first, prompt_ids + tails[0], params, start, first_token_alternatives=alternatives, lora=lora)
    return [lead] + [
        Request(f"{request_id}-{j}", prompt_ids + tail, params, start + 1, after=first, lora=lora)
        for j, tail in enumerate(tails)
        if j and len(tail) > 1
    ]


def score_output(
    request_id: str, outputs: list[RequestOutput], start: int, labels: list[str] | None = None
) -> ScoreOutput:
    """The ScoreOutput of one row from the engine's outputs of its row_requests (in any order), which scored from
    token `start` on (the continuation's or the first label's first)."""
    outputs = sorted(outputs, key=lambda o: int(o.request_id.rpartition("-")[2]))
    first = outputs[0]
    failed = next((o for o in outputs if o.finish_reason in ("error", "abort")), None)
    if failed is not None:
        return ScoreOutput(request_id, first.prompt_token_ids, error=failed.error, finish_reason=failed.finish_reason)
    scored = first.prompt_logprobs[start:]
    if not scored:  # the engine answers such a request (a one-token text, an empty tail): nothing to score
        error = f"nothing to score: {len(first.prompt_token_ids)} tokens, scored from token {start} on (empty text?)"
        return ScoreOutput(request_id, first.prompt_token_ids, error=error, finish_reason="error")
    if labels is not None:
        # a label's first token from the first request's alternatives, the rest (if any) from its own request
        rest = {int(o.request_id.rpartition("-")[2]): o.prompt_logprobs[start + 1 :] for o in outputs[1:]}
        per_label = [scored] + [[alt, *rest.get(j, [])] for j, alt in enumerate(first.alternative_logprobs, 1)]
        sums = [math.fsum(t.logprob for t in lps) for lps in per_label]
        top = max(sums)
        weights = [math.exp(s - top) for s in sums]  # shifted by the largest: no underflow to an all-zero sum
        total = math.fsum(weights)
        return ScoreOutput(
            request_id,
            first.prompt_token_ids[:start],
            labels=labels,
            label_logprobs=sums,
            label=labels[sums.index(top)],
            label_probs=[w / total for w in weights],
            finish_reason="length",
        )
    nll = -math.fsum(t.logprob for t in scored)
    mean = nll / len(scored)
    return ScoreOutput(
        request_id,
        first.prompt_token_ids,
        num_scored_tokens=len(scored),
        token_logprobs=scored,
        sum_nll=nll,
        mean_nll=mean,
        perplexity=math.exp(mean),
        finish_reason="length",
    )
