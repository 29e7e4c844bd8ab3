"""The devices screen lists what discovery and the operator report, and deploys selections."""

from __future__ import annotations

import threading

from PySide6.QtCore import QItemSelectionModel
from PySide6.QtWidgets import QDialog, QPlainTextEdit

from core.discovery import AgentAnnouncement, DiscoveredDevice
from core.reporting import Reporter
from gui.devices_panel import DeviceRecord, DevicesPanel
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
    qtbot.waitUntil(lambda: panel.table.rowCount() == 1, timeout=2000)
    assert row_of(panel, "jetson")[:8] == ["jetson", "10.0.0.7:22", "running", "aarch64", "6", "8.0 GiB", "cuda:Orin", "mDNS"]
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
    with qtbot.waitSignal(panel.runner.task_finished, timeout=3000):
        panel.log_button.click()
    dlg = panel.findChild(QDialog, "agentLogDialog")
    assert dlg is not None and "phone: loaded units 0..4" in dlg.findChild(QPlainTextEdit).toPlainText()
    dlg.close()
    with qtbot.waitSignal(panel.runner.task_finished, timeout=3000):
        panel.stop_button.click()
    assert row_of(panel, "phone")[2] == "agent deployed"
    assert all(t is not threading.main_thread() for t in panel.agent_control.threads)
    panel.shutdown()


def test_discover_finds_an_agent_announced_over_real_mdns(qtbot):
    from agents.announce import announce_agent
    from core.discovery import select_interfaces

    addresses = select_interfaces()
    if not addresses:
        import pytest

        pytest.skip("no multicast-capable interface")
    panel = DevicesPanel(StudioState())
    qtbot.addWidget(panel)
    announcement = announce_agent(addresses[0], 7999, name="guiprobe", accelerator="", memory_bytes=3 * 2**30)
    try:
        panel.discover_button.click()
        qtbot.waitUntil(lambda: any(d.startswith("guiprobe") for d in panel.records), timeout=15_000)
        dev = next(d for d in panel.records if d.startswith("guiprobe"))
        rec = panel.records[dev]
        assert rec.status == "running" and rec.memory_bytes == 3 * 2**30 and rec.origin == "mDNS"
        assert panel.discover_button.text() == "Stop discovery"
        panel.discover_button.click()
        assert panel.discovery is None and panel.discover_button.text() == "Discover"
    finally:
        announcement.close()
        panel.shutdown()
