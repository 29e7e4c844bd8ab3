"""The bounded queue between the HTTP side and the cluster, and which requests join the open run together.

The cluster keeps one open run (``core.runs.open_run``) that micro-batches join between its
steps. One worker thread takes requests off the queue whenever the run has a free micro-batch
(``capacity``) and hands each group to ``start_batch`` (``core.serving.cluster_runs``), which joins
it: the oldest waiting request and every other waiting one that may share a micro-batch with it
(``choose_batch``, up to ``max_batch``), spread over up to ``spread`` micro-batches (the plan's
count) so the stages work on them side by side. A request that arrives while others decode
joins at their next step, not after them. The queue is bounded: a request beyond
``max_waiting`` is refused at once with 429 and a ``Retry-After``. A request whose client leaves
while it waits is removed; one in the run leaves it (its KV caches are dropped at once).
Where a group goes in the run is decided here too, as pure functions: the running micro-batch it
joins as rows (``growable``), and the joins a failed micro-batch's requests make again (``join_groups``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from core.serving.openai_api import ApiError, unavailable
from core.serving.served import ServedRequest

log = logging.getLogger(__name__)


def choose_batch(keys: Sequence[tuple | None], max_batch: int) -> list[int]:
    """Indices of the waiting requests (given by their ``batch_key``, oldest first) the next join
    takes: the oldest, and every later one with its key (None: it runs alone), up to ``max_batch``."""
    if not keys:
        return []
    if keys[0] is None:
        return [0]
    return [i for i, k in enumerate(keys) if k == keys[0]][:max_batch]


def spread(n: int, parts: int) -> list[range]:
    """``n`` requests into ``parts`` (at least 1, at most n) near-equal contiguous groups."""
    parts = max(1, min(parts, n))
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


class BatchQueue:
    """Admits requests, and joins them to the cluster's run on one worker thread until ``close``."""

    def __init__(self, start_batch: Callable[[list[ServedRequest]], None], *, max_waiting: int, max_batch: int,
                 capacity: Callable[[], int] = lambda: 1, spread: int = 1, batch_window_s: float = 0.0,
                 on_cancel_running: Callable[[ServedRequest], None] | None = None,
                 join_now: Callable[[list[ServedRequest]], bool] | None = None):
        self._start_batch = start_batch
        self._join_now = join_now
        """Joins a group on the caller's thread if that cannot block (False: it did not): how ``submit`` joins a
        request that arrives at an idle cluster without the worker's wake-up (a thread hop on its TTFT)."""
        self._taking = False
        """The worker is joining groups it took off the queue."""
        self._capacity = capacity
        """Groups of requests the run can take now, of any ``batch_key`` (free micro-batches, and a running
        one they may join)."""
        self.spread = spread
        self.max_waiting = max_waiting
        self.max_batch = max_batch
        self.batch_window_s = batch_window_s
        """How long the worker waits for more requests once one arrives at an idle cluster."""
        self._on_cancel_running = on_cancel_running or (lambda request: None)
        self._waiting: deque[ServedRequest] = deque()
        self._running: list[ServedRequest] = []
        self._cond = threading.Condition()
        self._closed = False
        self.served = 0
        self.last_run_s = 1.0
        """How long the last finished request was served (the 429's ``Retry-After``)."""
        self._worker = threading.Thread(target=self._loop, name="edgeshard-serve-batches", daemon=True)
        self._worker.start()

    def submit(self, request: ServedRequest) -> None:
        """Queue ``request``; 429 when the queue is full, 503 once the server is stopping. One that arrives at an
        idle cluster (nothing waiting or running, the worker idle) joins at once on this thread if ``join_now``
        can (a burst's later requests still wait for the worker, which takes them together)."""
        with self._cond:
            if self._closed:
                raise unavailable("the server is shutting down")
            if len(self._waiting) >= self.max_waiting:
                retry = max(1, round(self.last_run_s))
                raise ApiError(429, f"the queue is full ({self.max_waiting} requests waiting); retry in about "
                                    f"{retry} s", type="rate_limit_error", code="queue_full",
                               headers={"Retry-After": str(retry)})
            idle = not self._waiting and not self._taking and all(r.done for r in self._running)
            if self._join_now is None or not idle or self.batch_window_s > 0 or self._capacity() < 1:
                self._waiting.append(request)
                self._cond.notify_all()
                return
            self._running.append(request)
        if not self._join(self._join_now, [request]):
            with self._cond:
                self._running.remove(request)
                self._waiting.append(request)
                self._cond.notify_all()
        self.wake()

    def cancel(self, request: ServedRequest) -> None:
        """The client left: drop it from the queue, or take it out of the run at once."""
        request.cancel()
        with self._cond:
            if request in self._waiting:
                self._waiting.remove(request)
                return
            running = request in self._running
        if running:
            self._on_cancel_running(request)

    def wake(self) -> None:
        """A micro-batch of the run is free again (or the run changed): the worker looks again."""
        with self._cond:
            done = [r for r in self._running if r.done]
            for r in done:
                self._running.remove(r)
                if r.started_s is not None:
                    self.last_run_s = time.perf_counter() - r.started_s
            self.served += len(done)
            self._cond.notify_all()

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    @property
    def running(self) -> int:
        """Requests in the run now."""
        with self._cond:
            return sum(not r.done for r in self._running)

    def close(self, timeout_s: float = 10.0) -> None:
        """Refuse new requests, fail the waiting and running ones (503), stop the worker."""
        with self._cond:
            self._closed = True
            left, self._waiting = list(self._waiting), deque()
            running = list(self._running)
            self._cond.notify_all()
        for r in left + running:
            r.fail(unavailable("the server is shutting down"))
        for r in running:
            self._on_cancel_running(r)
        self._worker.join(timeout_s)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not (self._waiting and self._capacity() > 0):
                    self._cond.wait(0.5)
                if self._closed:
                    return
                idle = not any(not r.done for r in self._running)
            if self.batch_window_s > 0 and idle:
                time.sleep(self.batch_window_s)
            with self._cond:
                if self._closed:
                    return
                waiting = list(self._waiting)
                picked = [waiting[i] for i in choose_batch([r.batch_key for r in waiting], self.max_batch)]
                for r in picked:
                    self._waiting.remove(r)
                self._running.extend(picked)
                room = self._capacity() if picked else 0
                groups = [[picked[i] for i in part] for part in spread(len(picked), min(self.spread, room))]
                self._taking = True
            for group in groups:
                self._join(self._start_batch, group)
            with self._cond:
                self._taking = False
            self.wake()

    @staticmethod
    def _join(start, group: list[ServedRequest]):
        """``start(group)``; a bug must not stop the worker (or the event loop): these requests fail, later ones run."""
        try:
            return start(group)
        except Exception as err:
            log.exception("joining a batch failed")
            for r in group:
                r.fail(ApiError(500, f"internal error: {err}", type="server_error"))
            return True


def growable(running: dict[int, tuple[int, bool]], rows: int, max_rows: int) -> int | None:
    """Of the running micro-batches (slot: its live rows, resumed after a failure), the one with the fewest
    live rows that ``rows`` requests may join as rows while it runs, if one has room for them (None: none).
    Any request joins any micro-batch, greedy, sampled or with repetition controls: the last stage samples
    each row by its own request's controls, seed and step count (``agents.techniques.open_run``), so its
    tokens do not depend on its neighbours. A resumed micro-batch keeps its rows. The server places rows
    here before it opens another micro-batch (``ServedModel.start_batch``): a stage's step costs ~1.7 ms
    plus ~0.07 ms a row on the demo model, so one micro-batch of 16 rows costs about half the CPU of two of 8."""
    live = {slot: n for slot, (n, resumed) in running.items() if not resumed and n > 0}
    slot = min(live, key=live.get, default=None)
    return slot if slot is not None and live[slot] + rows <= max_rows else None


def join_groups(requests: list[ServedRequest]) -> list[list[ServedRequest]]:
    """``requests`` as the joins they may share (equal ``batch_key``; a sampled one alone), in order; with
    frequency or presence penalties only with as many tokens so far (what ``first_step`` tells the last stage)."""
    groups: dict[object, list[ServedRequest]] = {}
    for r in requests:
        s = r.parsed.sampling
        counted = (r.batch_key, len(r.tokens)) if s.frequency_penalty or s.presence_penalty else r.batch_key
        groups.setdefault(counted if r.batch_key is not None else id(r), []).append(r)
    return list(groups.values())
