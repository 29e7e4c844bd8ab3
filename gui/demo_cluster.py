"""The demo's local cluster: three agents that emulate different edge devices (a memory budget
they enforce, a compute slowdown, a link; agents/emulation.py), started as local processes
from ``core.devices.local_cluster`` with a ``Coordinator`` on them (``setup_demo``, a worker
job), the start-up's steps, and the key a measured profile of them is kept under.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.errors import EdgeShardError
from core.reporting import Reporter
from core.devices.registry import DeviceRecord
from gui import demo_model

DEMO_DEVICES = ("edge-a", "edge-b", "edge-c")
DEMO_LINK_LATENCY_MS = 2.0
DEMO_PROFILE_OPTIONS = dict(prompt_tokens=16, batch_sizes=(1, 2), repeats=2, link_target_s=0.3, compute_together=True)
"""A quick profile; the three emulated devices' compute timed at once (each by its CPU time: the sum
of three agents' times was most of the 10-42 s *Profile cluster* took; docs/gui.md)."""
DEMO_HEARTBEAT_TIMEOUT_S = 5.0
"""How long a demo agent may go without a pong before it counts as lost. At the default 2 s a
first launch's profiling failed ("edge-b: no heartbeat for 2.2 s") with three agents profiling
on 2 busy cores beside the model's training; a killed demo agent still shows offline within
~5.5 s."""

@dataclass(frozen=True)
class DemoDevice:
    """What one demo agent emulates."""

    memory_share: float
    """Memory budget as a share of the demo model's weights (< 1: the model cannot fit it alone)."""
    slowdown: float
    link_mbit: float


DEMO_DEVICE_SHAPES = {
    "edge-a": DemoDevice(memory_share=0.45, slowdown=1.0, link_mbit=200.0),  # the source: fastest
    "edge-b": DemoDevice(memory_share=0.40, slowdown=1.5, link_mbit=100.0),
    "edge-c": DemoDevice(memory_share=1.25, slowdown=8.0, link_mbit=50.0),  # slowest, most memory
}
"""edge-a and edge-b together hold < 1 model, so every plan needs edge-c; edge-c alone holds the
whole model (attention offloading's compute agent needs that) but is 8× slower, so auto-solve
gives it only what the others cannot hold: three stages. With the profile of a demo run, the
best plan on edge-a and edge-c (22.1 ms per token) is 36 % slower than the three-stage one (16.2 ms);
at a 6× slowdown the margin was 14 %, too close for a noisy profile. Attention offloading's second
compute replica would need a second device holding the whole model, and then the minimum-latency
plan needs no third stage: the demo keeps layer sharding's three stages and one replica
(docs/attention-offload.md)."""

UNSHAPED_DEVICE = DemoDevice(memory_share=0.0, slowdown=1.0, link_mbit=200.0)
"""Devices not in DEMO_DEVICE_SHAPES (tests name their own): no budget, no slowdown."""

def demo_shape(device: str) -> DemoDevice:
    return DEMO_DEVICE_SHAPES.get(device, UNSHAPED_DEVICE)


def demo_emulation(devices, model_dir: Path) -> dict:
    """Each device's emulated limits, the budgets as shares of ``model_dir``'s weights."""
    from agents.emulation import DeviceEmulation
    from core.models.units import load_model_spec

    weights = load_model_spec(model_dir, dtype="fp32").param_bytes
    return {d: DeviceEmulation(memory_budget_bytes=int(demo_shape(d).memory_share * weights),
                               compute_slowdown=demo_shape(d).slowdown) for d in devices}

def profile_cache_dir(root: Path | None = None) -> Path:
    """Where the demo keeps its last measured profile (user data, beside the trained model)."""
    return (root or demo_model.data_dir()) / "profile"


def demo_profile_key(model_dir: Path, devices, emulation: dict, options: dict) -> str:
    """``core.devices.profile_cache.profile_key`` of a demo profile: the model's units, each
    device's emulated limits and link, the profiling options, the agents' code, the host."""
    import msgspec

    import agents
    from core.devices.profile_cache import code_digest, host_identity, profile_key
    from core.models.units import load_model_spec

    units = msgspec.to_builtins(load_model_spec(model_dir, dtype="fp32", name=demo_model.DEMO_MODEL_NAME))
    shapes = {d: {"memory_budget_bytes": emulation[d].memory_budget_bytes,
                  "compute_slowdown": emulation[d].compute_slowdown,
                  "link_mbit": demo_shape(d).link_mbit, "link_latency_ms": DEMO_LINK_LATENCY_MS} for d in devices}
    return profile_key(model_config=units, devices=shapes, options=options,
                       code=code_digest(Path(agents.__file__).parent), host=host_identity())

@dataclass
class DemoParts:
    """What setup made; owned by the DemoSession, which stops it."""

    workdir: Path
    model_dir: Path | None = None
    zygote: Any = None
    """The agents' fork server, started first (until the cluster takes it over)."""
    cluster: Any = None
    coordinator: Any = None
    statuses: dict | None = None
    kept_profile: Any = None
    """``core.devices.profile_cache.CachedProfile`` measured at an earlier launch for this very
    demo (same model units, devices, agent code, host), or None."""
    phases: dict[str, float] = field(default_factory=dict)
    """``time.time()`` at each step of the start (``STARTUP_PHASES``), for the start-up breakdown."""

    def mark(self, phase: str) -> None:
        self.phases[phase] = time.time()


STARTUP_PHASES = (
    ("zygote_started", "the agents' zygote was started (first thing, before the GUI's imports)"),
    ("setup_started", "the setup worker began"),
    ("model_ready", "the demo checkpoint was found (or made)"),
    ("zygote_ready", "the zygote had imported torch, the agent and the model code"),
    ("agents_up", "every agent, forked, listened and printed its ready line"),
    ("agents_answering", "the coordinator had a status from every agent"),
    ("attached", "the screens were wired to the agents: the demo is ready"),
)
"""The demo's start, step by step, in the order they happen on its critical path (the window
is built on the GUI thread meanwhile)."""


def startup_breakdown(phases: dict[str, float], since: float) -> dict[str, float]:
    """Seconds from ``since`` (the launch) to each step reached, in ``STARTUP_PHASES`` order
    (steps not reached are left out: a popen launcher has no zygote)."""
    return {name: round(phases[name] - since, 2) for name, _ in STARTUP_PHASES if name in phases}


def setup_demo(reporter: Reporter, parts: DemoParts, devices=DEMO_DEVICES, model_root: Path | None = None,
               profile_options: dict | None = None) -> DemoParts:
    """Worker job: model, agents, coordinator. Leaves what it made in ``parts`` even on failure.

    The agents' zygote (agents/zygote.py: it imports torch and transformers once, then forks
    the agents) starts first, before this job's own imports and the model, since its imports
    are the longest part of the demo's start (``edgeshard studio --demo`` starts it even earlier,
    before the GUI's imports, and hands it over in ``parts.zygote``)."""
    parts.mark("setup_started")
    if parts.zygote is None:
        from agents.zygote import start_early_zygote

        parts.zygote = start_early_zygote(str(parts.workdir / "cluster"))  # None: LocalCluster tries again
    if parts.zygote is not None:
        parts.phases.setdefault("zygote_started", parts.zygote.started_at)

    from core.runs.coordinator import Coordinator
    from core.devices.local_cluster import LocalCluster

    from core.devices.profile_cache import load_cached_profile

    # the zygote imports the model code before it forks, kept profile or not: forked without it (a
    # kept profile's launch), each agent imported transformers itself in the background and the first
    # Start waited for that: 8.4-9.3 s to "Run completed" against 0.6-1.6 s, the agents' CPU to quit
    # 16.1 against 5.9 s, first text 16.6 against 13.0 s, ready 7.6 against 11.7 s (second launch,
    # bench/demo_startup.py --run, xcb, load 11-14, medians of 2)
    if parts.zygote is not None:
        parts.zygote.preload(True)  # said now, not after making the model
    reporter.status("preparing the demo model")
    parts.model_dir = demo_model.ensure_demo_model(reporter, model_root)
    parts.mark("model_ready")
    emulation = demo_emulation(devices, parts.model_dir)
    if profile_options is not None:
        key = demo_profile_key(parts.model_dir, devices, emulation, profile_options)
        parts.kept_profile = load_cached_profile(profile_cache_dir(model_root), key)
    reporter.status(f"starting {len(devices)} local agents")
    up: list[str] = []

    def agent_up(device: str) -> None:
        up.append(device)
        reporter.status(f"agent {device} is up ({len(up)}/{len(devices)})")
        reporter.partial_result(device)  # never dropped (progress reports are rate-limited)

    parts.cluster = LocalCluster(parts.workdir / "cluster", list(devices),
                                 link_mbit={d: demo_shape(d).link_mbit for d in devices},
                                 link_latency_ms=DEMO_LINK_LATENCY_MS,
                                 emulation=emulation, zygote=parts.zygote, preload_model_code=True)
    zygote, parts.zygote = parts.zygote, None  # the cluster's now: it stops it
    parts.cluster.start(on_ready=agent_up)  # the agents live as long as this process, not this worker thread
    if zygote is not None and zygote.ready_at:
        parts.phases["zygote_ready"] = zygote.ready_at
    parts.mark("agents_up")
    reporter.status(parts.cluster.launch_note)
    # agents answer pings while they load and profile; the timeout is longer than the default 2 s
    # because on a busy 2-core machine a profiling agent went 2.2 s without a pong (DEMO_HEARTBEAT_TIMEOUT_S)
    parts.coordinator = Coordinator(parts.cluster.endpoints, parts.cluster.keys, request_timeout_s=30.0,
                                    heartbeat_timeout_s=DEMO_HEARTBEAT_TIMEOUT_S)
    parts.coordinator.open()
    reporter.status("waiting for the agents")
    parts.statuses = parts.coordinator.wait_ready(30.0)
    parts.mark("agents_answering")
    return parts


class LocalAgentControl:
    """Agent actions on the demo's local processes (what SSH does for real devices)."""

    offline_advice = "restart the studio with --demo to get a fresh cluster"
    """What a lost demo agent's row says (the same as Start's refusal: one piece of advice, not two)."""

    def __init__(self, parts: DemoParts) -> None:
        self.parts = parts

    def start_agent(self, reporter: Reporter, device: str):
        raise EdgeShardError(f"{device}: a stopped demo agent cannot be restarted on its own; "
                             f"{self.offline_advice}")

    def stop_agent(self, reporter: Reporter, device: str):
        import signal

        pid = self.parts.cluster.pid_of(device)
        os.kill(pid, signal.SIGTERM)
        return DeviceRecord(id=device, status="offline", detail=f"agent stopped (pid {pid})", origin="local cluster")

    def agent_log(self, reporter: Reporter, device: str) -> list[str]:
        return list(self.parts.coordinator.logs(device, 300))
