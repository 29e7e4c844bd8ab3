"""The run's own time at a replay's position, for the Sessions scrubber's label.

A replay is paced by arrival times (``recv_s``: when each item reached the recorder), but the
header and the timeline give the run's own times (events' start/end, tokens' times). The
scrubber's label read the arrival span plus the replay's lead-in (0.09 s for a 0.06 s
expert-offload run, its header "a 0.06 s run"); it now reads the run's own time reached by
the items delivered so far, so at the end it equals the header's span."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from core.sessions.store import RecordedItem


def _item_times(item: RecordedItem) -> tuple[float, ...]:
    if item.event is not None:
        return item.event.start_s, item.event.end_s
    return (item.tokens.t_s,) if item.tokens is not None else ()


class RunClock:
    """Arrival position → how far into the run (first event or token on) its delivered items reach."""

    def __init__(self, items: Sequence[RecordedItem]) -> None:
        ordered = sorted(items, key=lambda i: i.seq)  # the replay's order, arrival times made non-decreasing
        times = [t for i in ordered for t in _item_times(i)]
        self._t0 = min(times, default=0.0)
        self._arrivals: list[float] = []
        self._reached: list[float] = []
        arrived, reached = 0.0, self._t0
        for item in ordered:
            arrived = max(arrived, item.recv_s)
            reached = max((reached, *_item_times(item)))
            self._arrivals.append(arrived)
            self._reached.append(reached)

    @property
    def span_s(self) -> float:
        """The run's own duration, first event to last (the Sessions header's "a … s run")."""
        return self._reached[-1] - self._t0 if self._reached else 0.0

    def at(self, arrival_s: float) -> float:
        """How far into the run the items that arrived by ``arrival_s`` reach (0 before the first)."""
        n = bisect.bisect_right(self._arrivals, arrival_s + 1e-9)
        return self._reached[n - 1] - self._t0 if n else 0.0


__all__ = ["RunClock"]
