"""The queued bridge from core callbacks (any thread) to the GUI thread.

The coordinator calls ``on_timeline_event`` / ``on_token_event`` from its worker threads,
at thousands of events a second. Sending one queued signal per event would flood the GUI
event queue, so the bridge appends to a lock-protected buffer and posts ONE wake-up when
the buffer turns non-empty; the GUI thread then drains it at most ``max_rate_hz`` times a
second and emits each batch as a list. Nothing here touches a widget from a worker.
"""

from __future__ import annotations

import threading
import time

from PySide6.QtCore import QObject, Qt, QTimer, Signal

from agents.protocol import TimelineEvent, TokenEvent


class EventBridge(QObject):
    """Thread-safe sink for run events; emits them in batches on the GUI thread."""

    timeline_events_arrived = Signal(list)
    """list[TimelineEvent], in arrival order."""
    token_events_arrived = Signal(list)
    """list[TokenEvent], in arrival order."""

    _woken = Signal()

    def __init__(self, parent: QObject | None = None, max_rate_hz: float = 30.0):
        super().__init__(parent)
        self._lock = threading.Lock()
        self._timeline: list[TimelineEvent] = []
        self._tokens: list[TokenEvent] = []
        self._wake_posted = False
        self._period_ms = max(1, int(round(1000.0 / max_rate_hz)))
        self._last_drain = 0.0
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.timeout.connect(self.flush)
        self._woken.connect(self._on_bridge_woken, Qt.ConnectionType.QueuedConnection)

    # -- any thread ----------------------------------------------------------------------
    def on_timeline_event(self, event: TimelineEvent) -> None:
        self._push(self._timeline, (event,))

    def on_timeline_events(self, events) -> None:
        self._push(self._timeline, tuple(events))

    def on_token_event(self, event: TokenEvent) -> None:
        self._push(self._tokens, (event,))

    # The coordinator's ``RunSink`` protocol (core/runs/coordinator.py): the bridge is a sink.
    on_event = on_timeline_event
    on_tokens = on_token_event

    def _push(self, buffer: list, items: tuple) -> None:
        if not items:
            return
        with self._lock:
            buffer.extend(items)
            if self._wake_posted:
                return
            self._wake_posted = True
        try:
            self._woken.emit()
        except RuntimeError:  # the bridge's Qt side is gone (window closed mid-run): drop
            pass

    # -- GUI thread ----------------------------------------------------------------------
    def _on_bridge_woken(self) -> None:
        if self._timer.isActive():
            return
        wait_ms = self._period_ms - int((time.monotonic() - self._last_drain) * 1000)
        self._timer.start(max(0, wait_ms))

    def flush(self) -> None:
        """Emit everything buffered now (also called at a run's end so nothing lingers)."""
        with self._lock:
            timeline, self._timeline = self._timeline, []
            tokens, self._tokens = self._tokens, []
            self._wake_posted = False
        self._last_drain = time.monotonic()
        if timeline:
            self.timeline_events_arrived.emit(timeline)
        if tokens:
            self.token_events_arrived.emit(tokens)

    def pending(self) -> int:
        with self._lock:
            return len(self._timeline) + len(self._tokens)
