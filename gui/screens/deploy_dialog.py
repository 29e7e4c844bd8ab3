"""The Deploy dialog: credentials, host-key confirmation, a progress row per device.

Per device: first its SSH host key is fetched (in a worker). A host the operator's
known_hosts does not list is shown with its key type and SHA256 fingerprint and
deployed to only after they confirm it; a host whose key *changed* is refused
(possible man-in-the-middle) with what to do. Then the deploy runs in the device's own
worker, its steps and any error shown in plain words on the device's row.

The SSH work itself is ``DeployFunctions`` (gui/connection/deploy_adapter.py; by default over ``core.devices.deploy``), so the dialog
holds no SSH code and tests can drive it against a real sshd.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QButtonGroup,
    QDialog,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QRadioButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from gui.app import theme_colors
from gui.connection.deploy_adapter import CoreDeployFunctions, Credentials, DeployFunctions, HostKeyProbe
from gui.workers import TaskRunner, shutdown_together


COLUMNS = ["Device", "Address", "Step", "Progress", "Details"]


class DeployDialog(QDialog):
    device_deployed = Signal(str, str)
    device_failed = Signal(str, str)
    host_key_confirmation_requested = Signal(str)
    """A fingerprint confirmation is on screen for this device."""

    def __init__(self, records: list, functions: DeployFunctions | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle(f"Deploy agent to {len(records)} device(s)")
        self.setObjectName("deployDialog")
        self.records = {r.id: r for r in records}
        self._functions = functions
        self.runners: dict[str, TaskRunner] = {}
        self.credentials_used: dict[str, Credentials] = {}
        self.probes: dict[str, HostKeyProbe] = {}
        self.outcome: dict[str, str] = {}
        self.confirmations: dict[str, QMessageBox] = {}
        self._build(records)

    @property
    def functions(self) -> DeployFunctions:
        if self._functions is None:
            self._functions = CoreDeployFunctions()
        return self._functions

    def _build(self, records) -> None:
        lay = QVBoxLayout(self)
        form = QFormLayout()
        self.user_edit = QLineEdit(next((r.ssh_user for r in records if r.ssh_user), ""))
        self.user_edit.setPlaceholderText("login name on the devices")
        self.user_edit.setAccessibleName("SSH user")
        self.user_edit.setToolTip("The account the agent will run as")
        form.addRow("User", self.user_edit)
        auth = QHBoxLayout()
        self.key_radio = QRadioButton("Key file")
        self.password_radio = QRadioButton("Password")
        self.key_radio.setChecked(True)
        group = QButtonGroup(self)
        group.addButton(self.key_radio)
        group.addButton(self.password_radio)
        auth.addWidget(self.key_radio)
        auth.addWidget(self.password_radio)
        auth.addStretch(1)
        form.addRow("Sign in with", auth)
        key_row = QHBoxLayout()
        self.key_edit = QLineEdit()
        self.key_edit.setPlaceholderText("~/.ssh/id_ed25519 (empty: your SSH agent and default keys)")
        self.key_edit.setAccessibleName("Private key file")
        browse = QPushButton("Browse…")
        browse.setToolTip("Choose a private key file")
        browse.clicked.connect(self._on_browse_clicked)
        key_row.addWidget(self.key_edit, 1)
        key_row.addWidget(browse)
        form.addRow("Key", key_row)
        self.password_edit = QLineEdit()
        self.password_edit.setEchoMode(QLineEdit.Password)
        self.password_edit.setAccessibleName("Password")
        self.password_edit.setEnabled(False)
        form.addRow("Password", self.password_edit)
        self.password_radio.toggled.connect(self.password_edit.setEnabled)
        self.key_radio.toggled.connect(self.key_edit.setEnabled)
        lay.addLayout(form)

        self.table = QTableWidget(len(records), len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().hide()
        self.table.setAccessibleName("Deploy progress")
        self.table.setEditTriggers(QTableWidget.NoEditTriggers)
        hh = self.table.horizontalHeader()
        hh.setSectionResizeMode(QHeaderView.ResizeToContents)
        hh.setSectionResizeMode(len(COLUMNS) - 1, QHeaderView.Stretch)
        self.rows: dict[str, int] = {}
        for i, r in enumerate(records):
            self.rows[r.id] = i
            self.table.setItem(i, 0, QTableWidgetItem(r.id))
            self.table.setItem(i, 1, QTableWidgetItem(f"{r.address}:{r.ssh_port}" if r.address else "—"))
            self.table.setItem(i, 2, QTableWidgetItem("waiting"))
            bar = QProgressBar()
            bar.setRange(0, 100)
            bar.setValue(0)
            bar.setAccessibleName(f"Deploy progress of {r.id}")
            self.table.setCellWidget(i, 3, bar)
            self.table.setItem(i, 4, QTableWidgetItem(""))
        lay.addWidget(self.table, 1)
        self.summary = QLabel("Press Deploy to connect to each device, confirm its host key and install the agent.")
        self.summary.setWordWrap(True)
        lay.addWidget(self.summary)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        self.deploy_button = QPushButton("Deploy")
        self.deploy_button.setProperty("role", "primary")
        self.deploy_button.setToolTip("Connect, verify host keys, install and start the agent")
        self.deploy_button.clicked.connect(self.start)
        self.close_button = QPushButton("Cancel")
        self.close_button.setToolTip("Stop what is running and close")
        self.close_button.clicked.connect(self.reject)
        buttons.addWidget(self.deploy_button)
        buttons.addWidget(self.close_button)
        lay.addLayout(buttons)
        self.resize(820, 300 + 28 * len(records))

    def _on_browse_clicked(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Private key", "", "All files (*)")
        if path:
            self.key_edit.setText(path)

    def credentials(self) -> Credentials:
        if self.password_radio.isChecked():
            return Credentials(user=self.user_edit.text().strip(), password=self.password_edit.text())
        return Credentials(user=self.user_edit.text().strip(), key_file=self.key_edit.text().strip())

    # row helpers ------------------------------------------------------------------------
    def step_text(self, device: str) -> str:
        return self.table.item(self.rows[device], 2).text()

    def detail_text(self, device: str) -> str:
        return self.table.item(self.rows[device], 4).text()

    def _set_row(self, device: str, step: str | None = None, detail: str | None = None, error: bool = False,
                 progress: float | None = None) -> None:
        r = self.rows[device]
        if step is not None:
            self.table.item(r, 2).setText(step)
        if detail is not None:
            item = self.table.item(r, 4)
            item.setText(detail)
            item.setToolTip(detail)
            item.setForeground(QColor(theme_colors()["error" if error else "text"]))
        if progress is not None:
            self.table.cellWidget(r, 3).setValue(int(progress * 100))

    # flow --------------------------------------------------------------------------------
    def start(self) -> None:
        creds = self.credentials()
        if not creds.user:
            self.summary.setText("Enter the user name to sign in as.")
            self.user_edit.setFocus()
            return
        if self.password_radio.isChecked() and not creds.password:
            self.summary.setText("Enter the password, or sign in with a key file.")
            return
        self.deploy_button.setEnabled(False)
        self.summary.setText("Connecting…")
        todo = [d for d in self.records if self.outcome.get(d) != "done"]
        for dev in todo:
            rec = self.records[dev]
            self.outcome.pop(dev, None)
            old = self.runners.pop(dev, None)
            if old is not None:
                old.shutdown(timeout_s=1.0)
                old.deleteLater()
            runner = TaskRunner(self, name=f"deploy-{dev}")
            self.runners[dev] = runner
            runner.task_finished.connect(lambda _t, res, dev=dev: self._on_probe_finished(dev, res))
            runner.task_failed.connect(lambda _t, msg, dev=dev: self._on_device_failed(dev, msg))
            self._set_row(dev, "checking host key", "", progress=0.02)
            runner.start(self.functions.probe_host_key, rec, creds)

    def _on_probe_finished(self, dev: str, result: Any) -> None:
        runner = self.runners[dev]
        runner.task_finished.disconnect()
        if not isinstance(result, HostKeyProbe):
            return
        self.probes[dev] = result
        if result.changed:
            self._on_device_failed(dev, (
                f"the host key of {dev} has CHANGED ({result.key_type} {result.fingerprint}). This can mean someone is "
                "intercepting the connection. If the device was reinstalled, remove its old entry from "
                "~/.ssh/known_hosts (ssh-keygen -R HOST) and deploy again."))
            return
        if result.known:
            self._deploy(dev, result)
            return
        self._set_row(dev, "confirm host key", f"{result.key_type} {result.fingerprint}")
        box = QMessageBox(QMessageBox.Question, "Unknown host key",
                          f"{dev} ({self.records[dev].address}) is not in your known hosts.", parent=self)
        box.setObjectName(f"hostKey-{dev}")
        box.setInformativeText(
            f"Its {result.key_type} key fingerprint is\n{result.fingerprint}\n\n"
            "Compare it with the one the device shows (ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub on it). "
            "Trust this key and deploy?")
        trust = box.addButton("Trust and deploy", QMessageBox.AcceptRole)
        box.addButton("Skip this device", QMessageBox.RejectRole)
        box.setTextInteractionFlags(Qt.TextSelectableByMouse)
        box.buttonClicked.connect(lambda b, dev=dev, trust=trust: self.confirm_host_key(dev, b is trust))
        self.confirmations[dev] = box
        box.open()
        self.host_key_confirmation_requested.emit(dev)

    def confirm_host_key(self, dev: str, accepted: bool) -> None:
        box = self.confirmations.pop(dev, None)
        if box is not None:
            box.hide()
            box.deleteLater()
        if accepted:
            self._deploy(dev, self.probes[dev])
        else:
            self._set_row(dev, "skipped", "host key not trusted: nothing was installed", progress=0)
            self.outcome[dev] = "skipped"
            self._check_done()

    def _deploy(self, dev: str, probe: HostKeyProbe) -> None:
        runner = self.runners[dev]
        runner.task_finished.connect(lambda _t, res, dev=dev: self._on_deploy_finished(dev, res))
        runner.status_reported.connect(lambda _t, s, dev=dev: self._set_row(dev, s))
        runner.progress_reported.connect(lambda _t, d, t, dev=dev: self._set_row(dev, progress=d / t if t else 0))
        self._set_row(dev, "connecting", "")
        creds = self.credentials()
        self.credentials_used[dev] = replace(creds, password="")  # who signed in and how, never the password
        runner.start(self.functions.deploy_agent, self.records[dev], creds, probe)

    def _on_deploy_finished(self, dev: str, detail: Any) -> None:
        self._set_row(dev, "done", str(detail or "agent running"), progress=1.0)
        self.outcome[dev] = "done"
        self.device_deployed.emit(dev, str(detail or "agent running"))
        self._check_done()

    def _on_device_failed(self, dev: str, message: str) -> None:
        self._set_row(dev, "failed", message, error=True)
        self.outcome[dev] = "failed"
        self.device_failed.emit(dev, message)
        self._check_done()

    def _check_done(self) -> None:
        if len(self.outcome) < len(self.records):
            return
        ok = sum(1 for v in self.outcome.values() if v == "done")
        failed = [d for d, v in self.outcome.items() if v == "failed"]
        self.summary.setText(f"{ok} of {len(self.records)} device(s) deployed."
                             + (f" Failed: {', '.join(failed)} — see Details for what to do." if failed else ""))
        self.close_button.setText("Close")
        self.deploy_button.setEnabled(True)
        self.deploy_button.setText("Retry")
        self.deploy_button.setEnabled(bool(failed) or any(v == "skipped" for v in self.outcome.values()))

    def done(self, result: int) -> None:
        """Close at once: running deploys are asked to stop and their late reports are
        ignored; their threads end in the background (``join_workers`` waits for them)."""
        for dev, runner in self.runners.items():
            if runner.is_busy():
                runner.cancel()
                self._set_row(dev, "cancelled", "the dialog was closed during the deploy; deploy again to finish")
        for box in list(self.confirmations.values()):
            box.close()
        self.confirmations.clear()
        self.password_edit.clear()  # a password is asked at the time, never kept
        super().done(result)

    def alive_threads(self) -> list:
        return [t for r in self.runners.values() for t in r.alive_threads()]

    def join_workers(self, timeout_s: float = 30.0) -> bool:
        """Wait for every worker this dialog started (at application exit); True if none is left."""
        return shutdown_together(self.runners.values(), timeout_s)
