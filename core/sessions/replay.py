"""Replay of a recorded run: its events and tokens in arrival order, paced by a clock.

One API for the GUI (which polls ``due()`` from a timer and rebuilds its view from
``delivered()`` after a seek) and for ``edgeshard replay RUN --speed 10`` (which
iterates ``play()``). Items come out in the order they arrived live, each at its
arrival time ``recv_s`` divided by the speed, so a replay feeds ``core.runs.metrics``
the same sequence the live view had and shows the same figures.

The clock and the sleep are injectable, which makes a replay deterministic in tests.
Controls (pause, resume, seek, speed) may be called from any thread; a blocked
``play()`` notices them within ``max_sleep_s``.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from core.runs.metrics import RunFigures, compute_figures
from core.sessions.store import RecordedItem, SessionStore


_EPS = 1e-9
"""Items due within a nanosecond count as due: float rounding of clock arithmetic must
not leave play() sleeping zero-length sleeps forever."""


class Replay:
    def __init__(
        self,
        items: Sequence[RecordedItem],
        *,
        speed: float = 1.0,
        paused: bool = False,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        max_sleep_s: float = 0.05,
    ):
        if speed <= 0:
            raise ValueError("speed must be positive")
        self.items = list(sorted(items, key=lambda i: i.seq))
        # Arrival times made non-decreasing: an item is never due before the one before it.
        self._at: list[float] = []
        last = 0.0
        for it in self.items:
            last = max(last, it.recv_s)
            self._at.append(last)
        self._clock, self._sleep, self._max_sleep = clock, sleep, max_sleep_s
        self._lock = threading.RLock()
        self._speed = speed
        self._paused = paused
        self._anchor_pos = 0.0
        self._anchor_clock = clock()
        self._cursor = 0

    @classmethod
    def from_store(cls, store: SessionStore, run_id: int, **kw) -> Replay:
        return cls(store.timeline(run_id), **kw)

    # -- state
    @property
    def duration_s(self) -> float:
        return self._at[-1] if self._at else 0.0

    @property
    def speed(self) -> float:
        return self._speed

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def position_s(self) -> float:
        """Where the replay is on the run's own time axis (0 … duration_s)."""
        with self._lock:
            if self._paused:
                return self._anchor_pos
            pos = self._anchor_pos + (self._clock() - self._anchor_clock) * self._speed
            return min(pos, self.duration_s) if self._cursor >= len(self.items) else pos

    @property
    def finished(self) -> bool:
        return self._cursor >= len(self.items)

    def _reanchor(self) -> None:
        self._anchor_pos = self.position_s
        self._anchor_clock = self._clock()

    # -- controls
    def pause(self) -> None:
        with self._lock:
            self._reanchor()
            self._paused = True

    def resume(self) -> None:
        with self._lock:
            self._anchor_clock = self._clock()
            self._paused = False

    def set_speed(self, speed: float) -> None:
        if speed <= 0:
            raise ValueError("speed must be positive")
        with self._lock:
            self._reanchor()
            self._speed = speed

    def seek(self, t_s: float) -> None:
        """Jump to ``t_s``: items that arrived by then count as delivered (see
        ``delivered()``), the next ``due()``/``play()`` continues after them."""
        with self._lock:
            t = min(max(0.0, t_s), self.duration_s)
            self._anchor_pos = t
            self._anchor_clock = self._clock()
            self._cursor = bisect.bisect_right(self._at, t)

    # -- delivery
    def delivered(self) -> list[RecordedItem]:
        """Everything delivered so far (after a seek: the prefix up to the position)."""
        with self._lock:
            return self.items[: self._cursor]

    def due(self) -> list[RecordedItem]:
        """Items that have become due since the last call (non-blocking; for timers)."""
        with self._lock:
            pos = self.position_s
            end = bisect.bisect_right(self._at, pos + _EPS, lo=self._cursor)
            out = self.items[self._cursor:end]
            self._cursor = end
            return out

    def play(self) -> Iterator[RecordedItem]:
        """Yield every remaining item when it falls due, sleeping in between."""
        while True:
            with self._lock:
                if self._cursor >= len(self.items):
                    return
                pos = self.position_s
                nxt = self._at[self._cursor]
                if not self._paused and nxt <= pos + _EPS:
                    item = self.items[self._cursor]
                    self._cursor += 1
                else:
                    item = None
                    wait = self._max_sleep if self._paused else min(self._max_sleep, (nxt - pos) / self._speed)
            if item is not None:
                yield item
            else:
                self._sleep(wait)

    def figures(self) -> RunFigures:
        """The run's figures over what has been delivered (what the view shows now)."""
        items = self.delivered()
        return compute_figures([i.event for i in items if i.event is not None],
                               [i.tokens for i in items if i.tokens is not None])
