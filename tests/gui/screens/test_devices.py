"""The devices screen lists what discovery and the operator report, and deploys selections."""

from __future__ import annotations

import threading

from PySide6.QtCore import QItemSelectionModel
from PySide6.QtWidgets import QDialog, QPlainTextEdit

from core.devices.discovery import AgentAnnouncement, DiscoveredDevice
from core.reporting import Reporter
from core.devices.registry import DeviceRecord
from gui.screens.devices import COLUMNS, DevicesPanel
from gui.studio_state import StudioState
from tests.gui.problems import make_problem


def announced(dev_id: str, online: bool = True) -> DiscoveredDevice:
    return DiscoveredDevice(
        id=dev_id, addresses=("10.0.0.7",), ssh_port=22, online=online,
        agent=AgentAnnouncement(agent_version="0.1", protocol_version=1, arch="aarch64", cores=6,
                                memory_bytes=8 * 2**30, accelerator="cuda:Orin", control_port=7000),
    )


def row_of(panel: DevicesPanel, dev: str) -> list[str]:
    for r in range(panel.table.rowCount()):
        if panel.table.item(r, 0).text() == dev:
            return [panel.table.item(r, c).text() for c in range(panel.table.columnCount())]
    raise AssertionError(f"{dev} not listed")


def test_a_device_found_on_another_thread_appears_with_its_figures(qtbot):
    state = StudioState()
    panel = DevicesPanel(state)
    qtbot.addWidget(panel)
    t = threading.Thread(target=panel._bridge.device_seen.emit, args=(announced("jetson"),))
    t.start()
    t.join()
    qtbot.waitUntil(lambda: panel.table.rowCount() == 1, timeout=30_000)
    assert row_of(panel, "jetson")[:8] == ["jetson", "10.0.0.7:22", "running", "aarch64", "6", "8.00 GiB", "cuda:Orin", "mDNS"]
    # the cluster screen sees the device before any profiling
    assert state.cluster.device_ids() == ("jetson",)
    panel._on_discovery_device_seen(announced("jetson", online=False))
    assert row_of(panel, "jetson")[2] == "offline"


def test_hand_added_device_is_listed_and_selection_enables_deploy(qtbot):
    panel = DevicesPanel(StudioState())
    qtbot.addWidget(panel)
    assert not panel.deploy_button.isEnabled()
    panel.add_device("192.168.1.20", 2222, "pi", "rpi")
    assert row_of(panel, "rpi")[:3] == ["rpi", "192.168.1.20:2222", "hand-added"]
    panel.table.selectRow(0)
    assert panel.deploy_button.isEnabled()


def test_deploy_opens_with_every_selected_device_and_marks_results(qtbot):
    panel = DevicesPanel(StudioState())
    qtbot.addWidget(panel)
    for name in ("a", "b", "c"):
        panel.add_device(f"10.0.0.{ord(name)}", name=name)
    panel.table.selectRow(0)
    panel.table.selectionModel().select(panel.table.model().index(2, 0),
                                        QItemSelectionModel.Select | QItemSelectionModel.Rows)
    dlg = panel.open_deploy_dialog()
    assert sorted(dlg.records) == ["a", "c"]
    dlg.device_failed.emit("c", "authentication failed: check the user and key")
    assert row_of(panel, "c")[2] == "error" and "authentication failed" in row_of(panel, "c")[8]
    dlg.reject()


def test_profiled_devices_are_marked_profiled(qtbot):
    state = StudioState()
    panel = DevicesPanel(state)
    qtbot.addWidget(panel)
    panel.upsert(DeviceRecord(id="phone", status="running", origin="local cluster"))
    state.set_profile(make_problem().profile)
    assert row_of(panel, "phone")[2] == "profiled"


class LogOnlyControl:
    """An AgentControl whose log call records the thread it ran on."""

    def __init__(self):
        self.threads = []

    def start_agent(self, reporter: Reporter, device: str):
        return None

    def stop_agent(self, reporter: Reporter, device: str):
        self.threads.append(threading.current_thread())
        return DeviceRecord(id=device, status="agent deployed", detail="agent stopped")

    def agent_log(self, reporter: Reporter, device: str):
        self.threads.append(threading.current_thread())
        return [f"{device}: listening on 7000", f"{device}: loaded units 0..4"]


def test_stop_and_log_run_off_the_gui_thread(qtbot):
    panel = DevicesPanel(StudioState())
    qtbot.addWidget(panel)
    panel.agent_control = LogOnlyControl()
    panel.upsert(DeviceRecord(id="phone", status="running"))
    panel.table.selectRow(0)
    assert panel.log_button.isEnabled()
    with qtbot.waitSignal(panel.runner.task_finished, timeout=30_000):
        panel.log_button.click()
    dlg = panel.findChild(QDialog, "agentLogDialog")
    assert dlg is not None and "phone: loaded units 0..4" in dlg.findChild(QPlainTextEdit).toPlainText()
    dlg.close()
    with qtbot.waitSignal(panel.runner.task_finished, timeout=30_000):
        panel.stop_button.click()
    assert row_of(panel, "phone")[2] == "agent deployed"
    assert all(t is not threading.main_thread() for t in panel.agent_control.threads)
    panel.shutdown()


def test_discover_finds_an_agent_announced_over_real_mdns(qtbot):
    from agents.announce import announce_agent
    from core.devices.discovery import select_interfaces

    addresses = select_interfaces()
    if not addresses:
        import pytest

        pytest.skip("no multicast-capable interface")
    panel = DevicesPanel(StudioState())
    qtbot.addWidget(panel)
    announcement = announce_agent(addresses[0], 7999, name="guiprobe", accelerator="", memory_bytes=3 * 2**30)
    try:
        panel.discover_button.click()
        qtbot.waitUntil(lambda: any(d.startswith("guiprobe") for d in panel.registry.records), timeout=60_000)
        dev = next(d for d in panel.registry.records if d.startswith("guiprobe"))
        rec = panel.registry.records[dev]
        assert rec.status == "running" and rec.memory_bytes == 3 * 2**30 and rec.origin == "mDNS"
        assert panel.discover_button.text() == "Stop discovery"
        panel.discover_button.click()
        assert panel.discovery is None and panel.discover_button.text() == "Discover"
    finally:
        announcement.close()
        panel.shutdown()


def test_no_deploy_worker_outlives_the_panel_shutdown_at_exit(qtbot):
    """Closing the deploy dialog leaves its stuck worker running; the studio's exit
    (MainWindow.closeEvent -> shutdown) waits for it, so no thread is left behind."""
    from tests.gui.screens.test_deploy_dialog import StuckDeploy

    panel = DevicesPanel(StudioState())
    qtbot.addWidget(panel)
    fns = StuckDeploy()
    panel.deploy_functions = fns
    panel.upsert(DeviceRecord(id="slow", address="10.0.0.9", ssh_user="edge"))
    panel.table.selectRow(0)
    dlg = panel.open_deploy_dialog()
    dlg.deploy_button.click()
    qtbot.waitUntil(fns.entered.is_set, timeout=30_000)
    dlg.reject()
    assert dlg.alive_threads()
    threading.Timer(0.3, fns.release.set).start()
    panel.shutdown()
    assert dlg.alive_threads() == []
    assert not [t for t in threading.enumerate() if t.name.startswith("edgeshard-deploy")]
    assert panel.registry.records["slow"].status != "running"


# --- agents deployed in an earlier session (real sshd on loopback, real agent) ---------------
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PySide6.QtWidgets import QInputDialog

from tests.gui.screens.test_deploy_dialog import _free_port, real_sshd  # noqa: F401  (fixture)


@pytest.fixture
def earlier_deploy(real_sshd, tmp_path, monkeypatch):  # noqa: F811
    """An agent deployed over SSH by an earlier studio session; yields (workspace, record)."""
    from core.devices import deploy
    port, _fp, (key_type, key_b64, *_r) = real_sshd
    home, ws = tmp_path / "home", tmp_path / "ws"
    (home / ".ssh").mkdir(parents=True)
    ws.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("EDGESHARD_HOME", str(ws))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    (ws / "known_hosts").write_text(f"[127.0.0.1]:{port} {key_type} {key_b64}\n")  # the operator checked it
    key = tmp_path / "operator_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    (tmp_path / "authorized_keys").write_text(Path(f"{key}.pub").read_text())
    opts = deploy.DeployOptions(python=sys.executable, remote_dir=str(tmp_path / "remote" / "{device}"),
                                control_port=_free_port(), data_port=_free_port(), announce=False)
    target = deploy.SshTarget("loop", "127.0.0.1", port, "root")
    result = deploy.deploy_agent(None, target, key_file=str(key), workspace=ws, options=opts, use_agent=False)
    yield ws, target, result.record
    deploy.stop(target, remote_dir=str(tmp_path / "remote" / "loop"), key_file=str(key), workspace=ws,
                use_agent=False)


def test_a_restarted_studio_reads_the_log_stops_and_restarts_an_agent_deployed_earlier(qtbot, earlier_deploy):
    from core.devices import deploy
    from core.devices.deployments import load_deployments

    ws, target, first = earlier_deploy
    saved = (ws / "deployments.json").read_text()
    assert "password" not in saved.replace('"auth": "key"', "")
    dep = load_deployments(ws)["loop"]
    assert (dep.auth, dep.pid, dep.log_path, dep.ssh_port) == ("key", first.pid, first.log_path, target.port)

    panel = DevicesPanel(StudioState())  # a new session: nothing deployed from it
    qtbot.addWidget(panel)
    assert panel.restore_deployments() == 1
    assert row_of(panel, "loop")[2:8:5] == ["agent deployed", "deployed earlier"]
    panel.table.selectRow(0)
    assert panel.log_button.isEnabled() and panel.stop_button.isEnabled()
    try:
        with qtbot.waitSignal(panel.runner.task_finished, timeout=30_000):
            panel.log_button.click()
        log = panel.findChild(QDialog, "agentLogDialog").findChild(QPlainTextEdit).toPlainText()
        assert f"EDGESHARD-AGENT-READY device=loop control={first.control_port}" in log
        with qtbot.waitSignal(panel.runner.task_finished, timeout=60_000):
            panel.stop_button.click()
        assert row_of(panel, "loop")[2] == "agent deployed" and row_of(panel, "loop")[8] == "agent stopped"
        conn = dict(remote_dir=dep.remote_dir, key_file=dep.key_file, workspace=ws, use_agent=False)
        assert isinstance(deploy.status_of(target, **conn), deploy.AgentStopped)
        with qtbot.waitSignal(panel.runner.task_finished, timeout=120_000):
            panel.start_button.click()
        assert row_of(panel, "loop")[2] == "running", row_of(panel, "loop")
        now = deploy.status_of(target, **conn)
        assert isinstance(now, deploy.AgentRunning) and now.record.pid != first.pid
    finally:
        panel.shutdown()


def test_an_agent_deployed_with_a_password_asks_for_it_again(qtbot, real_sshd, tmp_path, monkeypatch):  # noqa: F811
    from core.devices.deployments import Deployment, remember_deployment

    port, _fp, (key_type, key_b64, *_r) = real_sshd
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "known_hosts").write_text(f"[127.0.0.1]:{port} {key_type} {key_b64}\n")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    monkeypatch.setenv("EDGESHARD_HOME", str(ws))
    remember_deployment(ws, Deployment(device="pw", address="127.0.0.1", ssh_port=port, ssh_user="root",
                                       auth="password", remote_dir=str(tmp_path / "remote"), pid=1234,
                                       log_path=str(tmp_path / "remote" / "agent.log")))
    assert "secret" not in (ws / "deployments.json").read_text()
    panel = DevicesPanel(StudioState())
    qtbot.addWidget(panel)
    panel.restore_deployments()
    panel.table.selectRow(0)
    panel.stop_button.click()
    prompt = panel.findChild(QInputDialog, "passwordPrompt")
    assert prompt is not None and prompt.isVisible() and not panel.runner.is_busy()
    with qtbot.waitSignal(panel.runner.task_failed, timeout=30_000):
        prompt.setTextValue("secret")
        prompt.accept()
    # this sshd takes keys only: the password is refused, in plain words
    assert "rejected password" in panel.error.text() and "Traceback" not in panel.error.text()
    assert "secret" not in (ws / "deployments.json").read_text()
    panel.shutdown()


def test_an_emulating_agent_s_memory_column_shows_its_budget(qtbot):
    """A demo or ``cluster local`` agent emulating a memory budget shows it where memory is
    shown (it read "—", the budget only in Details), and the planner sees that budget."""
    panel = DevicesPanel(StudioState())
    qtbot.addWidget(panel)
    panel.upsert(DeviceRecord(id="edge-a", address="127.0.0.1", ssh=False, status="running", origin="local cluster",
                              emulated_budget_bytes=int(3.8 * 2**20)))
    panel.upsert(DeviceRecord(id="plain", address="127.0.0.1", ssh=False, status="running", origin="local cluster"))
    memory = COLUMNS.index("Memory")
    assert row_of(panel, "edge-a")[memory] == "3.8 MiB budget (emulated)"
    assert row_of(panel, "plain")[memory] == "—"
    panel.upsert(DeviceRecord(id="edge-a", status="running", detail="seen again"))  # an update keeps the budget
    assert row_of(panel, "edge-a")[memory] == "3.8 MiB budget (emulated)"
    assert panel.registry.cluster().device("edge-a").memory_bytes == int(3.8 * 2**20)
