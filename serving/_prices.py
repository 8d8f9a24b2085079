"""What a model's tokens cost, for the money a cache saves (``ServerSpec.prices``).

Per million tokens, as providers list them: ``input`` (prompt tokens the engine computes), ``cached_input``
(prompt tokens the engine's own prefix cache served: vLLM's and OpenAI's ``cached_tokens``; default the input
price) and ``output`` (completion tokens). A hit saves what its answer cost to compute, at ``full``; a miss
whose prompt the engine partly reused saves ``reused``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

PER = 1_000_000


class Price(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    input: float = Field(ge=0, allow_inf_nan=False)
    cached_input: float | None = Field(None, ge=0, allow_inf_nan=False)
    output: float = Field(ge=0, allow_inf_nan=False)

    def full(self, prompt_tokens: int, completion_tokens: int) -> float:
        """An answer computed without any cache: every prompt token at the input price, and the output."""
        return (prompt_tokens * self.input + completion_tokens * self.output) / PER

    def reused(self, cached_tokens: int) -> float:
        """What the engine's reuse of ``cached_tokens`` prompt tokens saved against computing them."""
        cached = self.input if self.cached_input is None else self.cached_input
        return cached_tokens * max(0.0, self.input - cached) / PER
