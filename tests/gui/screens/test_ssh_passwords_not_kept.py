"""SSH passwords are asked for at the time and kept by no widget or control afterwards."""

from __future__ import annotations

import socket

from PySide6.QtWidgets import QInputDialog, QLineEdit

from gui.connection.deploy_adapter import Credentials, HostKeyProbe, SshAgentControl
from gui.screens.deploy_dialog import DeployDialog
from core.devices.registry import DeviceRecord
from gui.screens.devices import DevicesPanel
from gui.studio_state import StudioState

SECRET = "hunter2-not-kept"


class _KnownHostDeploy:
    """Deploy functions for a host with a known key; records the credentials each deploy got."""

    def __init__(self):
        self.used = []

    def probe_host_key(self, reporter, record, credentials):
        return HostKeyProbe(device=record.id, key_type="ssh-ed25519", fingerprint="SHA256:x", known=True)

    def deploy_agent(self, reporter, record, credentials, trusted):
        self.used.append(credentials)
        return "agent running"


def test_the_deploy_dialog_keeps_no_password_once_closed(qtbot):
    fns = _KnownHostDeploy()
    dlg = DeployDialog([DeviceRecord(id="a", address="10.0.0.2", ssh_user="edge")], functions=fns)
    qtbot.addWidget(dlg)
    dlg.show()
    dlg.password_radio.setChecked(True)
    dlg.password_edit.setText(SECRET)
    with qtbot.waitSignal(dlg.device_deployed, timeout=30_000):
        dlg.deploy_button.click()
    assert [c.password for c in fns.used] == [SECRET]  # the deploy itself got it
    assert dlg.credentials_used["a"].password == ""  # what the panel may read: user and method only
    dlg.done(0)
    assert dlg.password_edit.text() == ""
    assert SECRET not in repr(dlg.credentials_used)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_password_typed_for_an_agent_action_is_asked_again_next_time(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    panel = DevicesPanel(StudioState())
    qtbot.addWidget(panel)
    rec = DeviceRecord(id="pw", address="127.0.0.1", ssh_port=_closed_port(), ssh_user="root",
                       status="agent deployed")
    panel.upsert(rec)
    panel.device_controls["pw"] = SshAgentControl(rec, Credentials(user="root"), password_auth=True)
    try:
        panel.table.selectRow(0)
        for _ in range(2):  # asked each time: the first answer was not kept
            panel.stop_button.click()
            prompt = next(p for p in panel.findChildren(QInputDialog, "passwordPrompt") if p.isVisible())
            assert prompt.textEchoMode() == QLineEdit.Password and not panel.runner.is_busy()
            with qtbot.waitSignal(panel.runner.task_failed, timeout=30_000):  # nothing listens on that port
                prompt.setTextValue(SECRET)
                prompt.accept()
            assert "refused" in panel.error.text()  # the action ran, with the password typed
            assert panel.control_of("pw").credentials.password == ""
            assert all(SECRET not in w.text() for w in panel.findChildren(QLineEdit))
            assert all(SECRET not in d.textValue() for d in panel.findChildren(QInputDialog))
    finally:
        panel.shutdown()
