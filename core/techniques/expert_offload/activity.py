"""Per block and expert, what the expert buffer did: the counts behind the studio's heat map.

Fed the ``io`` timeline events of a run (live, or a recorded one in replay), whose ``peer``
names the block, the expert and the outcome (``agents.protocol.expert_activity``). Pure: no
Qt, no I/O, so the view only draws what this counts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from agents.protocol import TimelineEvent
from agents.techniques.expert_offload.activity import EXPERT_OUTCOMES, parse_expert_activity

MEASURES = ("activations", "hit rate", "hits", "misses", "preloads", "evictions", "resident")
"""What a heat-map cell can show: activations = the router's picks (hits + demand reads);
hit rate = hits / activations; misses = demand reads; resident = 1 while the expert is in the
buffer (after its latest event), else 0."""


class ExpertActivity:
    """Counts of hits, demand reads (misses), preloads and evictions per (block, expert)."""

    def __init__(self) -> None:
        self.counts: dict[str, Counter] = {o: Counter() for o in EXPERT_OUTCOMES}
        self.bytes_read = 0
        self.blocks: set[int] = set()
        self.experts = 0
        self._latest: dict[tuple[int, int], tuple[float, bool]] = {}
        """Per expert: (start of its latest event, resident after it). A hit, demand read or preload
        leaves it in the buffer, an eviction takes it out; events are ordered by their start time,
        not by arrival, so a live run and its replay agree whatever order the lanes deliver in."""

    def add(self, events: Iterable[TimelineEvent]) -> bool:
        """Count the expert events among ``events``; True when any was one."""
        seen = False
        for e in events:
            if e.kind != "io":
                continue
            parsed = parse_expert_activity(e.peer)
            if parsed is None:
                continue
            block, expert, outcome = parsed
            self.counts[outcome][(block, expert)] += 1
            latest = self._latest.get((block, expert))
            if latest is None or e.start_s >= latest[0]:
                self._latest[(block, expert)] = (e.start_s, outcome != "evict")
            self.blocks.add(block)
            self.experts = max(self.experts, expert + 1)
            if outcome in ("load", "preload"):
                self.bytes_read += e.nbytes
            seen = True
        return seen

    def is_empty(self) -> bool:
        return not self.blocks

    def is_resident(self, block: int, expert: int) -> bool:
        """Whether the expert is in the buffer after the latest event seen (False: never loaded, or evicted)."""
        latest = self._latest.get((block, expert))
        return bool(latest and latest[1])

    def resident(self) -> list[tuple[int, int]]:
        """The experts in the buffer now, by block and expert."""
        return sorted(key for key, (_, inside) in self._latest.items() if inside)

    def value(self, measure: str, block: int, expert: int) -> float | None:
        """One cell; None for a hit rate of an expert never picked."""
        key = (block, expert)
        if measure == "resident":
            return 1.0 if self.is_resident(block, expert) else 0.0
        hits, loads = self.counts["hit"][key], self.counts["load"][key]
        if measure == "activations":
            return float(hits + loads)
        if measure == "hit rate":
            return hits / (hits + loads) if hits + loads else None
        outcome = {"hits": "hit", "misses": "load", "preloads": "preload", "evictions": "evict"}[measure]
        return float(self.counts[outcome][key])

    def grid(self, measure: str) -> list[list[float | None]]:
        """Rows: the blocks seen (ascending); columns: experts 0..E-1."""
        if measure not in MEASURES:
            raise ValueError(f"unknown measure {measure!r}; one of {', '.join(MEASURES)}")
        return [[self.value(measure, b, x) for x in range(self.experts)] for b in sorted(self.blocks)]

    def totals(self) -> dict[str, int]:
        """Whole-run counts: hits, misses, preloads, evictions, and the hit rate's parts."""
        hits, misses = sum(self.counts["hit"].values()), sum(self.counts["load"].values())
        return {"hits": hits, "misses": misses, "preloads": sum(self.counts["preload"].values()),
                "evictions": sum(self.counts["evict"].values()), "bytes_read": self.bytes_read,
                "resident": len(self.resident())}

    def hit_rate(self) -> float | None:
        t = self.totals()
        return t["hits"] / (t["hits"] + t["misses"]) if t["hits"] + t["misses"] else None
