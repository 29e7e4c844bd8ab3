"""The devices screen: discovered and hand-added devices, deploy, start/stop agents, logs.

Rows are the ``DeviceRecord`` values of a ``core.devices.registry.DeviceRegistry``, merged
there from every source that knows a device (mDNS discovery, the operator, a local cluster,
deploy results, the profile); this screen only shows them and starts the work. mDNS callbacks
arrive on zeroconf's thread and cross into Qt through a queued signal; every network
action (discovery start, deploy, start/stop, logs) runs in a ``TaskRunner``.

What the buttons do to an agent is an ``AgentControl`` (SSH for real devices, process
control for the local demo cluster), so the panel never knows which it drives.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QHBoxLayout,
    QHeaderView,
    QInputDialog,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from core.devices.registry import (
    DeviceRecord, DeviceRegistry, address_text, record_from_deployment, record_from_discovered,
)
from agents.emulation import DeviceEmulation
from core.reporting import Reporter
from core.planning.cost import format_bytes
from gui.app import theme_colors
from gui.studio_state import StudioState
from gui.widgets import InlineMessage, panel_header, say_why_disabled
from gui.workers import TaskRunner

class AgentControl(Protocol):
    """Long work on one device's agent (each takes a reporter, runs in a worker)."""

    def start_agent(self, reporter: Reporter, device: str) -> DeviceRecord | None: ...

    def stop_agent(self, reporter: Reporter, device: str) -> DeviceRecord | None: ...

    def agent_log(self, reporter: Reporter, device: str) -> list[str]: ...


class _DiscoveryBridge(QObject):
    """Carries discovery callbacks (zeroconf's thread) to the GUI thread."""

    device_seen = Signal(object)


def memory_text(record: DeviceRecord) -> str:
    """What the Memory column shows: the budget an emulating agent enforces (``3.8 MiB budget
    (emulated)``: the memory the planner may fill there), else the device's memory, else ``—``."""
    if record.emulated_budget_bytes:
        return DeviceEmulation(memory_budget_bytes=record.emulated_budget_bytes).describe() + " (emulated)"
    return format_bytes(record.memory_bytes) if record.memory_bytes else "—"


COLUMNS = ["Device", "Address", "Status", "Arch", "Cores", "Memory", "Accelerator", "Found by", "Details"]


class DevicesPanel(QWidget):
    records_changed = Signal()

    def __init__(self, state: StudioState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self.registry = DeviceRegistry()
        self.agent_control: AgentControl | None = None
        """Default agent control (the demo's local processes)."""
        self.device_controls: dict[str, AgentControl] = {}
        """Per-device control, e.g. SSH with the credentials a deploy succeeded with."""
        self.deploy_functions: Any = None
        """Override for the deploy dialog's SSH functions (None: core.devices.deploy)."""
        self.discovery = None
        self._bridge = _DiscoveryBridge(self)
        self._bridge.device_seen.connect(self._on_discovery_device_seen, Qt.QueuedConnection)
        self.runner = TaskRunner(self, name="devices")
        self._closer = TaskRunner(self, name="discovery-stop")
        self.runner.task_finished.connect(self._on_runner_finished)
        self.runner.task_failed.connect(self._on_runner_failed)
        self.runner.status_reported.connect(lambda _t, s: self.message.setText(s))
        self._pending: Callable[[Any], None] | None = None
        self._deploy_dialogs: list = []
        """Deploy dialogs whose workers may still run (joined at shutdown)."""
        self._build()
        state.profile_changed.connect(self._on_state_profile_changed)

    def _build(self) -> None:
        lay = QVBoxLayout(self)
        lay.setContentsMargins(16, 12, 16, 12)
        lay.addWidget(panel_header("Devices", "Devices found on the local network (mDNS) or added by hand. "
                                   "Select several and Deploy to install and start agents."))
        bar = QHBoxLayout()
        self.discover_button = self._button("Discover", "Browse the local network for devices (mDNS)", self.toggle_discovery)
        self.discover_button.setCheckable(True)
        self.add_button = self._button("Add device…", "Add a device by address when multicast is blocked", self._on_add_clicked)
        self.deploy_button = self._button("Deploy…", "Install and start the agent on the selected devices over SSH (Ctrl+D)",
                                          self.open_deploy_dialog)
        self.deploy_button.setProperty("role", "primary")
        self.start_button = self._button("Start agent", "Start the agent on the selected device", lambda: self._agent_action("start"))
        self.stop_button = self._button("Stop agent", "Stop the agent on the selected device", lambda: self._agent_action("stop"))
        self.log_button = self._button("Agent log", "Show the last lines of the selected agent's log", lambda: self._agent_action("log"))
        for b in (self.discover_button, self.add_button, self.deploy_button, self.start_button, self.stop_button, self.log_button):
            bar.addWidget(b)
        say_why_disabled({
            self.deploy_button: "select one or more devices in the table first",
            self.stop_button: "select one device whose agent this studio started (deployed or demo)",
            self.log_button: "select one device whose agent this studio started (deployed or demo)",
        })
        bar.addStretch(1)
        lay.addLayout(bar)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setAccessibleName("Devices")
        self.table.setSelectionBehavior(QAbstractItemView.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.ExtendedSelection)
        self.table.setEditTriggers(QAbstractItemView.NoEditTriggers)
        self.table.setAlternatingRowColors(True)
        self.table.verticalHeader().hide()
        hh = self.table.horizontalHeader()
        hh.setSectionResizeMode(QHeaderView.ResizeToContents)
        hh.setSectionResizeMode(len(COLUMNS) - 1, QHeaderView.Stretch)
        self.table.itemSelectionChanged.connect(self._update_buttons)
        lay.addWidget(self.table, 1)
        self.message = QLabel("")
        self.message.setProperty("role", "subtitle")
        self.message.setWordWrap(True)
        lay.addWidget(self.message)
        self.error = InlineMessage()
        lay.addWidget(self.error)
        self._update_buttons()

    def _button(self, text: str, tip: str, slot) -> QPushButton:
        b = QPushButton(text)
        b.setToolTip(tip)
        b.setAccessibleName(text.rstrip("…"))
        b.clicked.connect(slot)
        return b

    # records ---------------------------------------------------------------------------
    def upsert(self, rec: DeviceRecord) -> None:
        """Add or update a row; figures an update does not know are kept (``merge_record``)."""
        self.upsert_many([rec])

    def upsert_many(self, records) -> None:
        """``upsert`` each record, then redraw once (the Cluster screen redraws its graph and
        heatmaps for each change: ~0.1 s a time, three times when three agents attached)."""
        for rec in records:
            self.registry.upsert(rec)
        self._records_changed()

    def set_status(self, device: str, status: str, detail: str = "") -> None:
        if self.registry.set_status(device, status, detail) is not None:
            self._records_changed()

    def _records_changed(self) -> None:
        self._fill_table()
        if self.state.profile is None:  # before profiling, the cluster screen shows the devices as found
            self.state.set_cluster(self.registry.cluster())
        self.state.set_offline(self.registry.offline())
        self.records_changed.emit()

    def selected_ids(self) -> list[str]:
        rows = sorted({i.row() for i in self.table.selectedIndexes()})
        return [self.table.item(r, 0).text() for r in rows]

    def _fill_table(self) -> None:
        selected = set(self.selected_ids())
        c = theme_colors()
        records = self.registry.sorted()
        self.table.setRowCount(len(records))
        for r, rec in enumerate(records):
            cells = [
                rec.id, address_text(rec), rec.status, rec.arch or "—",
                str(rec.cores) if rec.cores else "—",
                memory_text(rec),
                rec.accelerator or "CPU only" if rec.arch else "—", rec.origin, rec.detail,
            ]
            for col, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if col == 2:
                    color = {"running": c["ok"], "profiled": c["ok"], "error": c["error"], "offline": c["muted"],
                             "agent deployed": c["accent"]}.get(rec.status)
                    if color:
                        item.setForeground(QColor(color))
                    item.setToolTip(rec.detail or rec.status)
                if col == len(cells) - 1 and text:
                    item.setToolTip(text)  # a narrow window elides it
                if col == len(cells) - 1 and rec.status == "error":
                    item.setForeground(QColor(c["error"]))
                self.table.setItem(r, col, item)
            if rec.id in selected:
                self.table.selectRow(r)
        self._update_buttons()

    def refresh(self) -> None:
        self._fill_table()

    def _update_buttons(self) -> None:
        ids = self.selected_ids()
        one = len(ids) == 1
        has_control = one and self.control_of(ids[0]) is not None
        self.deploy_button.setEnabled(bool(ids))
        for b in (self.start_button, self.stop_button, self.log_button):
            b.setEnabled(one and has_control)
        if not has_control:
            self.start_button.setToolTip("Deploy the agent first (Deploy…), or run the demo cluster")

    def _on_state_profile_changed(self, profile) -> None:
        if profile is not None and self.registry.mark_profiled(profile):
            self._records_changed()

    # discovery --------------------------------------------------------------------------
    def toggle_discovery(self) -> None:
        if self.discovery is None:
            from core.devices.discovery import DeviceDiscovery

            self.discovery = DeviceDiscovery(on_change=self._bridge.device_seen.emit)
            disc = self.discovery
            self.message.setText("Browsing the local network for devices…")
            self._run(lambda rep: (disc.start(), "Browsing for devices (mDNS)")[1], self._on_discovery_started)
        else:
            self.stop_discovery()

    def _on_discovery_started(self, text: str) -> None:
        self.discover_button.setChecked(True)
        self.discover_button.setText("Stop discovery")
        self.state.log(text)

    def stop_discovery(self) -> None:
        """Stop browsing; zeroconf's goodbye packets take a moment, so it closes in a worker."""
        if self.discovery is not None:
            disc, self.discovery = self.discovery, None
            self._closer.start(lambda rep: disc.stop())
        self.discover_button.setChecked(False)
        self.discover_button.setText("Discover")

    def _on_discovery_device_seen(self, dev) -> None:
        self.upsert(record_from_discovered(dev))

    def add_device(self, address: str, port: int = 22, user: str = "", name: str = "") -> DeviceRecord:
        if self.discovery is not None:
            rec = record_from_discovered(self.discovery.add_manual(address, port, user, name or None))
        else:
            rec = DeviceRecord(id=name or address, address=address, ssh_port=port, ssh_user=user,
                               status="hand-added", origin="hand-added")
        self.upsert(rec)
        self.state.log(f"added device {rec.id} ({address}:{port})")
        return rec

    def _on_add_clicked(self) -> None:
        dlg = AddDeviceDialog(self)
        if dlg.exec() == QDialog.Accepted:
            address, port, user, name = dlg.values()
            if not address:
                self.error.show_lines(["A device needs an address (host name or IP)."])
                return
            self.error.show_lines([])
            self.add_device(address, port, user, name)

    # agents -------------------------------------------------------------------------------
    def open_deploy_dialog(self) -> "QDialog | None":
        ids = self.selected_ids()
        if not ids:
            self.error.show_lines(["Select one or more devices to deploy to (click, Ctrl+click)."])
            return None
        from gui.screens.deploy_dialog import DeployDialog

        dlg = DeployDialog([self.registry.records[i] for i in ids], functions=self.deploy_functions, parent=self)
        self._deploy_dialogs = [d for d in self._deploy_dialogs if d.isVisible() or d.alive_threads()] + [dlg]
        dlg.device_deployed.connect(lambda dev, detail, dlg=dlg: self._on_deploy_dialog_device_deployed(dlg, dev, detail))
        dlg.device_failed.connect(lambda dev, detail: self.set_status(dev, "error", detail))
        dlg.open()
        return dlg

    def _on_deploy_dialog_device_deployed(self, dlg, dev: str, detail: str) -> None:
        self.set_status(dev, "running", detail)
        creds = dlg.credentials_used.get(dev)
        if creds is not None and dlg._functions is None:  # real SSH (not a test's functions)
            self.restore_deployments()  # the deploy recorded itself in the workspace
        self._update_buttons()

    def restore_deployments(self, workspace=None) -> int:
        """List the agents deployed from this workspace (this session or an earlier one) and
        give each an SSH control: start, stop and log work after a restart of the studio.
        Reads one small local file; returns how many were found."""
        from core.devices.deployments import default_workspace, load_deployments
        from core.errors import EdgeShardError

        try:
            deployments = load_deployments(workspace or default_workspace())
        except EdgeShardError as err:
            self.error.show_lines([f"Cannot read the remembered deployments: {err}"])
            return 0
        if not deployments:
            return 0
        from gui.connection.deploy_adapter import SshAgentControl

        for dev, dep in deployments.items():
            rec = self.registry.records.get(dev)
            if rec is None:
                rec = record_from_deployment(dev, dep)
                self.upsert(rec)
            self.device_controls[dev] = SshAgentControl.from_deployment(dep, rec)
        self._update_buttons()
        return len(deployments)

    def control_of(self, device: str) -> AgentControl | None:
        return self.device_controls.get(device) or self.agent_control

    def _agent_action(self, what: str, dev: str | None = None, once: AgentControl | None = None) -> None:
        """``once``: a control for this action only (it carries a password just asked for)."""
        ids = [dev] if dev else self.selected_ids()
        if len(ids) != 1 or self.control_of(ids[0]) is None:
            return
        dev = ids[0]
        ctl = once or self.control_of(dev)
        if getattr(ctl, "needs_password", lambda: False)():
            self._ask_password(dev, ctl, what)
            return
        if what == "start":
            self.message.setText(f"Starting the agent on {dev}…")
            self._run(lambda rep: ctl.start_agent(rep, dev), self._on_agent_changed)
        elif what == "stop":
            self.message.setText(f"Stopping the agent on {dev}…")
            self._run(lambda rep: ctl.stop_agent(rep, dev), self._on_agent_changed)
        else:
            self._run(lambda rep: (dev, ctl.agent_log(rep, dev)), self._on_agent_log)

    def _ask_password(self, dev: str, ctl, what: str) -> QInputDialog:
        """The agent was deployed with a password, which is never stored: ask for it again."""
        dlg = QInputDialog(self)
        dlg.setObjectName("passwordPrompt")
        dlg.setWindowTitle(f"Sign in to {dev}")
        dlg.setLabelText(f"Password of {ctl.credentials.user or 'the login'} on {dev} "
                         "(used for this action only, never kept):")
        dlg.setTextEchoMode(QLineEdit.Password)

        def accepted(text: str) -> None:
            dlg.setTextValue("")
            if text:
                self._agent_action(what, dev, once=ctl.with_password(text))

        dlg.textValueSelected.connect(accepted)
        dlg.rejected.connect(lambda: dlg.setTextValue(""))  # textValueSelected comes after finished
        dlg.finished.connect(dlg.deleteLater)
        dlg.open()
        return dlg

    def _on_agent_changed(self, rec: DeviceRecord | None) -> None:
        if rec is not None:
            self.upsert(rec)
            self.message.setText(f"{rec.id}: {rec.status}")
            self.state.log(f"{rec.id}: agent {rec.status}")

    def _on_agent_log(self, result) -> None:
        dev, lines = result
        dlg = QDialog(self)
        dlg.setWindowTitle(f"Agent log — {dev}")
        dlg.setObjectName("agentLogDialog")
        lay = QVBoxLayout(dlg)
        text = QPlainTextEdit("\n".join(lines) or "(the agent has logged nothing yet)")
        text.setReadOnly(True)
        text.setAccessibleName("Agent log")
        lay.addWidget(text)
        buttons = QDialogButtonBox(QDialogButtonBox.Close)
        buttons.rejected.connect(dlg.reject)
        lay.addWidget(buttons)
        dlg.resize(760, 420)
        dlg.open()

    # worker plumbing --------------------------------------------------------------------
    def _run(self, fn, on_done) -> None:
        self._pending = on_done
        self.runner.start(fn)

    def _on_runner_finished(self, _task: int, result) -> None:
        done, self._pending = self._pending, None
        if done is not None:
            done(result)

    def _on_runner_failed(self, _task: int, message: str) -> None:
        self._pending = None
        self.message.setText("")
        self.error.show_lines([message])
        self.state.log(message, "error")
        if self.discovery is not None and not self.discover_button.isChecked():
            self.discovery = None

    def shutdown(self) -> None:
        """At exit: stop discovery and wait for every worker, deploys of closed dialogs included."""
        for dlg in self._deploy_dialogs:
            if dlg.isVisible():
                dlg.done(0)
            dlg.join_workers()
        self.runner.shutdown()
        if self.discovery is not None:
            self.discovery.stop()
            self.discovery = None
        self._closer.shutdown()


class AddDeviceDialog(QDialog):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Add device")
        form = QFormLayout(self)
        self.address = QLineEdit()
        self.address.setPlaceholderText("192.168.1.20 or jetson.local")
        self.address.setAccessibleName("Address")
        self.port = QSpinBox()
        self.port.setRange(1, 65535)
        self.port.setValue(22)
        self.port.setAccessibleName("SSH port")
        self.user = QLineEdit()
        self.user.setPlaceholderText("(your login name)")
        self.user.setAccessibleName("SSH user")
        self.name = QLineEdit()
        self.name.setPlaceholderText("(defaults to the address)")
        self.name.setAccessibleName("Name")
        form.addRow("Address", self.address)
        form.addRow("SSH port", self.port)
        form.addRow("User", self.user)
        form.addRow("Name", self.name)
        buttons = QDialogButtonBox(QDialogButtonBox.Ok | QDialogButtonBox.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        form.addRow(buttons)

    def values(self) -> tuple[str, int, str, str]:
        return self.address.text().strip(), self.port.value(), self.user.text().strip(), self.name.text().strip()
