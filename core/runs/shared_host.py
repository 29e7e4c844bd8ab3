"""Processor sharing of one host's cores, for simulators of runs whose agents share a machine.

A local cluster runs every agent as a process on the same few cores: jobs computing at once
slow each other. ``SharedCores`` keeps the jobs that compute now and their remaining work (in
seconds at a full core); n jobs progress at min(1, cores / (n + background)) each, where
``background`` counts other runnable processes of the host (another user's work). The
simulator owns the event heap: ``push(t, key, version)`` asks it to call ``finish(key, version,
t)`` at ``t``; a completion whose version is stale (the rate changed since) is ignored.
Used by ``core.runs.simulator`` (layer sharding's stages) and the attention-offload simulator
(compute replicas and memory agents).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable


class SharedCores:
    def __init__(self, cores: float, push: Callable[[float, Hashable, int], None], background: float = 0.0):
        if cores <= 0 or background < 0:
            raise ValueError("host cores must be > 0 and background processes >= 0")
        self.cores, self.background, self.push = cores, background, push
        self.active: dict[Hashable, list] = {}  # key -> [remaining work, start, payload, version]
        self.since = 0.0
        self.version = 0

    def rate(self, jobs: int | None = None) -> float:
        """Progress per second of each of ``jobs`` jobs (default: the active ones) computing at once."""
        n = len(self.active) if jobs is None else jobs
        return min(1.0, self.cores / (n + self.background)) if n else 1.0

    def _advance(self, t: float) -> None:
        rate = self.rate()
        for a in self.active.values():
            a[0] -= (t - self.since) * rate
        self.since = t

    def _reschedule(self, t: float) -> None:
        # Versions are unique over the whole simulation, not per job: a per-job counter
        # restarted at 0 let a stale completion of a stage's previous job match its next
        # job's version and finish it early (3 stages, bubbles, K >= 3 on 2 cores then never finished).
        rate = self.rate()
        for key, a in self.active.items():
            self.version += 1
            a[3] = self.version
            self.push(t + max(0.0, a[0]) / rate, key, a[3])

    def start(self, key: Hashable, work: float, t: float, payload=None) -> None:
        """Job ``key`` starts at ``t`` with ``work`` seconds of full-core work."""
        self._advance(t)
        self.active[key] = [work, t, payload, 0]
        self._reschedule(t)

    def finish(self, key: Hashable, version: int, t: float) -> tuple[float, object] | None:
        """(start, payload) of job ``key`` done at ``t``; None for a stale completion."""
        a = self.active.get(key)
        if a is None or a[3] != version:
            return None
        self._advance(t)
        del self.active[key]
        self._reschedule(t)
        return a[1], a[2]
