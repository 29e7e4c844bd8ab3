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


class RecordingReporter(NullReporter):
    """Keeps everything it was told (tests); ``cancel()`` makes the work stop."""

    def __init__(self) -> None:
        self.statuses: list[str] = []
        self.progresses: list[tuple[float, float]] = []
        self.partials: list[Any] = []
        self._cancel = threading.Event()

    def status(self, text: str) -> None:
        self.statuses.append(text)

    def progress(self, done: float, total: float) -> None:
        self.progresses.append((done, total))

    def partial_result(self, value: Any) -> None:
        self.partials.append(value)

    def cancel(self) -> None:
        self._cancel.set()

    def cancel_requested(self) -> bool:
        return self._cancel.is_set()


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
