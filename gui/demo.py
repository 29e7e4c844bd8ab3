"""``edgeshard studio --demo``: a local cluster of agents and a small model, ready to use.

Setup runs in a worker (making the model and starting agents takes seconds): a small
Llama checkpoint from ``core.models.checkpoints`` (cached between launches), agents as local
processes from ``core.devices.local_cluster`` with emulated links (no root), and a
``Coordinator`` connected to them. Then the studio is wired to it: the Devices screen
lists the agents, the Profile screen can measure them, the Run screen runs on them, and
runs are recorded in the demo workspace. ``stop()`` ends every process it started.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, Signal

from core.errors import EdgeShardError
from core.reporting import Reporter
from gui.devices_panel import DeviceRecord
from gui.studio_state import StudioState
from gui.workers import TaskRunner

DEMO_DEVICES = ("edge-a", "edge-b", "edge-c")
DEMO_LINK_MBIT = 200.0
DEMO_LINK_LATENCY_MS = 2.0
DEMO_MODEL_NAME = "demo-llama"
DEMO_PROFILE_OPTIONS = dict(prompt_tokens=16, batch_sizes=(1, 2), repeats=2, link_target_s=0.3)
DEMO_PROMPTS = ("The edge devices", "A pipeline of layers")


def demo_recipe():
    from core.models.checkpoints import ModelRecipe

    return ModelRecipe(family="llama", layers=6, hidden=256, heads=4, kv_heads=2, vocab=1024, seed=7)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "edgeshard" / "demo"


def ensure_demo_model(reporter: Reporter, root: Path | None = None) -> Path:
    """The demo checkpoint, made once and reused (the same recipe gives the same files)."""
    from core.models.checkpoints import make_model

    root = root or cache_dir()
    out = root / DEMO_MODEL_NAME
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        reporter.status(f"using the demo model in {out}")
        return out
    tmp = Path(tempfile.mkdtemp(prefix=".model-", dir=_mkdir(root)))
    try:
        make_model(demo_recipe(), tmp / "m", reporter)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp / "m", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


@dataclass
class DemoParts:
    """What setup made; owned by the DemoSession, which stops it."""

    workdir: Path
    model_dir: Path | None = None
    cluster: Any = None
    coordinator: Any = None
    statuses: dict | None = None


def setup_demo(reporter: Reporter, parts: DemoParts, devices=DEMO_DEVICES, model_root: Path | None = None) -> DemoParts:
    """Worker job: model, agents, coordinator. Leaves what it made in ``parts`` even on failure."""
    from core.runs.coordinator import Coordinator
    from core.devices.local_cluster import LocalCluster

    reporter.status("preparing the demo model")
    parts.model_dir = ensure_demo_model(reporter, model_root)
    reporter.status(f"starting {len(devices)} local agents")
    parts.cluster = LocalCluster(parts.workdir / "cluster", list(devices), link_mbit=DEMO_LINK_MBIT,
                                 link_latency_ms=DEMO_LINK_LATENCY_MS)
    parts.cluster.start()  # the agents live as long as this process, not this worker thread
    # default heartbeats: a dead agent is noticed within 3 s (agents answer pings while they load)
    parts.coordinator = Coordinator(parts.cluster.endpoints, parts.cluster.keys, request_timeout_s=30.0)
    parts.coordinator.open()
    reporter.status("waiting for the agents")
    parts.statuses = parts.coordinator.wait_ready(30.0)
    return parts


class LocalAgentControl:
    """Agent actions on the demo's local processes (what SSH does for real devices)."""

    def __init__(self, parts: DemoParts) -> None:
        self.parts = parts

    def start_agent(self, reporter: Reporter, device: str):
        raise EdgeShardError(f"{device}: a stopped demo agent cannot be restarted on its own; restart the studio "
                             "with --demo to get a fresh cluster")

    def stop_agent(self, reporter: Reporter, device: str):
        import signal

        pid = self.parts.cluster.pid_of(device)
        os.kill(pid, signal.SIGTERM)
        return DeviceRecord(id=device, status="offline", detail=f"agent stopped (pid {pid})", origin="local cluster")

    def agent_log(self, reporter: Reporter, device: str) -> list[str]:
        return list(self.parts.coordinator.logs(device, 300))


class DemoSession(QObject):
    ready = Signal()
    failed = Signal(str)

    def __init__(self, state: StudioState, window=None, workspace: str | None = None, workdir: str | None = None,
                 devices=DEMO_DEVICES, model_root: str | None = None, profile_options: dict | None = None,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.profile_options = profile_options or dict(DEMO_PROFILE_OPTIONS)
        """Keyword arguments for ``core.devices.profiling.profile_cluster`` (a quick profile by default)."""
        self.state = state
        self.window = window
        self.devices = tuple(devices)
        self.model_root = Path(model_root) if model_root else None
        self._own_workdir = workdir is None
        self.parts = DemoParts(workdir=Path(workdir or tempfile.mkdtemp(prefix="edgeshard-demo-")))
        self.workspace = workspace or str(_mkdir(cache_dir()) / "demo.edgeshard")
        self.runner = TaskRunner(self, name="demo")
        self.runner.task_finished.connect(self._on_setup_finished)
        self.runner.task_failed.connect(self._on_setup_failed)
        self.runner.status_reported.connect(lambda _t, s: self.state.log(f"demo: {s}"))
        self._ready = False
        self.error = ""
        self.missing: list[str] = []
        self._run_done = threading.Event()
        self._stopped = False

    # lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.state.set_connection("starting the demo cluster…")
        self.state.set_workspace(self.workspace)
        self.runner.start(setup_demo, self.parts, self.devices, self.model_root)

    def is_ready(self) -> bool:
        return self._ready or bool(self.error)

    def describe(self) -> str:
        return self.error or ("ready" if self._ready else "starting")

    def _on_setup_finished(self, _task: int, parts: DemoParts) -> None:
        st = self.state
        st.set_model(DEMO_MODEL_NAME, path=str(parts.model_dir))
        st.set_connection(f"demo cluster: {len(self.devices)} agents on 127.0.0.1")
        if self.window is not None:
            from gui.agents_connection import attach

            self.missing += attach(
                self.window, parts.coordinator, parts.statuses or {}, origin="local cluster",
                detail=f"link {DEMO_LINK_MBIT:.0f} Mbit/s + {DEMO_LINK_LATENCY_MS:.0f} ms (emulated)",
                profile_options=self.profile_options, model_name=DEMO_MODEL_NAME,
                agent_control=LocalAgentControl(parts),
            )
        for m in self.missing:
            st.log(f"demo: {m}", "warning")
        st.log("demo ready: Profile ▸ Profile cluster, then Plan ▸ Auto-solve, then Run ▸ Start")
        self._ready = True
        self.ready.emit()

    def _on_setup_failed(self, _task: int, message: str) -> None:
        self.error = message
        self.state.set_connection("demo cluster failed")
        self.state.log(f"demo could not start: {message}", "error")
        self.failed.emit(message)
        self._cleanup()
        if self.window is not None:
            from gui.widgets import show_error

            show_error(self.window, "The demo cluster could not start", message,
                       "The planning screens still work with a loaded profile (File ▸ Load profile…). "
                       "To run models, start agents with `edgeshard cluster local` and use File ▸ Connect to agents….")

    # scripted use (screenshots, tests) --------------------------------------------------------
    def run_once(self, window=None, prompts=DEMO_PROMPTS, max_new_tokens: int = 12) -> bool:
        """Start a run on the Run screen with the demo prompts (as a user would)."""
        run = (window or self.window).screens.get("Run")
        if run is None or not hasattr(run, "start_run"):
            return False
        run.prompts_edit.setPlainText("\n".join(prompts))
        run.max_tokens_spin.setValue(max_new_tokens)
        self._run_done.clear()
        run.run_finished.connect(lambda *_: self._run_done.set())
        run.start_run()
        return True

    def run_finished(self) -> bool:
        return self._run_done.is_set()

    def stop(self) -> None:
        """End every process and thread the demo started (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        if self.parts.coordinator is not None:
            self.parts.coordinator.close()
            self.parts.coordinator = None
        self.runner.shutdown(timeout_s=60.0)
        self._cleanup()

    def _cleanup(self) -> None:
        p = self.parts
        if p.coordinator is not None:
            try:
                p.coordinator.close()
            finally:
                p.coordinator = None
        if p.cluster is not None:
            try:
                p.cluster.stop()
            finally:
                p.cluster = None
        if self._own_workdir and self._stopped:
            shutil.rmtree(p.workdir, ignore_errors=True)
