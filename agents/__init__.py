"""WHY the policy changes: signals, diagnosis, replayed proposals, review, canary, promotion or rollback.

    evocache agent run --trace FILE --policy FILE --window N --json OUT
    evocache agent watch --events FILE [--store DIR]
    evocache proposals list | show ID | approve ID | reject ID
    evocache demo [--interactive]

``signals`` collects (access events, NVML, host, torch.profiler traces, Nsight Compute CSVs), ``diagnosis``
tests (Granger causality, key drift, change points, knees, output shifts, bimodal latency, rules that never
hit, tenants that push others out); the loop (``_loop``, a LangGraph graph) turns findings into candidate
edits (``_proposer``), judges each by replay (``_judge``, over ``controller.replay.PolicySimulator``), stores
the best as a proposal (``_proposals``) and rolls it out on the policy store's canary after a review, every
write through one actuator (``_actuator``). Heavy imports (statsmodels, ruptures, LangGraph, matplotlib)
happen in the code that needs them.
"""
