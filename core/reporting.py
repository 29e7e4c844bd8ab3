"""Long work is a plain function that takes a ``Reporter`` (like Orange's TaskState).

The CLI passes a terminal progress reporter, the GUI a QObject reporter that forwards
through queued signals, tests a ``RecordingReporter``. Work calls ``cancel_requested()``
between steps and raises ``Cancelled`` when it returns True.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Protocol


class Cancelled(Exception):
    """Raised by long work when its reporter asked it to stop."""


class Reporter(Protocol):
    def status(self, text: str) -> None: ...

    def progress(self, done: float, total: float) -> None: ...

    def partial_result(self, value: Any) -> None: ...

    def cancel_requested(self) -> bool: ...


class NullReporter:
    """Reports nowhere and never cancels: for library calls that need no feedback."""

    def status(self, text: str) -> None:
        pass

    def progress(self, done: float, total: float) -> None:
        pass

    def partial_result(self, value: Any) -> None:
        pass

    def cancel_requested(self) -> bool:
        return False


class CancelFlag:
    """A cancel that wakes its waiters at once (``wait_unless_cancelled``), so work blocked on
    a reply (the studio quitting mid-profile) ends when cancelled, not at its next poll."""

    def __init__(self) -> None:
        self._cancel = threading.Event()
        self._cancel_lock = threading.Lock()
        self._wakers: set[threading.Event] = set()

    def cancel(self) -> None:
        self._cancel.set()
        with self._cancel_lock:
            for woken in self._wakers:
                woken.set()

    def cancel_requested(self) -> bool:
        return self._cancel.is_set()

    def _watch(self, woken: threading.Event, on: bool) -> None:
        with self._cancel_lock:
            (self._wakers.add if on else self._wakers.discard)(woken)
        if on and self._cancel.is_set():
            woken.set()


def wait_unless_cancelled(future, reporter: Reporter, timeout_s: float) -> None:
    """Wait until ``future`` (a ``concurrent.futures.Future``) is done, ``timeout_s`` passed, or
    ``reporter`` was cancelled: a ``CancelFlag`` reporter wakes this at once, another one is
    seen at the timeout. The caller checks which it was."""
    woken = threading.Event()
    future.add_done_callback(lambda _f: woken.set())
    watch = getattr(reporter, "_watch", None)
    if watch is not None:
        watch(woken, True)
    try:
        woken.wait(timeout_s)
    finally:
        if watch is not None:
            watch(woken, False)


class PhaseReporter:
    """One phase of a longer task, as the span [``start``, ``start + span``] of its one bar
    (fractions of 1): each phase reports its own (done, total) and the operator still sees a
    single bar that only moves forward (profiling's compute then links went 87 % → 50 % when
    each phase restarted the bar). Everything else goes to ``reporter`` unchanged."""

    def __init__(self, reporter: Reporter, start: float, span: float) -> None:
        self._reporter, self._start, self._span = reporter, start, span

    def status(self, text: str) -> None:
        self._reporter.status(text)

    def progress(self, done: float, total: float) -> None:
        frac = min(1.0, max(0.0, done / total)) if total > 0 else 0.0
        self._reporter.progress(self._start + self._span * frac, 1.0)

    def partial_result(self, value: Any) -> None:
        self._reporter.partial_result(value)

    def cancel_requested(self) -> bool:
        return self._reporter.cancel_requested()

    def __getattr__(self, name: str):  # ``_watch`` (a cancel wakes waits at once), where the reporter has it
        return getattr(self._reporter, name)


class RecordingReporter(CancelFlag, NullReporter):
    """Keeps everything it was told (tests); ``cancel()`` makes the work stop."""

    def __init__(self) -> None:
        super().__init__()
        self.statuses: list[str] = []
        self.progresses: list[tuple[float, float]] = []
        self.partials: list[Any] = []

    def status(self, text: str) -> None:
        self.statuses.append(text)

    def progress(self, done: float, total: float) -> None:
        self.progresses.append((done, total))

    def partial_result(self, value: Any) -> None:
        self.partials.append(value)


class TerminalReporter(NullReporter):
    """A one-line progress bar on stderr, redrawn at most 10 times a second."""

    def __init__(self, stream=None, width: int = 30) -> None:
        self.stream = stream or sys.stderr
        self.width = width
        self._label = ""
        self._last_draw = 0.0

    def status(self, text: str) -> None:
        self._label = text
        self.stream.write(f"\r\x1b[K{text}\n" if self.stream.isatty() else f"{text}\n")
        self.stream.flush()

    def progress(self, done: float, total: float) -> None:
        now = time.monotonic()
        if done < total and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        if not self.stream.isatty():
            return
        frac = 0.0 if total <= 0 else min(1.0, done / total)
        bar = "#" * int(frac * self.width)
        self.stream.write(f"\r\x1b[K[{bar:<{self.width}}] {frac * 100:5.1f}% {self._label}")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()
