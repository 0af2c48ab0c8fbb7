"""Per-request sampling settings, validated at construction (vLLM's names, OpenAI's for logprobs and
response_format)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from batchjob.engine.grammar import GrammarKey, check_grammar, grammar_key

MAX_TOP_LOGPROBS = 20  # OpenAI's limit
# OpenAI's limit too; beyond it one row's n would hold the whole batch's memory (and a rerun would do it again).
MAX_N = 128
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily
CONSTRAINTS = ("response_format", "regex", "choice")  # at most one per request
# torch.Generator.manual_seed takes a signed or unsigned 64-bit value; anything else fails up front.
SEED_RANGE = {"ge": -(2**63), "lt": 2**64}


def refuse_bool(what: str) -> Callable[[Any], Any]:
    """A field validator (mode "before") for a number, or a list or mapping of numbers: pydantic reads true as 1 and
    false as 0, so a flag written where a number goes (`prompt_logprobs: true`, `max_tokens: false`,
    `temperature: true`) would run as a setting nobody wrote."""

    def check(value: Any) -> Any:
        values = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        for one in values if isinstance(values, list) else [values]:
            if isinstance(one, bool):
                raise ValueError(f"{what}, not {str(one).lower()}")
        return value

    return check


not_a_bool = refuse_bool("an integer")  # a count or a seed


class JsonSchemaSpec(BaseModel):
    """OpenAI's response_format.json_schema: {name, schema, strict, description}."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: {type: text}, {type: json_object} or {type: json_schema, json_schema: {...}}."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only there")
        return self


class SamplingParams(BaseModel):
    # An infinite temperature or penalty turns masked (-inf) logits into NaN, and the sampler would fail the step.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    n: int = Field(1, ge=1, le=MAX_N, description="samples per prompt; the prompt is computed once")
    max_tokens: int = Field(64, ge=0, description="0: the prompt only (scoring with prompt_logprobs), no token drawn")
    temperature: float = Field(0.0, ge=0.0)
    top_k: int = Field(0, ge=0, description="0 disables")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, **SEED_RANGE)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = Field(1.0, gt=0.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[int, float] = Field(default_factory=dict, description="token id -> added to its logit")
    logprobs: bool = Field(False, description="the log-probability of each output token")
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS, description="and of the k likeliest tokens at each step")
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="vLLM's: each prompt token's logprob and its k likeliest others"
    )
    # Constrained decoding (at most one): the output follows the schema, the regex, or is one of the choices.
    response_format: ResponseFormat | None = None
    regex: str | None = None
    choice: list[str] | None = None

    _counts = field_validator(
        "n", "max_tokens", "top_k", "seed", "top_logprobs", "prompt_logprobs", "stop_token_ids", mode="before"
    )(not_a_bool)
    _numbers = field_validator(
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        mode="before",
    )(refuse_bool("a number"))

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if any(not s for s in self.stop):
            raise ValueError("stop: empty stop strings are not allowed")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        if self.max_tokens == 0 and (self.prompt_logprobs is None or self.n > 1):
            raise ValueError("max_tokens: 0 (no token drawn) is for scoring: it needs prompt_logprobs and n 1")
        if any(not -100 <= b <= 100 for b in self.logit_bias.values()):
            raise ValueError("logit_bias: biases must be within [-100, 100]")
        constraints = [k for k in CONSTRAINTS if getattr(self, k) is not None]
        if self.response_format is not None and self.response_format.type == "text":
            constraints.remove("response_format")
        if len(constraints) > 1:
            raise ValueError(f"{' and '.join(constraints)}: at most one output constraint per request")
        if self.choice is not None and not self.choice:
            raise ValueError("choice: needs at least one string")
        if self.grammar_key is not None:
            check_grammar(self.grammar_key)
        return self

    def with_overrides(self, overrides: dict[str, Any]) -> SamplingParams:
        """These settings with a request's own fields on top, validated. A request's output constraint replaces
        these settings' constraint whole (its regex drops a job-level schema; `response_format: {type: text}` frees
        it), as any other per-request field replaces the job's value."""
        base = self.model_dump()
        if any(k in overrides for k in CONSTRAINTS):
            base.update(dict.fromkeys(CONSTRAINTS))
        return SamplingParams.model_validate({**base, **overrides})

    @property
    def grammar_key(self) -> GrammarKey | None:
        """The output constraint, canonically (one compiled grammar per key); None when the output is free."""
        return grammar_key(self.response_format, self.regex, self.choice)

    @property
    def greedy(self) -> bool:
        # As vLLM does: dividing by a temperature this small overflows the logits to inf, and softmax to NaN.
        return self.temperature < GREEDY_BELOW

    @property
    def deterministic(self) -> bool:
        """Same prompt gives the same output: greedy, or seeded."""
        return self.greedy or self.seed is not None
