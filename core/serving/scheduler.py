"""The bounded queue between the HTTP side and the cluster, and which requests share a run.

One worker thread takes batches off the queue and hands each to ``run_batch`` (the cluster's
own run machinery, ``core.serving.cluster_runs``): the cluster runs one generation at a time,
so requests that arrive while a run is going wait here and the next run takes every waiting
request that may share it (``choose_batch``), up to ``max_batch``. The queue is bounded: a
request beyond ``max_waiting`` is refused at once with 429 and a ``Retry-After``, never kept
waiting without end. A request whose client leaves while it waits is removed; one in a run is
marked cancelled (the run ends early once every request in it is done).

Not done: requests joining a *running* decode batch between its steps (continuous batching):
that needs the agents' stage run schedule to admit sequences mid-run (docs/serving.md).
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
    """Indices of the waiting requests (given by their ``batch_key``, oldest first) the next run
    takes: the oldest, and every later one with its key (None: it runs alone), up to ``max_batch``."""
    if not keys:
        return []
    if keys[0] is None:
        return [0]
    return [i for i, k in enumerate(keys) if k == keys[0]][:max_batch]


class BatchQueue:
    """Admits requests, and runs them in batches on one worker thread until ``close``."""

    def __init__(self, run_batch: Callable[[list[ServedRequest]], None], *, max_waiting: int, max_batch: int,
                 batch_window_s: float = 0.0, on_cancel_running: Callable[[list[ServedRequest]], None] | None = None):
        self._run_batch = run_batch
        self.max_waiting = max_waiting
        self.max_batch = max_batch
        self.batch_window_s = batch_window_s
        """How long the worker waits for more requests once one arrives at an idle cluster."""
        self._on_cancel_running = on_cancel_running or (lambda batch: None)
        self._waiting: deque[ServedRequest] = deque()
        self._running: list[ServedRequest] = []
        self._cond = threading.Condition()
        self._closed = False
        self.served = 0
        self.last_run_s = 1.0
        self._worker = threading.Thread(target=self._loop, name="edgeshard-serve-batches", daemon=True)
        self._worker.start()

    def submit(self, request: ServedRequest) -> None:
        """Queue ``request``; 429 when the queue is full, 503 once the server is stopping."""
        with self._cond:
            if self._closed:
                raise unavailable("the server is shutting down")
            if len(self._waiting) >= self.max_waiting:
                retry = max(1, round(self.last_run_s))
                raise ApiError(429, f"the queue is full ({self.max_waiting} requests waiting); retry in about "
                                    f"{retry} s", type="rate_limit_error", code="queue_full",
                               headers={"Retry-After": str(retry)})
            self._waiting.append(request)
            self._cond.notify_all()

    def cancel(self, request: ServedRequest) -> None:
        """The client left: drop it from the queue, or mark it in its run (which ends once all are done)."""
        request.cancel()
        with self._cond:
            if request in self._waiting:
                self._waiting.remove(request)
                return
            running = list(self._running)
        if request in running and all(r.done for r in running):
            self._on_cancel_running(running)

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    @property
    def running(self) -> int:
        """Requests in the run going now."""
        with self._cond:
            return len(self._running)

    def close(self, timeout_s: float = 10.0) -> None:
        """Refuse new requests, fail the waiting ones (503), cancel the running batch, stop the worker."""
        with self._cond:
            self._closed = True
            left, self._waiting = list(self._waiting), deque()
            running = list(self._running)
            self._cond.notify_all()
        for r in left:
            r.fail(unavailable("the server is shutting down"))
        if running:
            for r in running:
                r.fail(unavailable("the server is shutting down"))
            self._on_cancel_running(running)
        self._worker.join(timeout_s)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
            if self.batch_window_s > 0:
                time.sleep(self.batch_window_s)
            with self._cond:
                if self._closed:
                    return
                waiting = list(self._waiting)
                picked = [waiting[i] for i in choose_batch([r.batch_key for r in waiting], self.max_batch)]
                for r in picked:
                    self._waiting.remove(r)
                self._running = picked
            t0 = time.perf_counter()
            try:
                self._run_batch(picked)
            except Exception as err:  # a bug must not stop the worker: these requests fail, later ones run
                log.exception("serving a batch failed")
                for r in picked:
                    r.fail(ApiError(500, f"internal error: {err}", type="server_error"))
            finally:
                with self._cond:
                    self._running = []
                    self.served += len(picked)
                self.last_run_s = time.perf_counter() - t0
