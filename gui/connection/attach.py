"""Connecting the studio to running agents: an ``agents.json`` (from ``edgeshard cluster
local`` or ``edgeshard deploy``) or the demo's own cluster.

``open_coordinator`` is long work (connect, wait for every agent to answer) for a worker;
``attach`` then wires the screens on the GUI thread: the Devices screen lists the agents,
the Profile screen measures them with ``core.devices.profiling``, the Run screen runs on them.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from core.errors import EdgeShardError
from core.reporting import Reporter
from gui.connection.lifecycle import watch_lost_agents
from core.devices.registry import DeviceRecord

def open_coordinator(reporter: Reporter, agents_file: str):
    """Connect to the agents listed in ``agents_file``; returns (coordinator, statuses)."""
    from core.runs.coordinator import Coordinator
    from core.devices.local_cluster import load_agents_file

    endpoints, keys = load_agents_file(agents_file)
    if not endpoints:
        raise EdgeShardError(f"{agents_file} lists no agents: deploy or start some first")
    reporter.status(f"connecting to {len(endpoints)} agent(s)")
    # the default heartbeat timeout: agents answer pings while they load or profile, so a dead
    # agent is noticed within 3 s
    coordinator = Coordinator(endpoints, keys, request_timeout_s=30.0)
    coordinator.open()
    try:
        statuses = coordinator.wait_ready(30.0)
    except BaseException:
        coordinator.close()
        raise
    return coordinator, statuses


def profile_function(coordinator, state, options: dict, model_name: str = "", on_profiled=None):
    """``fn(reporter) -> Profile`` for the Profile screen: measures the model the studio has
    selected; ``on_profiled(profile, model_dir)`` then runs on the worker (the demo keeps it)."""

    def measure(reporter: Reporter):
        from core.devices import profiling
        model_dir = getattr(state, "model_path", "")
        if not model_dir or not (Path(model_dir) / "config.json").exists():
            raise EdgeShardError("choose the model checkpoint directory (Run screen ▸ Model ▸ …) before profiling")
        config = json.loads((Path(model_dir) / "config.json").read_text())
        result = profiling.profile_cluster(coordinator, config, model_name=model_name or Path(model_dir).name,
                                           dtype="fp32", reporter=reporter, **options)
        if on_profiled is not None:
            on_profiled(result.profile, model_dir)
        return result.profile

    return measure


def attach(window, coordinator, statuses: dict, *, origin: str, detail: str | dict[str, str] = "",
           profile_options: dict | None = None, model_name: str = "", agent_control=None,
           on_profiled=None, emulated_budgets: dict[str, int] | None = None) -> None:
    """Wire the screens of ``window`` (its typed ``screens``) to ``coordinator``; ``detail`` is
    one note for every agent or a note per device; ``on_profiled`` as ``profile_function``'s;
    ``emulated_budgets``: per device, the memory budget its agent emulates (the Memory column's)."""
    screens, state = window.screens, window.state
    devices = screens.devices
    records = []
    for dev, status in sorted(statuses.items()):
        control = coordinator.endpoints[dev].control_address.split("//")[-1]
        address = control.rsplit(":", 1)[0]
        local = address in ("127.0.0.1", "localhost")
        note = detail.get(dev, "") if isinstance(detail, dict) else detail
        records.append(DeviceRecord(
            id=dev, address=address, status="running", origin=origin,
            ssh=not local, control_address=control, pid=status.pid,  # a local agent has no SSH: show what is real
            arch=platform.machine() if local else "", cores=(os.cpu_count() or 0) if local else 0,
            memory_bytes=status.memory_bytes, emulated_budget_bytes=(emulated_budgets or {}).get(dev, 0),
            detail=f"agent {status.agent_version}, pid {status.pid}" + (f", {note}" if note else ""),
        ))
    devices.upsert_many(records)
    if agent_control is not None:
        devices.agent_control = agent_control
    devices.refresh()
    state.set_agents(coordinator)
    watch_lost_agents(coordinator, devices, state)  # a killed agent shows as offline
    screens.profile.set_profile_task(profile_function(coordinator, state, profile_options or {}, model_name,
                                                      on_profiled))
    from gui.connection.cluster_backend import ClusterRunBackend

    run = screens.run
    run.set_backend(ClusterRunBackend(coordinator, state))
    if not run.model_edit.text() and state.model_path:
        run.model_edit.setText(state.model_path)
