"""The Run screen's Serve toggle: the loaded plan behind an OpenAI-compatible endpoint, watched live.

Toggled on, it starts what ``edgeshard serve`` starts (``core.serving.ServingEndpoint``) over the
studio's connected agents, the selected model and plan, on loopback with a fresh API key, every
request recorded in the studio's workspace. It shows the endpoint's URL and a button that copies
the key, the open run's work on a timeline (each request is a micro-batch: its boxes carry its
micro-batch index), one row per request (state, tokens, TTFT and TPOT from its arrival), and a
requests/s and tokens/s plot. Loading the plan and stopping run off the GUI thread.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from pathlib import Path

import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import (QHBoxLayout, QHeaderView, QLabel, QLineEdit, QPushButton, QSplitter, QTableWidget,
                               QTableWidgetItem, QVBoxLayout, QWidget)

from gui.timeline import TimelineView
from gui.widgets import say_why_disabled
from gui.timeline.event_bridge import EventBridge

COLUMNS = ("Request", "State", "Tokens", "TTFT", "TPOT", "Prompt")
PLOT_SECONDS = 60
"""How much of the requests/s and tokens/s history the plot keeps."""


def request_row(r) -> tuple[str, ...]:
    """A served request as the table shows it (``core.serving.served.ServedRequest``)."""
    state = ("left" if r.cancelled else "failed" if r.failed is not None else r.finish_reason and "done"
             or "decoding" if r.tokens else "waiting")
    ttft = None if r.first_token_s is None else r.first_token_s - r.arrived_s
    tpot = (None if r.first_token_s is None or len(r.tokens) < 2
            else (r.last_token_s - r.first_token_s) / (len(r.tokens) - 1))
    ms = lambda s: "—" if s is None else f"{s * 1e3:.1f} ms"  # noqa: E731
    return r.id[-8:], state, str(len(r.tokens)), ms(ttft), ms(tpot), r.prompt_text.replace("\n", " ")[:60]


class _Stream:
    """The open run's stream into the GUI thread's bridge (a ``RunSink``)."""

    def __init__(self, bridge: EventBridge) -> None:
        self.bridge = bridge

    def on_event(self, event) -> None:
        self.bridge.on_timeline_event(event)

    def on_tokens(self, tokens) -> None:
        self.bridge.on_token_event(tokens)


class ServePanel(QWidget):
    """A Serve toggle and, while serving, the endpoint, its requests and their rates."""

    serving_changed = Signal(bool)
    _started = Signal(object, str)
    """(endpoint or None, error text) from the starting thread."""

    def __init__(self, state, beside: QWidget | None = None, parent: QWidget | None = None,
                 refresh_ms: int = 250) -> None:
        super().__init__(parent)
        self.state = state
        self.beside = beside
        """Hidden while serving (the Run screen's own run controls and monitor): the server holds the
        agents, so a single run cannot start then, and the served view gets the screen's height."""
        self.endpoint = None
        self._store = None
        self.key = ""
        self.setAccessibleName("Serve panel")
        self.toggle = QPushButton("Serve")
        self.toggle.setCheckable(True)
        self.toggle.setAccessibleName("Serve")
        self.toggle.setToolTip("Serve the selected model and plan over the connected agents at an "
                               "OpenAI-compatible endpoint on this machine (loopback, a key required)")
        self.toggle.toggled.connect(self._on_toggle_toggled)
        self.status = QLabel("Not serving")
        self.status.setAccessibleName("Serve status")
        self.url_edit = QLineEdit()
        self.url_edit.setReadOnly(True)
        self.url_edit.setAccessibleName("Endpoint URL")
        self.url_edit.setPlaceholderText("endpoint URL")
        self.copy_key = QPushButton("Copy key")
        self.copy_key.setAccessibleName("Copy API key")
        self.copy_key.setToolTip("Copy the endpoint's API key (the client's api_key, sent as a bearer token)")
        self.copy_key.setEnabled(False)
        say_why_disabled({self.copy_key: "not serving: press Serve to start the endpoint"})
        self.copy_key.clicked.connect(self._on_copy_key_clicked)
        row = QHBoxLayout()
        row.addWidget(self.toggle)
        row.addWidget(self.status)
        row.addWidget(self.url_edit, 1)
        row.addWidget(self.copy_key)

        self.timeline = TimelineView()
        self.timeline.setAccessibleName("Served requests timeline")
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setAccessibleName("Served requests")
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().setVisible(False)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setStretchLastSection(True)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.plot = pg.PlotWidget()
        self.plot.setAccessibleName("Requests and tokens per second")
        self.plot.setMinimumHeight(90)
        self.plot.setBackground(self.palette().color(QPalette.ColorRole.Base))
        self.plot.getAxis("left").setTextPen(self.palette().color(QPalette.ColorRole.Text))
        self.plot.getAxis("bottom").setTextPen(self.palette().color(QPalette.ColorRole.Text))
        self.plot.addLegend(offset=(4, 4), labelTextColor=self.palette().color(QPalette.ColorRole.Text))
        self.plot.setLabel("bottom", "s")
        self.plot.setLimits(yMin=0)  # an idle endpoint's zero rates were drawn on an axis of -0.5..0.5
        self.tokens_curve = self.plot.plot(name="tokens/s", pen=pg.mkPen("#3b82f6", width=2))
        self.requests_curve = self.plot.plot(name="requests/s", pen=pg.mkPen("#f59e0b", width=2))
        lower = QSplitter(Qt.Orientation.Horizontal)
        lower.addWidget(self.table)
        lower.addWidget(self.plot)
        lower.setStretchFactor(0, 3)
        lower.setStretchFactor(1, 2)
        self.details = QSplitter(Qt.Orientation.Vertical)
        self.details.addWidget(self.timeline)
        self.details.addWidget(lower)
        self.details.setVisible(False)
        self.details.setMinimumHeight(240)
        self.details.setStretchFactor(0, 3)
        self.details.setStretchFactor(1, 2)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 4, 0, 0)
        layout.addLayout(row)
        layout.addWidget(self.details, 1)

        self.bridge = EventBridge(self)
        self.bridge.timeline_events_arrived.connect(self.timeline.append_events)
        self._started.connect(self._on_started, Qt.ConnectionType.QueuedConnection)
        self._rates: deque[tuple[float, float, float]] = deque()
        self._last_count = (time.monotonic(), 0, 0)
        self._timer = QTimer(self)
        self._timer.setInterval(refresh_ms)
        self._timer.timeout.connect(self.refresh)

    # ------------------------------------------------------------------ starting and stopping
    def _on_toggle_toggled(self, on: bool) -> None:
        if on:
            self._start()
        else:
            self.stop()

    def _why_not(self) -> str:
        s = self.state
        if s is None or s.agents is None:
            return "connect to agents first (Cluster screen)"
        if s.plan is None:
            return "make a plan first (Plan screen)"
        if not s.model_path or not Path(s.model_path, "config.json").exists():
            return "choose a model checkpoint first"
        return ""

    def _start(self) -> None:
        why = self._why_not()
        if why:
            self.status.setText(f"Cannot serve: {why}")
            self.toggle.setChecked(False)
            return
        self.toggle.setEnabled(False)
        self.status.setText("Loading the plan…")
        self.key = secrets.token_urlsafe(24)
        coordinator, plan, model_dir, workspace = self.state.agents, self.state.plan, self.state.model_path, \
            self.state.workspace
        threading.Thread(target=self._start_endpoint, args=(coordinator, plan, model_dir, workspace),
                         name="studio-serve-start", daemon=True).start()

    def _start_endpoint(self, coordinator, plan, model_dir: str, workspace: str) -> None:
        """Worker thread: load the plan once and start the endpoint (what ``edgeshard serve`` does)."""
        try:
            from core.runs.batching import micro_batch_count
            from core.runs.generation import GenerationSettings, load_tokenizer
            from core.serving import EndpointLimits, ServedModel, ServeSettings, ServingEndpoint, bind
            from core.sessions.store import SessionStore

            store = SessionStore(workspace) if workspace else None
            session = None if store is None else store.create_session(f"Studio serve {time.strftime('%Y-%m-%d %H:%M')}")
            settings = GenerationSettings(mode="no-bubbles", threads=1)
            served = ServedModel(coordinator, plan, model_dir, Path(model_dir).name, load_tokenizer(model_dir),
                                 ServeSettings(generation=settings, max_tokens=256), store=store, session_id=session)
            served.observer = _Stream(self.bridge)
            served.load()
            endpoint = ServingEndpoint(served, bind("127.0.0.1", 0), key=self.key, limits=EndpointLimits(),
                                       spread=micro_batch_count(plan))
            self._store = store
            endpoint.start()
        except Exception as err:  # shown in the panel; the studio stays up
            self._started.emit(None, f"{type(err).__name__}: {err}")
            return
        self._started.emit(endpoint, "")

    def _on_started(self, endpoint, error: str) -> None:
        self.toggle.setEnabled(True)
        if endpoint is None:
            self.status.setText(f"Cannot serve: {error}")
            self.toggle.blockSignals(True)
            self.toggle.setChecked(False)
            self.toggle.blockSignals(False)
            return
        self.endpoint = endpoint
        self.toggle.setText("Stop serving")  # the pressed "Serve" looked the same as the released one
        self.url_edit.setText(self.url)
        self.copy_key.setEnabled(True)
        self.status.setText(f"Serving {endpoint.served.name}")
        self.timeline.clear()
        self.timeline.set_lanes(list(endpoint.served.plan.devices()))
        self.details.setVisible(True)
        if self.beside is not None:
            self.beside.setVisible(False)
        self._rates.clear()
        self._last_count = (time.monotonic(), 0, 0)
        self._timer.start()
        self.serving_changed.emit(True)

    @property
    def url(self) -> str:
        return "" if self.endpoint is None else f"http://127.0.0.1:{self.endpoint.port}/v1"

    def stop(self) -> None:
        """Stop serving (in-flight requests may finish for the grace time), unload, close the store."""
        endpoint, self.endpoint = self.endpoint, None
        self._timer.stop()
        self.copy_key.setEnabled(False)
        self.url_edit.clear()
        self.status.setText("Not serving")
        self.toggle.setText("Serve")
        self.details.setVisible(False)
        if self.beside is not None:
            self.beside.setVisible(True)
        if endpoint is not None:
            endpoint.stop()
            if self._store is not None:
                self._store.close()
                self._store = None
            self.serving_changed.emit(False)
        if self.toggle.isChecked():
            self.toggle.blockSignals(True)
            self.toggle.setChecked(False)
            self.toggle.blockSignals(False)

    def _on_copy_key_clicked(self) -> None:
        QGuiApplication.clipboard().setText(self.key)

    # ------------------------------------------------------------------ the live view
    def refresh(self) -> None:
        """Redraw the rows and the rates from the served requests (GUI thread, on a timer)."""
        if self.endpoint is None:
            return
        requests = list(self.endpoint.served.recent)[-200:]
        self.table.setRowCount(len(requests))
        for i, r in enumerate(reversed(requests)):  # the newest first
            for j, text in enumerate(request_row(r)):
                item = self.table.item(i, j)
                if item is None:
                    self.table.setItem(i, j, QTableWidgetItem(text))
                elif item.text() != text:
                    item.setText(text)
        now = time.monotonic()
        count, tokens = self.endpoint.served.admitted, self.endpoint.served.tokens_out
        t0, count0, tokens0 = self._last_count
        if now - t0 > 2 * self._timer.interval() / 1e3 and self._rates:  # the GUI thread was busy: the
            self._rates.append((t0 + 1e-3, 0.0, 0.0))                  # rate spreads over the gap, not a ramp
        if now - t0 > 0:
            self._rates.append((now, max(0, count - count0) / (now - t0), max(0, tokens - tokens0) / (now - t0)))
        self._last_count = (now, count, tokens)
        while self._rates and now - self._rates[0][0] > PLOT_SECONDS:
            self._rates.popleft()
        xs = [t - now for t, _, _ in self._rates]
        self.requests_curve.setData(xs, [r for _, r, _ in self._rates])
        self.tokens_curve.setData(xs, [k for _, _, k in self._rates])
