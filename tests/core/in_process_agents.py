"""Agents started in this process on localhost (real ZeroMQ, Curve) and a coordinator opened
on them: the cluster the run tests share when they need no separate agent processes."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def in_process_cluster(devices):
    """Yields ``(coordinator, agents)``, one started agent per name in ``devices``; closes
    the coordinator, then the agents."""
    import transformers  # noqa: F401  (import once here, not concurrently in agents' threads)

    from agents.agent import Agent
    from agents.transport import CurveKeys
    from core.runs.coordinator import AgentEndpoint, Coordinator

    keys = CurveKeys.generate()
    agents = [Agent(d, keys.public).start() for d in devices]
    coordinator = Coordinator([AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents], keys)
    coordinator.open()
    try:
        yield coordinator, agents
    finally:
        coordinator.close()
        for agent in agents:
            agent.close()
