"""Errors of the agents room.

    AgentError
    ├── WorkloadError        a trace or event source cannot be read into requests (file and line named)
    ├── SignalUnavailable    a collector cannot run here (no GPU, no driver, no profiler); reported once
    ├── ProposalError        a proposal cannot be stored, found or moved to the state asked for
    │   └── StaleEvidence    the proposal's replay evidence is older than what it would change
    └── PlannerError         the optional LLM planner is misconfigured or its model failed

The loop never lets one of these become a policy change: a failing collector is left out of the signals, a
finding that cannot be computed is "not testable", a proposal that cannot be judged waits for a person.
"""

from __future__ import annotations


class AgentError(Exception):
    """Base of every error the agents room raises on purpose."""


class WorkloadError(AgentError, ValueError):
    """A trace or event source cannot be turned into requests."""


class SignalUnavailable(AgentError):
    """A collector cannot collect on this machine; ``reason`` says why (shown once, then the loop goes on)."""

    def __init__(self, collector: str, reason: str) -> None:
        super().__init__(f"{collector}: {reason}")
        self.collector = collector
        self.reason = reason


class ProposalError(AgentError, ValueError):
    """A proposal cannot be stored, found, or moved from its state to the one asked for."""


class StaleEvidence(ProposalError):
    """A proposal's evidence predates the policy, model or output distribution it would act on."""


class PlannerError(AgentError):
    """The optional LLM planner is misconfigured, or its chat model failed."""
