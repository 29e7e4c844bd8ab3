"""Run long work off the GUI thread and hear from it through queued signals.

Long work in core/ is a plain function taking a ``Reporter`` (core/reporting.py). The GUI
gives it a ``QtReporter``: its methods are called on the worker thread and only emit
signals; the reporter object lives on the GUI thread, so every connected slot runs there
(Qt queues a signal emitted from another thread). A widget is never touched from a worker.

``TaskRunner`` runs one task at a time per purpose (a panel's "deploy", "solve", "run"):
starting a new task cancels the old one and silences it, so a slow stale result can never
overwrite a newer one. A silenced task's result may hold a live resource (a connected
``Coordinator``: an IO thread and a ZeroMQ context), so ``start(..., on_discarded=release)``
hands such a result to ``release`` instead of dropping it. Progress is rate-limited so a
tight loop cannot flood the event queue.

A screen may be closed, and its runner deleted, while a task still runs: the worker then emits
only through its reporter, which nothing but Python references owns (not the runner, whose C++
deletion would take a child along mid-emit: a segfault), and the runner's slots check it is
still alive before they touch it.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any, Callable

import shiboken6
from PySide6.QtCore import QCoreApplication, QEvent, QObject, Qt, Signal

from core.errors import EdgeShardError
from core.reporting import Cancelled, CancelFlag

log = logging.getLogger(__name__)

TaskId = int


class QtReporter(QObject, CancelFlag):
    """A ``core.reporting.Reporter`` that forwards everything through Qt signals.

    Safe to call from any thread. ``progress`` is emitted at most every
    ``min_progress_interval_s`` (the first and the final ``done >= total`` always pass).
    """

    status_reported = Signal(str)
    progress_reported = Signal(float, float)
    partial_result_reported = Signal(object)
    task_ended = Signal(int, str, object)
    """A ``TaskRunner``'s worker: its task's id, outcome and payload (the runner may be gone)."""

    def __init__(self, parent: QObject | None = None, min_progress_interval_s: float = 0.05):
        QObject.__init__(self, parent)
        CancelFlag.__init__(self)
        self._min_interval = min_progress_interval_s
        self._last_progress = -1e9
        self._lock = threading.Lock()

    # -- Reporter protocol (any thread) --------------------------------------------------
    def status(self, text: str) -> None:
        self.status_reported.emit(str(text))

    def progress(self, done: float, total: float) -> None:
        now = time.monotonic()
        with self._lock:
            final = total > 0 and done >= total
            if not final and now - self._last_progress < self._min_interval:
                return
            self._last_progress = now
        self.progress_reported.emit(float(done), float(total))

    def partial_result(self, value: Any) -> None:
        self.partial_result_reported.emit(value)

    # -- GUI side: cancel() (CancelFlag) asks the work to stop at its next cancel_requested()
    # check, and wakes it where it waits on a reply (core.reporting.wait_unless_cancelled)


class TaskRunner(QObject):
    """Runs ``fn(reporter, *args, **kwargs)`` on a worker thread, one current task at a time.

    Signals carry the task id so a view can match them to what it started; signals of a
    task that was superseded or cancelled are dropped (only ``task_cancelled`` is emitted
    for it when it ends). Errors: an ``EdgeShardError`` becomes ``task_failed`` with its
    message (what the operator should read); any other exception is a bug, so it is
    logged with its traceback and reported as "Unexpected error: ..." — never shown raw.
    """

    task_started = Signal(int)
    task_finished = Signal(int, object)
    task_failed = Signal(int, str)
    task_cancelled = Signal(int)
    status_reported = Signal(int, str)
    progress_reported = Signal(int, float, float)
    partial_result_reported = Signal(int, object)
    busy_changed = Signal(bool)


    def __init__(self, parent: QObject | None = None, name: str = "task",
                 min_progress_interval_s: float = 0.05):
        super().__init__(parent)
        self._name = name
        self._min_interval = min_progress_interval_s
        self._next_id = 0
        self._current: TaskId | None = None
        self._reporters: dict[TaskId, QtReporter] = {}
        self._threads: dict[TaskId, threading.Thread] = {}
        self._on_discarded: dict[TaskId, Callable[[Any], Any]] = {}
        self._furthest: dict[TaskId, float] = {}
        """The current task's furthest progress (done / total)."""

    # -- control (GUI thread) ------------------------------------------------------------
    def start(self, fn: Callable[..., Any], *args: Any, on_discarded: Callable[[Any], Any] | None = None,
              **kwargs: Any) -> TaskId:
        """Cancel the current task (if any) and start ``fn`` with a fresh reporter.

        ``on_discarded(result)`` is called on the GUI thread with a result the task returned
        after it was superseded or cancelled (nobody receives it): release it there.
        """
        self.cancel()
        self._next_id += 1
        task_id = self._next_id
        if on_discarded is not None:
            self._on_discarded[task_id] = on_discarded
        reporter = QtReporter(None, self._min_interval)  # no parent: see the module's docstring
        reporter.task_ended.connect(self._on_worker_task_ended, Qt.ConnectionType.QueuedConnection)
        reporter.status_reported.connect(
            functools.partial(self._on_reporter_status, task_id), Qt.ConnectionType.QueuedConnection)
        reporter.progress_reported.connect(
            functools.partial(self._on_reporter_progress, task_id), Qt.ConnectionType.QueuedConnection)
        reporter.partial_result_reported.connect(
            functools.partial(self._on_reporter_partial, task_id), Qt.ConnectionType.QueuedConnection)
        self._reporters[task_id] = reporter
        thread = threading.Thread(
            target=self._run, args=(task_id, reporter, fn, args, kwargs),
            name=f"edgeshard-{self._name}-{task_id}", daemon=True)
        self._threads[task_id] = thread
        was_busy = self._current is not None
        self._current = task_id
        thread.start()
        self.task_started.emit(task_id)
        if not was_busy:
            self.busy_changed.emit(True)
        return task_id

    def cancel(self) -> None:
        """Ask the current task to stop; its later reports and result are ignored."""
        if self._current is None:
            return
        self._reporters[self._current].cancel()
        self._current = None
        self.busy_changed.emit(False)

    def request_stop(self) -> None:
        """Ask the current task to stop but keep listening to it: it stays current until
        it ends, then ``task_cancelled`` (or its error) arrives. For a Stop button."""
        if self._current is not None:
            self._reporters[self._current].cancel()

    def is_busy(self) -> bool:
        return self._current is not None

    def current_task(self) -> TaskId | None:
        return self._current

    def alive_threads(self) -> list[threading.Thread]:
        return [t for t in self._threads.values() if t.is_alive()]

    def shutdown(self, timeout_s: float = 5.0) -> bool:
        """Cancel and join every thread this runner started; True if all have ended."""
        return shutdown_together([self], timeout_s)

    def _cancel_all(self) -> None:
        self.cancel()
        for reporter in self._reporters.values():
            reporter.cancel()

    def _join_until(self, deadline: float) -> None:
        for thread in list(self._threads.values()):
            thread.join(max(0.0, deadline - time.monotonic()))
        # deliver the ends the workers queued, so a discarded result is released now
        QCoreApplication.sendPostedEvents(self, QEvent.Type.MetaCall)

    # -- worker thread -------------------------------------------------------------------
    def _run(self, task_id: TaskId, reporter: QtReporter, fn: Callable[..., Any],
             args: tuple, kwargs: dict) -> None:
        """Runs ``fn``; tells its end only through ``reporter`` (the runner may be deleted meanwhile)."""
        try:
            result = fn(reporter, *args, **kwargs)
        except Cancelled:
            reporter.task_ended.emit(task_id, "cancelled", None)
        except EdgeShardError as err:
            reporter.task_ended.emit(task_id, "failed", str(err))
        except Exception as err:  # a bug: keep the traceback in the log, show plain words
            log.exception("task %s failed", task_id)
            reporter.task_ended.emit(task_id, "failed", f"Unexpected error: {type(err).__name__}: {err}")
        else:
            if reporter.cancel_requested():
                reporter.task_ended.emit(task_id, "discarded", result)
            else:
                reporter.task_ended.emit(task_id, "finished", result)

    # -- GUI thread ----------------------------------------------------------------------
    def _on_worker_task_ended(self, task_id: int, outcome: str, payload: object) -> None:
        if not shiboken6.isValid(self):  # deleted while the task ran: nobody to tell
            return
        thread = self._threads.pop(task_id, None)
        if thread is not None:
            thread.join(1.0)  # it has emitted its last signal; joining is immediate
        reporter = self._reporters.pop(task_id, None)
        if reporter is not None:
            reporter.deleteLater()
        current = task_id == self._current
        if current:
            self._current = None
        release = self._on_discarded.pop(task_id, None)
        if outcome == "discarded" or (outcome == "finished" and not current):
            self._release(task_id, release, payload)
            outcome = "cancelled"
        if outcome == "cancelled" or not current:
            self.task_cancelled.emit(task_id)
        elif outcome == "failed":
            self.task_failed.emit(task_id, str(payload))
        else:
            self.task_finished.emit(task_id, payload)
        if current:
            self.busy_changed.emit(False)

    @staticmethod
    def _release(task_id: int, release: Callable[[Any], Any] | None, payload: object) -> None:
        if release is None or payload is None:
            return
        try:
            release(payload)
        except Exception:  # a failing release must not break the runner; keep the traceback
            log.exception("releasing the discarded result of task %s failed", task_id)

    def _on_reporter_status(self, task_id: int, text: str) -> None:
        if shiboken6.isValid(self) and task_id == self._current:
            self.status_reported.emit(task_id, text)

    def _on_reporter_progress(self, task_id: int, done: float, total: float) -> None:
        """A task's bar never goes backwards: a report below the furthest one is dropped (a task's
        phases should weigh themselves into one bar: ``core.reporting.PhaseReporter``)."""
        if not shiboken6.isValid(self) or task_id != self._current or total <= 0:
            return
        fraction = done / total
        if fraction < self._furthest.get(task_id, 0.0):
            return
        self._furthest = {task_id: fraction}  # only the current task's
        self.progress_reported.emit(task_id, done, total)

    def _on_reporter_partial(self, task_id: int, value: object) -> None:
        if shiboken6.isValid(self) and task_id == self._current:
            self.partial_result_reported.emit(task_id, value)


def shutdown_together(runners: Iterable[TaskRunner], timeout_s: float = 5.0) -> bool:
    """Cancel every task of ``runners`` first, then join them all against one deadline; True if
    every thread ended. A screen with several runners (Sessions has four) then quits within
    ``timeout_s`` — joined one runner after another, a task still finishing a read held up the
    next runner's cancel, and each runner could take the whole timeout."""
    runners = list(runners)
    for runner in runners:
        runner._cancel_all()
    deadline = time.monotonic() + timeout_s
    for runner in runners:
        runner._join_until(deadline)
    return not any(runner.alive_threads() for runner in runners)


def warm_import(module: str) -> threading.Thread:
    """Import ``module`` on a daemon thread ahead of the work that needs it. A first ``import torch``
    holds the GIL in long C stretches (loading libtorch: ~0.5 s at load 18) wherever it runs, so on a
    run's worker it stalled the GUI thread under the live timeline (the demo's first spatial run: gaps of
    0.3-1.3 s at load 19); started when the technique is picked, it stalls while the plan is read. A
    task started before it ends waits on the same import lock: the module is never imported twice."""
    def warm() -> None:
        import importlib

        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 — only a warm-up: the task that needs it says what is wrong
            log.debug("warming %s failed", module, exc_info=True)

    thread = threading.Thread(target=warm, name=f"warm-{module}", daemon=True)
    thread.start()
    return thread
