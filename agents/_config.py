"""How the loop judges: one frozen value that the memory, the judge and the proposer read."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoopConfig:
    """How the loop judges: ``warmup`` windows fill the replay cache before the ``measure`` windows are
    counted; ``realise`` windows after a promotion measure its realised gain; ``interactive``: every proposal
    waits for a person, whatever the guardrails allow; ``max_candidates`` single edits replayed per pass;
    ``step_s`` the series' step (None: a twentieth of the window); ``retrain_every``: the learned eviction
    model is retrained every that many windows (0: never)."""

    warmup: int = 3
    measure: int = 1
    realise: int = 2
    interactive: bool = False
    max_candidates: int = 12
    seed: int = 0
    step_s: float | None = None
    retrain_every: int = 4
