"""The agent's clock: wall-clock seconds with perf_counter resolution (events and pings read it)."""

from __future__ import annotations

import time


class AgentClock:
    """Wall-clock seconds with perf_counter resolution and monotonic steps.

    Events from different agents are placed on the coordinator's clock through an
    offset estimated from pings, so the agent's clock must be the one pings read.
    """

    def __init__(self) -> None:
        self._wall0 = time.time()
        self._perf0 = time.perf_counter()

    def __call__(self) -> float:
        return self._wall0 + (time.perf_counter() - self._perf0)

    def at(self, perf_counter_s: float) -> float:
        """This clock's reading at a past ``time.perf_counter()`` value (executors time with it)."""
        return self._wall0 + (perf_counter_s - self._perf0)
