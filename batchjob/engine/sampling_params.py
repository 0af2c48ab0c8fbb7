"""Per-request sampling settings, validated at construction (vLLM's names)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_k: int = Field(0, ge=0, description="0 disables")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    # torch.Generator.manual_seed takes a signed or unsigned 64-bit value; anything else fails the request up front.
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = Field(1.0, gt=0.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logprobs: bool = False

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if any(not s for s in self.stop):
            raise ValueError("stop: empty stop strings are not allowed")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def deterministic(self) -> bool:
        """Same prompt gives the same output: greedy, or seeded."""
        return self.greedy or self.seed is not None
