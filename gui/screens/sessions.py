"""The Sessions screen: the workspace's sessions and runs; replay one; export it.

A replay feeds the same ``RunMonitorView`` the Run screen uses, with the recorded items
in their live arrival order (``core.sessions.replay.Replay``), so timeline, figures and text
replay exactly as they were seen live. Reading the workspace and exporting happen on
worker threads; the replay itself is paced by a 30 Hz timer on the GUI thread that asks
the replay which items fell due (``Replay.due()``), never by sleeping.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from PySide6.QtCore import QSize, Qt, QTimer, Signal
from PySide6.QtGui import QBrush, QColor, QKeySequence, QShortcut
from PySide6.QtWidgets import (QApplication, QComboBox, QFileDialog, QHBoxLayout, QLabel, QMenu, QPushButton,
                               QSlider, QSplitter, QStackedWidget, QStyle, QStyleOptionButton, QToolButton,
                               QTreeWidget, QTreeWidgetItem, QVBoxLayout, QWidget)

from core.reporting import Reporter
from core.sessions.replay import Replay
from core.sessions.store import RecordedItem, RunInfo, SessionInfo, SessionStore
from gui.screens.image_figures import recorded_class_labels
from gui.screens.run_comparison import RunComparisonView, load_comparison
from gui.screens.run_monitor import RunMonitorView
from gui.screens.run_export import export_run
from gui.screens.replay_clock import RunClock
from gui.screens.run_names import (human_time, run_count, run_name, run_plan, run_style, run_title,
                                   with_expert_buffer)
from gui.widgets import InlineMessage, panel_header, say_why_disabled
from gui.workers import TaskRunner, shutdown_together

SPEEDS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0)
SCRUB_STEPS = 1000


@dataclass(frozen=True)
class LoadedRun:
    info: RunInfo
    items: list[RecordedItem]
    lanes: list[str]
    prompts: tuple[str, ...]
    source_device: str | None
    predicted: tuple = ()
    """The simulator's timeline for the run's plan and settings (empty when it has none)."""
    prediction_note: str = ""
    lane_notes: dict = field(default_factory=dict)
    """Device -> its role in the run, as recorded (``settings["lane_notes"]``)."""
    class_labels: tuple[str, ...] | None = ()
    """An image run's class names (its recorded origin's model's); None: a predicted run (no classes)."""


class SteadyWidthButton(QPushButton):
    """A button as wide as its widest text (Play / Pause), so the controls beside it keep their place."""

    def __init__(self, text: str, widest: str) -> None:
        super().__init__(text)
        self._texts = (text, widest)

    def _hint_for(self, text: str) -> QSize:
        """QPushButton's own size hint, as if it showed ``text``."""
        opt = QStyleOptionButton()
        self.initStyleOption(opt)
        opt.text = text
        size = self.fontMetrics().size(Qt.TextFlag.TextShowMnemonic, text)
        return self.style().sizeFromContents(QStyle.ContentsType.CT_PushButton, opt,
                                             QSize(size.width(), max(size.height(), 14)), self)

    def sizeHint(self) -> QSize:  # noqa: N802 (Qt)
        hints = [self._hint_for(t) for t in self._texts]
        return QSize(max(h.width() for h in hints), max(h.height() for h in hints))

    def minimumSizeHint(self) -> QSize:  # noqa: N802 (Qt)
        return self.sizeHint()


RUN_STATUS_MARKS = {"completed": ("", None), "running": ("● ", "#2e7d32"), "stopped": ("■ ", "#8d6e00"),
                    "failed": ("✖ ", "#c62828"), "interrupted": ("⚠ ", "#c62828")}


def shown_status(status: str, run_id: int, live_run_ids: set[int]) -> str:
    """What the list says about a run: a "running" row that no live run owns was cut off
    (the studio or the machine went down mid-run), so it is "interrupted", not normal."""
    if status == "running" and run_id not in live_run_ids:
        return "interrupted"
    return status


def list_sessions(reporter: Reporter, workspace: str) -> list[tuple[SessionInfo, list[RunInfo]]]:
    """Worker job: every session of the workspace with its runs."""
    with SessionStore(workspace) as store:
        return [(s, [with_expert_buffer(store, r) for r in store.runs(s.id)]) for s in store.sessions()]


def load_run(reporter: Reporter, workspace: str, run_id: int) -> LoadedRun:
    """Worker job: a run's recorded items and what is needed to lay them out."""
    from core.techniques.run_origin import replay_prediction, stored_origin  # simulators: not at start

    reporter.status(f"Loading run {run_id}…")
    with SessionStore(workspace) as store:
        info = with_expert_buffer(store, store.run(run_id))
        items = store.timeline(run_id)
        problem = store.problem_of(run_id)
        plan = store.plan(info.plan_id) if info.plan_id is not None else None
        origin, unreadable = stored_origin(store, run_id)
    lanes = list(info.settings.get("lanes") or (plan.devices() if plan is not None else ()))
    for item in items:  # devices the plan did not name still get a lane, in order of appearance
        if item.event is not None and item.event.device not in lanes:
            lanes.append(item.event.device)
    prompts = tuple(info.settings.get("prompts") or ())
    predicted, note = ((), unreadable) if unreadable else replay_prediction(info, problem, plan, origin)
    return LoadedRun(info=info, items=items, lanes=lanes, prompts=prompts,
                     source_device=problem.source if problem is not None else None,
                     predicted=predicted, prediction_note=note,
                     lane_notes=dict(info.settings.get("lane_notes") or {}),
                     class_labels=recorded_class_labels(info.kind, origin))


REPLAY_LEAD_S = 0.05
"""How much of the quiet before a run's first event a replay still shows."""


def replay_start_s(items) -> float:
    """Where a replay starts: just before the first thing the run showed, so the seconds its
    agents spent loading (0.58 s of a 0.72 s demo run) are not replayed as an empty screen."""
    first = min((i.recv_s for i in items), default=0.0)
    return max(0.0, first - REPLAY_LEAD_S)


def run_span_s(items) -> float:
    """The run's own duration, first event to last (a 0.38 s run after 15 s of loading read "over 15.15 s")."""
    return RunClock(items).span_s


class SessionsPanel(QWidget):
    """Sessions/runs tree on the left; replay controls and the run monitor on the right."""

    COMPARE_NEEDS_TWO = "Select exactly two runs (Ctrl+click) to compare them side by side"

    sessions_listed = Signal(int)
    """Number of sessions now shown."""
    run_opened = Signal(int)
    runs_compared = Signal(int, int)
    replay_finished = Signal()
    exported = Signal(str, str)
    """(what, path)."""

    def __init__(self, state=None, parent: QWidget | None = None):
        super().__init__(parent)
        self.state = state
        self.workspace = ""
        self.loaded: LoadedRun | None = None
        self.replay: Replay | None = None
        self.setAccessibleName("Sessions screen")

        self.list_runner = TaskRunner(self, name="sessions-list")
        self.load_runner = TaskRunner(self, name="sessions-load")
        self.export_runner = TaskRunner(self, name="sessions-export")
        self.list_runner.task_finished.connect(self._on_list_runner_task_finished)
        self.list_runner.task_failed.connect(self._on_any_runner_task_failed)
        self.load_runner.task_finished.connect(self._on_load_runner_task_finished)
        self.load_runner.task_failed.connect(self._on_any_runner_task_failed)
        self.export_runner.task_finished.connect(self._on_export_runner_task_finished)
        self.export_runner.task_failed.connect(self._on_any_runner_task_failed)

        self.tree = QTreeWidget()
        self.tree.setAccessibleName("Sessions and runs")
        self.tree.setToolTip("Sessions of the workspace and their runs; double-click a run to open it")
        self.tree.setHeaderLabels(["Session / run", "Style", "Kind", "Status", "Tokens", "Started"])
        self.tree.setAlternatingRowColors(True)
        self.tree.setRootIsDecorated(True)
        self.tree.setSelectionMode(QTreeWidget.SelectionMode.ExtendedSelection)
        self.tree.itemDoubleClicked.connect(self._on_tree_item_double_clicked)
        self.tree.itemSelectionChanged.connect(self._on_tree_selection_changed)
        self.refresh_button = QPushButton("Refresh")
        self.refresh_button.setAccessibleName("Refresh sessions")
        self.refresh_button.setToolTip("Read the workspace's sessions and runs again (F5)")
        self.refresh_button.clicked.connect(self.refresh)
        QShortcut(QKeySequence("F5"), self, activated=self.refresh)
        self.open_button = QPushButton("Open")
        self.open_button.setAccessibleName("Open run")
        self.open_button.setToolTip("Open the selected run for replay (Enter)")
        self.open_button.setEnabled(False)
        self.open_button.clicked.connect(self._on_open_button_clicked)

        self.compare_button = QPushButton("Compare")
        self.compare_button.setAccessibleName("Compare two runs")
        self.compare_button.setEnabled(False)
        self.compare_button.setToolTip(self.COMPARE_NEEDS_TWO)
        self.compare_button.clicked.connect(self._on_compare_button_clicked)
        self.compare_runner = TaskRunner(self, name="sessions-compare")
        self.compare_runner.task_finished.connect(self._on_compare_runner_task_finished)
        self.compare_runner.task_failed.connect(self._on_any_runner_task_failed)
        self.start_s = 0.0
        self.clock = RunClock(())
        """Where the open run's replay starts (``replay_start_s``)."""
        self.live_run_ids: set[int] = state.live_run_ids if state is not None else set()
        """Runs being recorded right now (the Run screen's): only these are "running"."""

        self.play_button = SteadyWidthButton("Play", widest="Pause")
        self.play_button.setAccessibleName("Play or pause replay")
        self.play_button.setToolTip("Play or pause the replay (Space)")
        self.play_button.setCheckable(True)
        self.play_button.toggled.connect(self._on_play_button_toggled)
        QShortcut(QKeySequence("Space"), self, activated=self.play_button.toggle)
        self.speed_combo = QComboBox()
        self.speed_combo.setAccessibleName("Replay speed")
        self.speed_combo.setToolTip("How much faster than live the replay runs")
        for speed in SPEEDS:
            self.speed_combo.addItem(f"{speed:g}×", speed)
        self.speed_combo.setCurrentIndex(SPEEDS.index(1.0))
        self.speed_combo.currentIndexChanged.connect(self._on_speed_combo_changed)
        self.scrubber = QSlider(Qt.Orientation.Horizontal)
        self.scrubber.setAccessibleName("Replay position")
        self.scrubber.setToolTip("Drag to jump to any moment of the run")
        self.scrubber.setRange(0, SCRUB_STEPS)
        # seek on release, not on every pixel of a drag: a seek rebuilds the view from the
        # delivered prefix, which for a long run is a noticeable amount of work
        self.scrubber.setTracking(False)
        self.scrubber.valueChanged.connect(self._on_scrubber_value_changed)
        self.scrubber.sliderMoved.connect(self._on_scrubber_slider_moved)
        self.time_label = QLabel("0.00 / 0.00 s")
        self.time_label.setAccessibleName("Replay time")
        self.time_label.setMinimumWidth(110)
        self.export_button = QToolButton()
        self.export_button.setText("Export")
        self.export_button.setAccessibleName("Export run")
        self.export_button.setToolTip("Export the run's trace (Perfetto JSON or CSV), plan or profile")
        self.export_button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        say_why_disabled({self.open_button: "select one run in the list first",
                          self.play_button: "open a run first (select it, then Open or Enter)",
                          self.export_button: "open a run first (select it, then Open or Enter)"})
        menu = QMenu(self.export_button)
        menu.addAction("Trace (Perfetto / chrome://tracing JSON, or CSV)…", lambda: self.export_dialog("trace"))
        menu.addAction("Plan…", lambda: self.export_dialog("plan"))
        menu.addAction("Profile…", lambda: self.export_dialog("profile"))
        self.export_button.setMenu(menu)
        self.run_label = QLabel("No run open.")
        self.run_label.setAccessibleName("Open run")
        self.run_label.setWordWrap(True)  # a long title (technique, style, plan and re-plan) wraps at 1024 px
        self.message = InlineMessage()

        controls = QHBoxLayout()
        controls.addWidget(self.play_button)
        controls.addWidget(self.speed_combo)
        controls.addWidget(self.scrubber, 1)
        controls.addWidget(self.time_label)
        controls.addWidget(self.export_button)
        self._replay_controls = (self.play_button, self.speed_combo, self.scrubber, self.export_button)
        for w in self._replay_controls:
            w.setEnabled(False)

        self.monitor = RunMonitorView()

        left = self.list_pane = QWidget()
        left_layout = QHBoxLayout(left)  # the buttons beside the list: its rows get the height
        left_layout.setContentsMargins(0, 0, 0, 4)
        left_layout.addWidget(self.tree, 1)
        buttons = QVBoxLayout()
        buttons.addWidget(self.open_button)
        buttons.addWidget(self.compare_button)
        buttons.addStretch(1)
        buttons.addWidget(self.refresh_button)
        left_layout.addLayout(buttons)
        right = QWidget()
        right_layout = QVBoxLayout(right)
        right_layout.setContentsMargins(0, 4, 0, 0)
        replay_page = QWidget()
        replay_layout = QVBoxLayout(replay_page)
        replay_layout.setContentsMargins(0, 0, 0, 0)
        replay_layout.addWidget(self.run_label)
        replay_layout.addLayout(controls)
        replay_layout.addWidget(self.monitor, 1)
        self.comparison = RunComparisonView()
        self.comparison.closed.connect(lambda: self._show_comparison(False))
        self.right_stack = QStackedWidget()
        self.right_stack.addWidget(replay_page)
        self.right_stack.addWidget(self.comparison)
        right_layout.addWidget(self.right_stack, 1)
        # the list above the replay, across the page's width: every column (kind, status, tokens,
        # started) reads at 1024 px, and the replay keeps the width its lanes and figures need
        splitter = QSplitter(Qt.Orientation.Vertical)
        splitter.setChildrenCollapsible(False)
        splitter.addWidget(left)
        splitter.addWidget(right)
        splitter.setStretchFactor(0, 0)
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([170, 830])
        layout = QVBoxLayout(self)
        layout.setContentsMargins(16, 12, 16, 12)
        layout.addWidget(panel_header(
            "Sessions", "Recorded sessions and runs of the workspace: replay a run as it was seen live, "
                        "or export it."))
        layout.addWidget(self.message)
        layout.addWidget(splitter, 1)

        self._tick = QTimer(self)
        self._tick.setInterval(33)
        self._tick.timeout.connect(self._on_tick_timeout)
        self._scrubbing = False

        if state is not None:
            state.workspace_changed.connect(self.set_workspace)
            if state.workspace:
                self.set_workspace(state.workspace)
        app = QApplication.instance()
        if app is not None:
            app.aboutToQuit.connect(self.shutdown)

    def showEvent(self, event) -> None:
        """Coming back to this screen shows runs recorded meanwhile (e.g. on the Run screen)."""
        super().showEvent(event)
        if self.workspace and not self._replay_active():
            self.refresh()

    def _replay_active(self) -> bool:
        return self._tick.isActive()

    # -- workspace and list --------------------------------------------------------------
    def set_workspace(self, path: str) -> None:
        self.workspace = path
        self.refresh()

    def refresh(self) -> None:
        if not self.workspace:
            self.tree.clear()
            self.message.show_lines(["No workspace is open: use File › Open workspace…"])
            return
        self.list_runner.start(list_sessions, self.workspace)

    def _on_list_runner_task_finished(self, task_id: int, sessions: object) -> None:
        self.message.show_lines([])
        self.tree.clear()
        for session, runs in sessions:
            top = QTreeWidgetItem([session.name, "", "", "", f"{len(runs)} run(s)", human_time(session.created_at)])
            top.setToolTip(5, session.created_at)
            top.setData(0, Qt.ItemDataRole.UserRole, None)
            for run in runs:
                status = shown_status(run.status, run.id, self.live_run_ids)
                mark, colour = RUN_STATUS_MARKS.get(status, ("", None))
                # the mark leads the first column too: the Status column is off screen in a narrow list
                child = QTreeWidgetItem([f"{mark}{run_name(run)}", run_style(run), run.kind, mark + status,
                                         run_count(run), human_time(run.started_at)])
                child.setData(0, Qt.ItemDataRole.UserRole, run.id)
                child.setToolTip(0, f"{run_title(run)}. Double-click to open this run for replay")
                child.setToolTip(5, run.started_at)
                if colour is not None:
                    why = {"failed": "The run failed: its events up to the failure are kept",
                           "stopped": "Stopped by the operator: what arrived is kept",
                           "interrupted": "The run never finished (the studio or the "
                                          "machine stopped mid-run): it is incomplete",
                           "running": "Being recorded now"}[status]
                    for col in (0, 3):
                        child.setForeground(col, QBrush(QColor(colour)))
                    child.setToolTip(3, why)
                    child.setToolTip(0, f"{run_title(run)}: {why}. Double-click to open this run for replay")
                top.addChild(child)
            self.tree.addTopLevelItem(top)
            top.setFirstColumnSpanned(True)  # its long name never widens the runs' first column
            top.setText(0, f"{session.name} · {len(runs)} run(s) · {human_time(session.created_at)}")
            top.setExpanded(True)
        for col in range(self.tree.columnCount()):
            self.tree.resizeColumnToContents(col)
        runs = [item for item in self.run_items().values()]
        if runs:  # the first column as wide as the runs' names (the sessions' rows span every column)
            fm = self.tree.fontMetrics()
            self.tree.setColumnWidth(0, max(fm.horizontalAdvance(i.text(0)) for i in runs)
                                     + 2 * self.tree.indentation() + 12)
        self.sessions_listed.emit(len(sessions))

    def run_items(self) -> dict[int, QTreeWidgetItem]:
        out = {}
        for i in range(self.tree.topLevelItemCount()):
            top = self.tree.topLevelItem(i)
            for j in range(top.childCount()):
                child = top.child(j)
                out[child.data(0, Qt.ItemDataRole.UserRole)] = child
        return out

    # -- opening a run -------------------------------------------------------------------
    def open_run(self, run_id: int) -> None:
        """Load ``run_id`` (on a worker) and show it at its start, paused."""
        self._pause()
        self.load_runner.start(load_run, self.workspace, run_id)

    def _on_tree_item_double_clicked(self, item: QTreeWidgetItem, column: int) -> None:
        run_id = item.data(0, Qt.ItemDataRole.UserRole)
        if run_id is not None:
            self.open_run(run_id)

    def selected_run_ids(self) -> list[int]:
        return [i.data(0, Qt.ItemDataRole.UserRole) for i in self.tree.selectedItems()
                if i.data(0, Qt.ItemDataRole.UserRole) is not None]

    def _on_tree_selection_changed(self) -> None:
        items = self.tree.selectedItems()
        self.open_button.setEnabled(bool(items) and items[0].data(0, Qt.ItemDataRole.UserRole) is not None)
        two = len(self.selected_run_ids()) == 2
        self.compare_button.setEnabled(two)
        self.compare_button.setToolTip("Show the two selected runs side by side, aligned at t = 0" if two
                                       else self.COMPARE_NEEDS_TWO)

    def compare_runs(self, run_a: int, run_b: int) -> None:
        """Read both runs (on a worker) and show them side by side."""
        self._pause()
        self.compare_runner.start(load_comparison, self.workspace, run_a, run_b)

    def _on_compare_button_clicked(self) -> None:
        ids = self.selected_run_ids()
        if len(ids) == 2:
            self.compare_runs(*sorted(ids))

    def _on_compare_runner_task_finished(self, task_id: int, runs: object) -> None:
        a, b = runs
        self.message.show_lines([])
        self.comparison.show_runs(a, b)
        self._show_comparison(True)
        self.runs_compared.emit(a.info.id, b.info.id)

    def _show_comparison(self, shown: bool) -> None:
        """Two timelines need the page's height (at 1024x700 the list above leaves them too
        little): the list steps aside while comparing and comes back with "Back to replay"."""
        self.right_stack.setCurrentIndex(1 if shown else 0)
        self.list_pane.setVisible(not shown)

    def _on_open_button_clicked(self) -> None:
        items = self.tree.selectedItems()
        if items and items[0].data(0, Qt.ItemDataRole.UserRole) is not None:
            self.open_run(items[0].data(0, Qt.ItemDataRole.UserRole))

    def _on_load_runner_task_finished(self, task_id: int, loaded: object) -> None:
        assert isinstance(loaded, LoadedRun)
        self.message.show_lines([])
        self.loaded = loaded
        self.replay = Replay(loaded.items, speed=self.speed_combo.currentData(), paused=True)
        info = loaded.info
        self.run_label.setText(" · ".join(p for p in (run_title(info), info.kind, run_plan(info)) if p) + " · "
                               f"{len(loaded.items)} recorded items · a {run_span_s(loaded.items):.2f} s run")
        for w in self._replay_controls:
            w.setEnabled(True)
        self._show_comparison(False)
        self.start_s = replay_start_s(loaded.items)
        self.clock = RunClock(loaded.items)
        self._reset_monitor()
        self.seek(self.start_s)  # loading skipped: the replay starts just before the first event
        self.run_opened.emit(info.id)

    def _reset_monitor(self) -> None:
        """An empty monitor for the open run, with its prediction ready for "Show predicted"."""
        shown = self.monitor.timeline.predicted_check.isChecked()
        loaded = self.loaded
        self.monitor.reset(loaded.lanes, loaded.prompts, loaded.lane_notes, loaded.info.settings,
                           loaded.info.figures.get("wire"), loaded.class_labels)
        self.monitor.set_predicted(self.loaded.predicted)
        self.monitor.timeline.set_boxes_kind(self.loaded.info.kind)  # a predicted run is not "measured"
        self.monitor.timeline.predicted_check.setToolTip(
            self.loaded.prediction_note or self.monitor.timeline.predicted_check.toolTip())
        if shown and self.loaded.predicted:
            self.monitor.timeline.show_predicted(True)

    def _on_any_runner_task_failed(self, task_id: int, message: str) -> None:
        self.message.show_lines([message], "Could not read the workspace:")

    # -- replay --------------------------------------------------------------------------
    def play(self) -> None:
        self.play_button.setChecked(True)

    def pause(self) -> None:
        self.play_button.setChecked(False)

    def set_speed(self, speed: float) -> None:
        self.speed_combo.setCurrentIndex(SPEEDS.index(speed))

    def seek(self, t_s: float) -> None:
        """Show the run as it was at ``t_s`` (rebuilt from the delivered prefix)."""
        if self.replay is None or self.loaded is None:
            return
        self.replay.seek(t_s)
        self._reset_monitor()
        self._deliver(self.replay.delivered())
        self.monitor.flush()
        if self.replay.finished:
            self.monitor.timeline.show_whole_run()
        self._set_scrubber(self.replay.position_s)

    def _on_play_button_toggled(self, on: bool) -> None:
        self.play_button.setText("Pause" if on else "Play")
        if self.replay is None:
            return
        if on:
            if self.replay.finished:
                self.seek(self.start_s)
            self.replay.resume()
            self._tick.start()
        else:
            self._pause()

    def _pause(self) -> None:
        self._tick.stop()
        if self.replay is not None:
            self.replay.pause()
        if self.play_button.isChecked():
            self.play_button.blockSignals(True)
            self.play_button.setChecked(False)
            self.play_button.setText("Play")
            self.play_button.blockSignals(False)

    def _on_speed_combo_changed(self, index: int) -> None:
        if self.replay is not None:
            self.replay.set_speed(SPEEDS[index])

    def _on_tick_timeout(self) -> None:
        if self.replay is None:
            return
        self._deliver(self.replay.due())
        self._set_scrubber(self.replay.position_s)
        if self.replay.finished:
            self._pause()
            self.monitor.flush()
            self.monitor.timeline.clip_predicted_to_run()
            self.monitor.timeline.show_whole_run()
            self._set_scrubber(self.replay.duration_s)
            self.replay_finished.emit()

    def _deliver(self, items: list[RecordedItem]) -> None:
        events = [i.event for i in items if i.event is not None]
        tokens = [i.tokens for i in items if i.tokens is not None]
        self.monitor.add_timeline_events(events)
        self.monitor.add_token_events(tokens)

    def _replayed_s(self) -> float:
        """How long the replayed part lasts: from where it starts (loading skipped) to its end."""
        return max(0.0, self.replay.duration_s - self.start_s) if self.replay is not None else 0.0

    def _set_scrubber(self, pos_s: float) -> None:
        """The scrubber and the time label cover what is replayed (``start_s`` on), not the load before."""
        span = self._replayed_s()
        if self.scrubber.isSliderDown():
            return  # the operator is dragging it: the release seeks
        into = min(max(0.0, pos_s - self.start_s), span)
        self._scrubbing = True
        self.scrubber.setValue(int(round(SCRUB_STEPS * into / span)) if span > 0 else 0)
        self._scrubbing = False
        self._show_run_time(pos_s)

    def _show_run_time(self, pos_s: float) -> None:
        """The label in the run's own time (the header's span at the end), not the arrivals' with the lead-in."""
        self.time_label.setText(f"{self.clock.at(pos_s):.2f} / {self.clock.span_s:.2f} s")

    def _on_scrubber_slider_moved(self, value: int) -> None:
        self._show_run_time(self.start_s + self._replayed_s() * value / SCRUB_STEPS)

    def _on_scrubber_value_changed(self, value: int) -> None:
        if self._scrubbing or self.replay is None:
            return
        self.seek(self.start_s + self._replayed_s() * value / SCRUB_STEPS)

    # -- export --------------------------------------------------------------------------
    def export(self, what: str, path: str) -> None:
        """Write the open run's trace / plan / profile to ``path`` (on a worker)."""
        if self.loaded is None:
            return
        self.export_runner.start(export_run, self.workspace, self.loaded.info.id, what, path)

    def export_dialog(self, what: str) -> None:
        if self.loaded is None:
            return
        run_id = self.loaded.info.id
        suggestions = {"trace": (f"run-{run_id}.trace.json", "Chrome trace (*.json);;CSV (*.csv)"),
                       "plan": (f"run-{run_id}.plan.json", "Plan (*.json)"),
                       "profile": (f"run-{run_id}.profile.json", "Profile (*.json)")}
        name, filters = suggestions[what]
        start = str(Path(self.workspace).parent / name) if self.workspace else name
        path, _ = QFileDialog.getSaveFileName(self, f"Export {what}", start, filters)
        if path:
            self.export(what, path)

    def _on_export_runner_task_finished(self, task_id: int, result: object) -> None:
        what, path = result
        self.message.show_lines([])
        if self.state is not None:
            self.state.log(f"exported {path}")
        self.run_label.setText(f"{self.run_label.text().split('  ✓')[0]}  ✓ wrote {Path(str(path)).name}")
        self.exported.emit(what, str(path))

    def shutdown(self, timeout_s: float = 5.0) -> bool:
        self._tick.stop()
        runners = (self.list_runner, self.load_runner, self.export_runner, self.compare_runner)
        ok = shutdown_together(runners, timeout_s)
        return self.monitor.shutdown(timeout_s) and ok  # stopped even when a loader outlived the timeout
