"""The studio's one main window: a sidebar of screens, menus, shortcuts, status bar, log dock.

Screens share a ``StudioState``; the window only arranges them, routes menu actions
and remembers its geometry, dock layout, last screen and recent workspaces (QSettings).
"""

from __future__ import annotations

import time
from pathlib import Path

from PySide6.QtCore import QByteArray, QEvent, QRect, QSize, Qt, QTimer
from PySide6.QtGui import QAction, QGuiApplication, QKeySequence
from PySide6.QtWidgets import (
    QApplication,
    QDockWidget,
    QFileDialog,
    QFrame,
    QHBoxLayout,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QMainWindow,
    QMessageBox,
    QScrollArea,
    QStackedWidget,
    QWidget,
)

from core import formats
from core.errors import EdgeShardError
from core.planning.problem import PlanningProblem
from core.devices.profile import Profile
from gui import app as studio_app
from gui.screens import SCREEN_NAMES, SCREEN_TITLES, Screens
from gui.studio_state import StudioState
from gui.widgets import show_error
from gui.widgets.log_view import LogView

SCREENS = SCREEN_TITLES
SIDEBAR_WIDTH = 150
"""Below 1200 px the sidebar is only as wide as its longest title needs."""


class ScreenScrollArea(QScrollArea):
    """A screen scrolls only when the window is smaller than the screen's *minimum* size, so
    the window's minimum size stays small (a laptop screen) and a restored size is kept, not
    enlarged to the largest screen's minimum when the layout first activates.

    A resizable QScrollArea sizes a screen with word-wrapped labels to its preferred height
    for the width (height-for-width), which scrolls the Run page at 1440x900 although it fits;
    here the screen gets the viewport, grown only to its minimum size hint.
    """

    def __init__(self, screen: QWidget | None = None) -> None:
        super().__init__()
        self.setFrameShape(QFrame.NoFrame)
        self.setWidgetResizable(False)
        self._fit_timer = QTimer(self)
        self._fit_timer.setSingleShot(True)
        self._fit_timer.setInterval(0)
        self._fit_timer.timeout.connect(self.fit_screen)
        if screen is not None:
            self.set_screen(screen)

    def set_screen(self, screen: QWidget) -> None:
        """Show ``screen`` here (a screen is built when first reached: ``gui.screens.Screens``)."""
        self.setWidget(screen)
        screen.installEventFilter(self)
        self.fit_screen()

    def eventFilter(self, watched, event) -> bool:
        if watched is self.widget() and event.type() == QEvent.Type.LayoutRequest:
            self._fit_timer.start()  # the minimum may have changed (coalesced: one fit per pass)
        # QScrollArea's own filter re-ranges the scroll bars when the screen is resized: without it a
        # screen grown by fit_screen (the spatial page's lanes) could not be scrolled to its bottom
        return super().eventFilter(watched, event)

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self.fit_screen()

    def fit_screen(self) -> None:
        screen = self.widget()
        if screen is None:
            return
        need = screen.minimumSizeHint().expandedTo(screen.minimumSize())
        room = self.maximumViewportSize()  # the viewport without scroll bars
        width, height = room.width(), room.height()
        if need.width() > width:  # a horizontal bar takes height
            height -= self.horizontalScrollBar().sizeHint().height()
        if need.height() > height:  # a vertical bar takes width
            width -= self.verticalScrollBar().sizeHint().width()
            if need.width() > width and need.width() <= room.width():
                height -= self.horizontalScrollBar().sizeHint().height()
        screen.resize(max(width, need.width()), max(height, need.height()))


def fitted_geometry(window: QRect, frame: QSize, room: QRect) -> QRect:
    """``window`` (its frame's top-left and client size; ``frame``: what the decorations add) made to fit ``room``
    (the screen's available geometry): shrunk to it, then moved inside it."""
    width = min(window.width(), room.width() - frame.width())
    height = min(window.height(), room.height() - frame.height())
    x = min(max(window.x(), room.left()), room.left() + room.width() - width - frame.width())
    y = min(max(window.y(), room.top()), room.top() + room.height() - height - frame.height())
    return QRect(x, y, width, height)


class MainWindow(QMainWindow):
    def __init__(self, state: StudioState | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state or StudioState(self)
        self.setWindowTitle("")  # Qt appends the application display name itself
        self.setObjectName("mainWindow")
        self.screens = Screens(self.state)
        self.coordinator = None
        """The connection to agents opened from an agents.json (closed with the window)."""
        self.keeps_workspace = False
        """Whether closing keeps the workspace for the next launch (once it was restored: not the demo's)."""
        self._agents_runner = None
        self._shown_once = False
        self._connection_before = "not connected"
        """What the status bar said before a Connect, restored if it fails."""
        self._build_screens()
        self._build_log_dock()
        self._build_status_bar()
        self._build_menus()
        self.screens.on_built = self._on_screen_built
        self.state.workspace_changed.connect(self._on_state_workspace_changed)
        self.state.model_changed.connect(self._on_state_model_changed)
        # the MoE (Llava, CNN) of the technique shown or run, not always the studio's Llama
        self.state.technique_changed.connect(lambda _t: self._on_state_model_changed(self.state.model_name))
        self.state.technique_models_changed.connect(lambda _m: self._on_state_model_changed(self.state.model_name))
        # a state set before the window was built (the demo opens its workspace while the agents start)
        self._on_state_workspace_changed(self.state.workspace)
        self._on_state_model_changed(self.state.model_name)
        self.state.connection_changed.connect(lambda c: self.connection_label.setText(f"● {c}"))
        self.state.log_added.connect(self._on_state_log_added)
        # a profile gets its plan at once (the Plan screen's editor makes or solves it), shown or not
        self.state.problem_changed.connect(lambda problem: problem is not None and self.screens.get("plan"))
        self.resize(1440, 900)
        self._restore_layout()  # builds the screen shown
        self.fit_to_screen()
        self._fit_log_dock()
        self.screens.get("devices")  # built now: agents deployed in earlier sessions stay controllable

    # construction ---------------------------------------------------------------
    def _build_screens(self) -> None:
        central = QWidget()
        lay = QHBoxLayout(central)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(0)
        self.sidebar = QListWidget()
        self.sidebar.setObjectName("sidebar")
        self.sidebar.setAccessibleName("Screens")
        self.sidebar.setFixedWidth(SIDEBAR_WIDTH)
        self.sidebar.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.stack = QStackedWidget()
        self._areas: dict[str, ScreenScrollArea] = {}
        for i, name in enumerate(SCREEN_TITLES):
            self._areas[SCREEN_NAMES[i]] = area = ScreenScrollArea()
            self.stack.addWidget(area)
            item = QListWidgetItem(name)
            item.setToolTip(f"{name} screen (Ctrl+{i + 1})")
            self.sidebar.addItem(item)
        self.sidebar.currentRowChanged.connect(self._on_sidebar_row_changed)
        lay.addWidget(self.sidebar)
        lay.addWidget(self.stack, 1)
        self.setCentralWidget(central)

    def _on_sidebar_row_changed(self, row: int) -> None:
        if row >= 0:
            self.screens.get(SCREEN_NAMES[row])  # built when first shown
            self.stack.setCurrentIndex(row)
            self._on_state_model_changed(self.state.model_name)  # the Run screen names its plan's model

    def _on_screen_built(self, name: str, screen: QWidget) -> None:
        """A screen was built (shown, or reached by a menu, the demo or a test): put it in its
        place and wire what the window routes for it."""
        self._areas[name].set_screen(screen)
        if name == "run":
            screen.model_edit.editingFinished.connect(self._on_run_model_edited)
        elif name == "profile":
            screen.load_requested.connect(self._on_load_profile)
        elif name == "plan":
            screen.run_requested.connect(lambda: (self.show_screen(self.screens.run), self.screens.run.start_run()))
            editor = self.screens.plan_editor
            self.edit_menu.clear()  # the editor's own undo and redo (their shortcuts are its)
            self.edit_menu.addAction(editor.undo_action)
            self.edit_menu.addAction(editor.redo_action)
        elif name == "devices":
            screen.restore_deployments()  # agents deployed in earlier sessions stay controllable

    def _build_log_dock(self) -> None:
        self.log_view = LogView()
        self.log_view.setMaximumBlockCount(5000)
        self.log_view.setAccessibleName("Log")
        self.log_dock = QDockWidget("Log", self)
        self.log_dock.setObjectName("logDock")
        self.log_dock.setWidget(self.log_view)
        self.addDockWidget(Qt.BottomDockWidgetArea, self.log_dock)
        self.log_dock.setMinimumHeight(80)

    def _fit_log_dock(self) -> None:
        """The log takes less height on a short window (a 1024x700 laptop), so the screens fit."""
        self.resizeDocks([self.log_dock], [120 if self.height() >= 800 else 80], Qt.Vertical)

    def fit_to_screen(self) -> None:
        """Keep the window within its screen's available geometry (a 1024x700 laptop: the
        1440x900 default, or a size restored from a larger screen, put the status bar and the
        log off screen); the window frame, once known, is left room too. Not on the offscreen
        platform: its fixed 800x800 "screen" is no display, and tests size their windows."""
        screen = self.screen() or QGuiApplication.primaryScreen()
        if screen is None or QGuiApplication.platformName() == "offscreen":
            return
        frame = QSize(max(0, self.frameGeometry().width() - self.width()),
                      max(0, self.frameGeometry().height() - self.height()))
        fitted = fitted_geometry(QRect(self.pos(), self.size()), frame, screen.availableGeometry())
        if fitted.size() != self.size():
            self.resize(fitted.size())
        if fitted.topLeft() != self.pos():
            self.move(fitted.topLeft())

    def showEvent(self, event) -> None:
        super().showEvent(event)
        if not self._shown_once:  # the frame's size is known now
            self._shown_once = True
            self.fit_to_screen()

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        # a narrower sidebar on a narrow window (1024 px): the screens get the width
        narrow = min(SIDEBAR_WIDTH, self.sidebar.sizeHintForColumn(0) + 4)  # the longest title still whole
        self.sidebar.setFixedWidth(SIDEBAR_WIDTH if event.size().width() >= 1200 else narrow)
        before = event.oldSize().height()  # -1 when first shown
        if event.size().height() < 800 <= before or (before < 0 and not self._layout_restored):
            self._fit_log_dock()

    def _build_status_bar(self) -> None:
        sb = self.statusBar()
        self.workspace_label = QLabel("Workspace: (none)")
        self.workspace_label.setToolTip("The SQLite workspace where sessions and runs are recorded")
        self.model_label = QLabel("Model: —")
        self.model_label.setToolTip("The model of the technique being planned and run")
        self.connection_label = QLabel(f"● {self.state.connection}")
        self.connection_label.setToolTip("Connection to the device agents")
        self.offline_label = QLabel()
        self.offline_label.setObjectName("offlineDevices")
        self.offline_label.setStyleSheet("color: #c62828; font-weight: bold")
        self.offline_label.setVisible(False)
        for w in (self.offline_label, self.workspace_label, self.model_label, self.connection_label):
            w.setContentsMargins(8, 0, 8, 0)
            sb.addPermanentWidget(w)
        self.state.offline_changed.connect(self._show_offline)

    def _show_offline(self, devices: tuple[str, ...]) -> None:
        """Offline agents in the status bar, on every screen (the Devices screen says why)."""
        shown = ", ".join(devices[:4]) + (f" +{len(devices) - 4}" if len(devices) > 4 else "")
        self.offline_label.setText(f"⚠ Offline: {shown}" if devices else "")
        self.offline_label.setToolTip("Agents that stopped answering or vanished from the network: "
                                      + ", ".join(devices) + ". See the Devices screen.")
        self.offline_label.setVisible(bool(devices))

    def _action(self, menu, text: str, slot, shortcut=None, tip: str = "") -> QAction:
        a = QAction(text, self)
        if shortcut is not None:
            a.setShortcut(QKeySequence(shortcut))
        a.setToolTip(tip or text)
        a.setStatusTip(tip or text)
        a.triggered.connect(slot)
        menu.addAction(a)
        return a

    def _build_menus(self) -> None:
        mb = self.menuBar()
        f = mb.addMenu("&File")
        self._action(f, "Open workspace…", self._on_open_workspace, QKeySequence.Open, "Open or create a workspace file")
        self.recent_menu = f.addMenu("Recent workspaces")
        self.recent_menu.aboutToShow.connect(self._fill_recent_menu)
        f.addSeparator()
        self._action(f, "Connect to agents…", self._on_connect_agents, "Ctrl+Shift+K",
                     "Connect to running agents from an agents.json (edgeshard cluster local, edgeshard deploy)")
        self._action(f, "Load profile…", self._on_load_profile, "Ctrl+Shift+P", "Load a profile or problem file")
        screens = self.screens  # each reached when its action is used (built then, if it was not)
        self._action(f, "Load plan…", lambda: (self.show_screen(screens.plan), screens.plan_editor._on_load_clicked()),
                     "Ctrl+Shift+O", "Load a plan file")
        self._action(f, "Save plan…", lambda: screens.plan_editor._on_save_clicked(), QKeySequence.Save,
                     "Save the current plan")
        f.addSeparator()
        self._action(f, "Quit", self.close, QKeySequence.Quit)

        self.edit_menu = e = mb.addMenu("&Edit")
        for text in ("Undo", "Redo"):  # the plan editor's own, once the Plan screen is built
            e.addAction(text).setEnabled(False)

        v = mb.addMenu("&View")
        for i, name in enumerate(SCREEN_TITLES):
            self._action(v, name, lambda _c=False, i=i: self.sidebar.setCurrentRow(i), f"Ctrl+{i + 1}",
                         f"Show the {name} screen")
        v.addSeparator()
        v.addAction(self.log_dock.toggleViewAction())
        self.dark_action = self._action(v, "Dark theme", self._on_dark_toggled, "Ctrl+Shift+D", "Switch between light and dark")
        self.dark_action.setCheckable(True)
        self.dark_action.setChecked(studio_app.theme_mode() == "dark")

        d = mb.addMenu("&Devices")
        self._action(d, "Discover devices", lambda: (self.show_screen(screens.devices), screens.devices.toggle_discovery()),
                     "Ctrl+Shift+F", "Start or stop browsing the network (mDNS)")
        self._action(d, "Add device…", lambda: (self.show_screen(screens.devices), screens.devices._on_add_clicked()),
                     "Ctrl+Shift+A", "Add a device by address")
        self._action(d, "Deploy…", lambda: (self.show_screen(screens.devices), screens.devices.open_deploy_dialog()),
                     "Ctrl+D", "Deploy the agent to the selected devices")
        self._action(d, "Profile cluster", lambda: (self.show_screen(screens.profile), screens.profile.start_profiling()),
                     "Ctrl+P", "Measure every unit on every device")

        p = mb.addMenu("&Plan")
        self._action(p, "Auto-solve", lambda: (self.show_screen(screens.plan), screens.plan.auto_solve()), "Ctrl+R",
                     "Solve for the selected objective")
        self._action(p, "Compare strategies", lambda: (self.show_screen(screens.plan), screens.plan.compare()),
                     "Ctrl+Shift+C", "Compare every strategy")
        r = mb.addMenu("&Run")
        self._action(r, "Start", lambda: (self.show_screen(screens.run), screens.run.start_run()), "Ctrl+Return",
                     "Run the model over the cluster with the current plan (from any screen: shows the Run screen)")
        self._action(r, "Stop", lambda: (self.show_screen(screens.run), screens.run.stop_run()), None,
                     "Stop the run in progress (Esc on the Run screen)")
        h = mb.addMenu("&Help")
        self._action(h, "Keyboard shortcuts", self._on_shortcuts, "F1")
        self._action(h, "About EdgeShard Studio", self._on_about)

    # behaviour ----------------------------------------------------------------------
    def _on_run_model_edited(self) -> None:
        path = self.screens.run.model_edit.text().strip()
        if path and Path(path).is_dir():
            self.state.set_model(Path(path).name, path=path)

    def show_screen(self, screen: QWidget) -> None:
        self.sidebar.setCurrentRow(SCREEN_NAMES.index(self.screens.name_of(screen)))

    def current_screen(self) -> QWidget:
        return self.screens.get(SCREEN_NAMES[self.stack.currentIndex()])

    def current_screen_title(self) -> str:
        return SCREENS[self.stack.currentIndex()]

    def open_workspace(self, path: str) -> None:
        self.state.set_workspace(str(Path(path).resolve()))
        studio_app.remember_workspace(path)

    def load_profile_file(self, path: str) -> bool:
        """Load a profile (or a whole problem); a wrong file is a dialog with what to do."""
        try:
            kind = formats.format_of(path)
            if kind == "edgeshard.problem":
                problem = formats.load(path, PlanningProblem)
                self.state.set_profile(problem.profile, source=problem.source, workload=problem.workload)
                self.state.set_problem(problem)
            elif kind == "edgeshard.spatial-problem":
                from core.techniques.spatial.problem import SpatialProblem
                from core.techniques.spatial.profiling import fits_of_problem

                self.state.set_spatial_fits(fits_of_problem(formats.load(path, SpatialProblem),
                                                            f"spatial problem {Path(path).name}"))
            else:
                self.state.set_profile(formats.load(path, Profile))
        except EdgeShardError as err:
            show_error(self, "Cannot load profile", err,
                       "Choose a file written by `edgeshard profile` or `edgeshard scenario` (format edgeshard.profile), "
                       "or a spatial problem (`edgeshard spatial profile --out`).")
            return False
        self.state.log(f"loaded {path}")
        return True

    def connect_agents(self, path: str) -> None:
        """Connect (in a worker) to the agents an agents.json lists, then wire the screens to them."""
        from gui.connection.attach import open_coordinator
        from gui.connection.lifecycle import close_connection
        from gui.workers import TaskRunner

        if self._agents_runner is None:
            self._agents_runner = TaskRunner(self, name="agents")
            self._agents_runner.task_finished.connect(self._on_agents_connected)
            self._agents_runner.task_failed.connect(self._on_agents_connect_failed)
        if self.state.connection != "connecting…":
            self._connection_before = self.state.connection
        self.state.set_connection("connecting…")
        self._agents_runner.start(open_coordinator, path, on_discarded=close_connection)

    def _on_agents_connect_failed(self, _task: int, message: str) -> None:
        """A failed Connect leaves the agents already attached (demo or an earlier file) in use, and says so."""
        before = self._connection_before
        self.state.set_connection(before)
        still = f" Still using the agents already attached ({before})." if before != "not connected" else ""
        self.state.log(message + still, "error")
        show_error(self, "Cannot connect to the agents", message,
                   "Check that the agents are running (edgeshard agents status) and that "
                   "this agents.json is the one they were started with." + still)

    def _on_agents_connected(self, _task: int, result) -> None:
        from gui.connection.attach import attach

        coordinator, statuses = result
        devices = self.screens.devices
        superseded = sorted(d for d, rec in devices.registry.records.items()
                            if rec.status == "running" and d not in statuses)
        for dev in superseded:  # profiling and runs now go to the new agents only: say so on their rows
            devices.set_status(dev, "not in use", "replaced by the agents of the newly connected agents.json")
        if superseded:
            self.state.log(f"profiling and runs now use the new agents only; no longer used: {', '.join(superseded)} "
                           "(restart the demo or reconnect their agents.json to use them again)", "warning")
        if self.coordinator is not None:
            self.coordinator.close()
        self.coordinator = coordinator
        attach(self, coordinator, statuses, origin="agents file")
        self.state.set_connection(f"{len(statuses)} agent(s) connected")
        self.state.log(f"connected to {', '.join(sorted(statuses))}")

    def _on_connect_agents(self) -> None:
        from core.devices.deploy import default_workspace

        start = str(default_workspace() / "agents.json")
        path, _ = QFileDialog.getOpenFileName(self, "Connect to agents", start, "Agents file (agents.json *.json)")
        if path:
            self.connect_agents(path)

    def _on_open_workspace(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Open or create workspace", "workspace.edgeshard",
                                              "Workspaces (*.edgeshard *.sqlite *.db);;All files (*)",
                                              options=QFileDialog.DontConfirmOverwrite)
        if path:
            self.open_workspace(path)

    def _fill_recent_menu(self) -> None:
        self.recent_menu.clear()
        items = studio_app.recent_workspaces()
        if not items:
            a = self.recent_menu.addAction("(none yet)")
            a.setEnabled(False)
        for p in items:
            self.recent_menu.addAction(p, lambda p=p: self.open_workspace(p))

    def _on_load_profile(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Load profile", "", "Profile or problem (*.json);;All files (*)")
        if path:
            self.load_profile_file(path)

    def _on_dark_toggled(self, checked: bool) -> None:
        mode = "dark" if checked else "light"
        studio_app.apply_theme(QApplication.instance(), mode)
        studio_app.settings().setValue("theme", mode)
        for name, screen in self.screens.built():  # one not built yet is built in the new theme
            if name in ("devices", "cluster", "profile", "sessions"):
                screen.refresh()
            elif name == "plan":
                self.screens.plan_editor.refresh()

    def _on_shortcuts(self) -> None:
        lines = [f"Ctrl+{i + 1}: {n}" for i, n in enumerate(SCREENS)] + [
            "Ctrl+O: open workspace", "Ctrl+Shift+P: load profile", "Ctrl+S: save plan", "Ctrl+Z / Ctrl+Shift+Z: undo / redo",
            "Ctrl+R: auto-solve", "Ctrl+Shift+C: compare strategies", "Ctrl+Shift+D: dark theme",
            "Ctrl+D: deploy selected devices", "Ctrl+P: profile cluster", "Ctrl+Shift+F: discover devices",
            "Ctrl+Shift+A: add device", "Ctrl+Enter / Esc (Run screen): start / stop a run",
        ]
        QMessageBox.information(self, "Keyboard shortcuts", "\n".join(lines))

    def _on_about(self) -> None:
        QMessageBox.about(self, "EdgeShard Studio",
                          "Run one LLM collaboratively across edge devices: discover, deploy, profile, plan, run, replay.")

    def _on_state_workspace_changed(self, path: str) -> None:
        self.workspace_label.setText(f"Workspace: {Path(path).name if path else '(none)'}")
        self.workspace_label.setToolTip(path)
        # Only the workspace: Qt appends " — EdgeShard Studio" (the application display name).
        self.setWindowTitle(Path(path).name if path else "")

    def _on_state_model_changed(self, name: str) -> None:
        technique = self.state.technique
        if SCREEN_NAMES[self.stack.currentIndex()] == "run" and self.state.plan is not None:
            from core.techniques import technique_of_plan

            technique = technique_of_plan(self.state.plan)  # what Start runs, whichever view the Plan screen shows
        if technique:
            name = self.state.model_for(technique)
        self.model_label.setText(f"Model: {name or '—'}")

    def _on_state_log_added(self, level: str, text: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        self.log_view.append_line(f"{stamp}  {level.upper():7s} {text}")
        if level in ("warning", "error"):
            self.statusBar().showMessage(text, 8000)

    # persistence ----------------------------------------------------------------------
    def _restore_layout(self) -> None:
        s = studio_app.settings()
        geo, st = s.value("window/geometry"), s.value("window/state")
        if isinstance(geo, QByteArray) and not geo.isEmpty():
            self.restoreGeometry(geo)
        self._layout_restored = isinstance(st, QByteArray) and not st.isEmpty()
        if self._layout_restored:
            self.restoreState(st)  # the operator's own dock height is kept
        title = s.value("window/screen", "Devices")
        self.sidebar.setCurrentRow(SCREENS.index(title) if title in SCREENS else 0)

    def save_layout(self) -> None:
        s = studio_app.settings()
        s.setValue("window/geometry", self.saveGeometry())
        s.setValue("window/state", self.saveState())
        s.setValue("window/screen", self.current_screen_title())
        s.sync()

    def restore_last_workspace(self) -> None:
        """Reopen the last workspace, profile, plan and Run settings (``gui.last_workspace``);
        from now on closing the window keeps them for the next launch. What cannot be
        restored is said in the status bar and the log; the rest still is."""
        from gui.last_workspace import restore_last_workspace

        self.keeps_workspace = True
        problems = restore_last_workspace(self)
        if problems:
            self.state.log("Last workspace partly restored: " + "; ".join(problems), "warning")
        elif self.state.problem is not None:
            plan = self.state.plan
            self.state.log(f"restored the last workspace: {self.state.problem.profile.model.name}"
                           + (f", a plan of {len(plan.stages)} stage(s)" if plan is not None else ""))

    def closeEvent(self, event) -> None:
        self.save_layout()
        if self.keeps_workspace:
            from gui.last_workspace import save_last_workspace

            run = self.screens.run.settings() if self.screens.is_built("run") else None
            for problem in save_last_workspace(self.state, run):
                self.state.log(problem, "warning")
        if self._agents_runner is not None:
            self._agents_runner.shutdown()
        if self.coordinator is not None:
            self.coordinator.close()
            self.coordinator = None
        for name, screen in self.screens.built():
            if name != "cluster":
                screen.shutdown()
        super().closeEvent(event)
