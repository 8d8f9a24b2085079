"""WHY the policy changes: signals, diagnosis, retraining, proposals, review, canary, rollback.

This room is empty until the agent-loop issue lands; see docs/architecture.md.
"""
