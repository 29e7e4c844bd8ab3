"""What happens to a connection to agents after it is opened: released when nobody will use it,
and a lost agent shown as offline. No widgets here: only the hooks the screens are wired with."""

from __future__ import annotations

from PySide6.QtCore import QObject, Qt, Signal


def close_connection(result) -> None:
    """``on_discarded`` of ``agents_connection.open_coordinator`` (a second Connect superseded
    the first): close the (coordinator, statuses) nobody will use, so its IO thread and ZeroMQ
    context end."""
    coordinator, _statuses = result
    coordinator.close()


class LostAgentBridge(QObject):
    """Carries ``Coordinator.on_lost`` (called on the coordinator's IO thread) into the GUI
    thread through a queued signal; the slot marks the device offline on the Devices screen."""

    agent_lost = Signal(str)


def watch_lost_agents(coordinator, devices, state=None) -> LostAgentBridge:
    """Show an agent that stops answering heartbeats as "offline" on ``devices`` (the Devices
    screen, through its ``set_status``) and in the log. The bridge lives as long as ``devices``."""
    bridge = LostAgentBridge(devices)

    def mark_offline(device: str) -> None:
        control = devices.control_of(device)
        advice = getattr(control, "offline_advice", "restart it or redeploy")  # the demo's agents cannot be restarted
        devices.set_status(device, "offline", f"the agent stopped answering heartbeats: {advice}")
        if state is not None:
            state.log(f"{device}: agent stopped answering (offline)", "warning")

    bridge.agent_lost.connect(mark_offline, Qt.ConnectionType.QueuedConnection)
    coordinator.on_lost = bridge.agent_lost.emit
    return bridge
