"""``edgeshard studio --demo``: a local cluster of agents and a small model, ready to use.

Setup runs in a worker: the demo checkpoint, agents as local processes from
``core.devices.local_cluster`` (started in parallel, no root), and a ``Coordinator``
connected to them. Then the studio is wired to it: the Devices screen lists the agents, the
Profile screen can measure them, the Run screen runs on them, and runs are recorded in the
demo workspace. ``stop()`` ends every process it started.

**A demo that shards.** The agents emulate three different edge devices
(agents/emulation.py): each has a memory budget it enforces (a share of the model's
weights), a compute slowdown and its own link. The two fast ones (edge-a, the source, and
edge-b) together cannot hold the model; edge-c can hold all of it but computes 8× slower,
so auto-solve gives it as little as it can and uses all three devices (the cost model
prices a two-stage plan on edge-a and edge-c about a third slower), the strategies in
Compare differ, and a pipelined run overlaps micro-batches on the timeline.

**Attention offloading runs on it too**: its compute agent holds every layer's dense
weights (the whole model but no KV cache), which only edge-c's budget allows; the Plan
screen's *Run on agents* picks edge-c from the profiled budgets, and edge-a and edge-b hold
the KV cache and attention.

**A demo model that speaks.** The model is trained briefly on English quotations
(Debian's ``fortunes``, core/models/training.py) at first use, in a child process, and
cached in the user's data folder. Until then the demo starts at once with the untrained
checkpoint of the same recipe (same units and sizes, so a profile or plan stays valid when
the trained one replaces it) and says so.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, Signal

from core.errors import EdgeShardError
from core.reporting import Reporter
from core.devices.registry import DeviceRecord
from gui.studio_state import StudioState
from gui.workers import TaskRunner

DEMO_DEVICES = ("edge-a", "edge-b", "edge-c")
DEMO_LINK_LATENCY_MS = 2.0
DEMO_MODEL_NAME = "demo-llama"
DEMO_PROFILE_OPTIONS = dict(prompt_tokens=16, batch_sizes=(1, 2), repeats=2, link_target_s=0.3)
DEMO_PROMPTS = ("The secret of life is", "You will")
"""Openings of the quotations it learnt ("You will" opens 77 of them, the third most common). At 713
training steps, greedy with DEMO_REPETITION_PENALTY: "The secret of life is to be." and "You will be
a man of the world."; the earlier "A wise man once said" gave ", and a good thing as if you can't get
out of them." (bench/demo_text.py prints these)."""
DEMO_REPETITION_PENALTY = 1.3
"""The Run screen's repetition penalty in the demo (HF's; the Run screen's default is off): the
small demo model's greedy text loops without one ("not the man who -- not the man who")."""
DEMO_RUN_MODE = ("no-bubbles", 2)
"""The Run screen's mode and micro-batches in the demo: the two prompts as two micro-batches
that overlap on the timeline (the screen's default, sequential with the plan's one micro-batch,
showed one box at a time, the pipeline never full)."""
DEMO_MENU_STEPS = (("Devices", "Profile cluster"), ("Plan", "Auto-solve"), ("Run", "Start"))
"""The hint the demo logs when ready: menu paths that exist in the window (a test checks them)."""
DEMO_HEARTBEAT_TIMEOUT_S = 5.0
"""How long a demo agent may go without a pong before it counts as lost. At the default 2 s a
first launch's profiling failed ("edge-b: no heartbeat for 2.2 s") with three agents profiling
on 2 busy cores beside the model's training; a killed demo agent still shows offline within
~5.5 s."""
DEMO_TRAINING = None
"""``core.models.training.TrainingSettings`` for the demo model (None: its defaults, ~2–3 min on 2 cores)."""


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
at a 6× slowdown the margin was 14 %, too close for a noisy profile."""

UNSHAPED_DEVICE = DemoDevice(memory_share=0.0, slowdown=1.0, link_mbit=200.0)
"""Devices not in DEMO_DEVICE_SHAPES (tests name their own): no budget, no slowdown."""


def demo_recipe():
    from core.models.checkpoints import ModelRecipe

    # hidden 128 / vocab 4096: small enough for ~830 training steps in the 150 s budget on 2 cores,
    # where hidden 192 gets ~490 and its greedy text loops; 4096 tokens hold most words whole, so
    # the model does not glue made-up words from pieces (core/models/training.py has the figures)
    return ModelRecipe(family="llama", layers=6, hidden=128, heads=4, kv_heads=2, vocab=4096, seed=7)


def holds_demo_recipe(model_dir: Path) -> bool:
    """Whether ``model_dir``'s config.json is the current demo recipe's (a checkpoint cached
    by an older studio with another recipe is remade, not reused). Reads JSON only: this runs
    before the studio has imported torch."""
    import json

    r = demo_recipe().resolved()
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    wanted = {"model_type": r.family, "num_hidden_layers": r.layers, "hidden_size": r.hidden,
              "num_attention_heads": r.heads, "num_key_value_heads": r.kv_heads,
              "intermediate_size": r.intermediate, "vocab_size": r.vocab}
    return all(config.get(k) == v for k, v in wanted.items())


def demo_shape(device: str) -> DemoDevice:
    return DEMO_DEVICE_SHAPES.get(device, UNSHAPED_DEVICE)


def demo_emulation(devices, model_dir: Path) -> dict:
    """Each device's emulated limits, the budgets as shares of ``model_dir``'s weights."""
    from agents.emulation import DeviceEmulation
    from core.models.units import load_model_spec

    weights = load_model_spec(model_dir, dtype="fp32").param_bytes
    return {d: DeviceEmulation(memory_budget_bytes=int(demo_shape(d).memory_share * weights),
                               compute_slowdown=demo_shape(d).slowdown) for d in devices}


def cache_dir() -> Path:
    """Untrained checkpoints (remade in seconds when missing)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "edgeshard" / "demo"


def data_dir() -> Path:
    """The trained demo model: user data (minutes to remake), beside the workspace file."""
    from core.paths import workspace_file

    return workspace_file().parent / "demo"


def trained_model_dir(root: Path | None = None) -> Path:
    return (root or data_dir()) / f"{DEMO_MODEL_NAME}-trained"


def has_trained_model(root: Path | None = None) -> bool:
    out = trained_model_dir(root)
    return (out / "training.json").is_file() and any(out.glob("*.safetensors")) and holds_demo_recipe(out)


def ensure_demo_model(reporter: Reporter, root: Path | None = None) -> Path:
    """The trained demo checkpoint if cached, else the untrained one, made once and reused."""
    from core.models.checkpoints import make_model

    if has_trained_model(root):
        reporter.status(f"using the trained demo model in {trained_model_dir(root)}")
        return trained_model_dir(root)
    root = root or cache_dir()
    out = root / DEMO_MODEL_NAME
    if any(out.glob("*.safetensors")) and holds_demo_recipe(out):
        reporter.status(f"using the untrained demo model in {out}")
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


DEMO_ENOUGH_STEPS = 500
"""Training steps after which the demo model is left as it is. A quiet 2-core machine does ~830
in the 150 s budget; a busy one can stop after a few dozen (a model that answers "." to
everything), so a launch that finds fewer continues the training from the cached checkpoint."""


def needs_more_training(root: Path | None = None) -> bool:
    """Whether the cached trained demo model stopped short of ``DEMO_ENOUGH_STEPS``."""
    from core.models.training import trained_steps

    return has_trained_model(root) and trained_steps(trained_model_dir(root)) < DEMO_ENOUGH_STEPS


def train_demo_model(reporter: Reporter, root: Path | None = None, resume: bool = False) -> Path:
    """Worker job: train the demo recipe on the fortunes text in a child process (cancellable);
    ``resume`` continues the cached trained model's training."""
    from core.models.training import TrainingSettings, train_in_subprocess

    return train_in_subprocess(reporter, demo_recipe(), trained_model_dir(root), DEMO_TRAINING or TrainingSettings(),
                               resume=resume)


def profile_cache_dir(root: Path | None = None) -> Path:
    """Where the demo keeps its last measured profile (user data, beside the trained model)."""
    return (root or data_dir()) / "profile"


def demo_profile_key(model_dir: Path, devices, emulation: dict, options: dict) -> str:
    """``core.devices.profile_cache.profile_key`` of a demo profile: the model's units, each
    device's emulated limits and link, the profiling options, the agents' code, the host."""
    import msgspec

    import agents
    from core.devices.profile_cache import code_digest, host_identity, profile_key
    from core.models.units import load_model_spec

    units = msgspec.to_builtins(load_model_spec(model_dir, dtype="fp32", name=DEMO_MODEL_NAME))
    shapes = {d: {"memory_budget_bytes": emulation[d].memory_budget_bytes,
                  "compute_slowdown": emulation[d].compute_slowdown,
                  "link_mbit": demo_shape(d).link_mbit, "link_latency_ms": DEMO_LINK_LATENCY_MS} for d in devices}
    return profile_key(model_config=units, devices=shapes, options=options,
                       code=code_digest(Path(agents.__file__).parent), host=host_identity())


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


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

    from core.devices.profile_cache import has_cached_profiles, load_cached_profile

    if parts.zygote is not None and (profile_options is None or not has_cached_profiles(profile_cache_dir(model_root))):
        parts.zygote.preload(True)  # no profile kept: say so now, not after making the model (first launch)
    reporter.status("preparing the demo model")
    parts.model_dir = ensure_demo_model(reporter, model_root)
    parts.mark("model_ready")
    emulation = demo_emulation(devices, parts.model_dir)
    if profile_options is not None:
        key = demo_profile_key(parts.model_dir, devices, emulation, profile_options)
        parts.kept_profile = load_cached_profile(profile_cache_dir(model_root), key)
    # with a kept profile nothing needs the model code before the operator's first run: the agents
    # are forked before the zygote imports it (~1.5 s of CPU sooner) and each imports it meanwhile
    preload = parts.kept_profile is None
    if parts.zygote is not None:
        parts.zygote.preload(preload)
    reporter.status(f"starting {len(devices)} local agents")
    up: list[str] = []

    def agent_up(device: str) -> None:
        up.append(device)
        reporter.status(f"agent {device} is up ({len(up)}/{len(devices)})")
        reporter.partial_result(device)  # never dropped (progress reports are rate-limited)

    parts.cluster = LocalCluster(parts.workdir / "cluster", list(devices),
                                 link_mbit={d: demo_shape(d).link_mbit for d in devices},
                                 link_latency_ms=DEMO_LINK_LATENCY_MS,
                                 emulation=emulation, zygote=parts.zygote, preload_model_code=preload)
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


class DemoSession(QObject):
    ready = Signal()
    failed = Signal(str)
    trained = Signal(str)
    """The trained demo model is ready at this path (and is now the studio's model)."""

    def __init__(self, state: StudioState, window=None, workspace: str | None = None, workdir: str | None = None,
                 devices=DEMO_DEVICES, model_root: str | None = None, profile_options: dict | None = None,
                 train: bool = True, zygote=None, own_workdir: bool = False, parent: QObject | None = None) -> None:
        """``zygote``: the agents' fork server, already started in ``workdir/cluster``
        (``agents.zygote.start_early_zygote``), which the demo then owns; ``own_workdir``: remove
        the given ``workdir`` when stopped (as the one it makes when none is given)."""
        super().__init__(parent)
        self.profile_options = profile_options or dict(DEMO_PROFILE_OPTIONS)
        """Keyword arguments for ``core.devices.profiling.profile_cluster`` (a quick profile by default)."""
        self.state = state
        self.window = window
        self.devices = tuple(devices)
        self.model_root = Path(model_root) if model_root else None
        self._own_workdir = workdir is None or own_workdir
        self.parts = DemoParts(workdir=Path(workdir or tempfile.mkdtemp(prefix="edgeshard-demo-")), zygote=zygote)
        self.workspace = workspace or str(_mkdir(cache_dir()) / "demo.edgeshard")
        self.runner = TaskRunner(self, name="demo")
        self.runner.task_finished.connect(self._on_setup_finished)
        self.runner.task_failed.connect(self._on_setup_failed)
        self.runner.status_reported.connect(lambda _t, s: self.state.log(f"demo: {s}"))
        self.runner.partial_result_reported.connect(self._on_agent_up)
        self.agents_bar = None
        """The status bar's "agents n/3" while the demo's agents start (the window is usable meanwhile)."""
        self._ready = False
        self.error = ""
        self._run_done = threading.Event()
        self._stopped = False
        self.train = train
        """Train the demo model in the background when no trained one is cached."""
        self.trainer = TaskRunner(self, name="demo-training")
        self.trainer.task_finished.connect(self._on_training_finished)
        self.trainer.task_failed.connect(self._on_training_failed)
        self.trainer.status_reported.connect(lambda _t, s: self.state.log(f"demo model: {s}"))
        self.trainer.progress_reported.connect(self._on_training_progress)
        self.training_bar = None
        self._steps_before_training = 0
        """The cached model's steps when the current training round started (a round that added
        none does not start another)."""

    # lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.state.set_connection("starting the demo cluster…")
        self.state.set_workspace(self.workspace)
        self.runner.start(setup_demo, self.parts, self.devices, self.model_root, self.profile_options)

    def show_starting(self, window) -> None:
        """The window is up before the agents (each imports torch, seconds): list them as
        starting on the Devices screen and show their progress in the status bar, so the
        window is usable at once and says what it is waiting for."""
        from PySide6.QtWidgets import QProgressBar

        self.window = window
        if self._ready or self.error:
            return
        window.screens.devices.upsert_many([DeviceRecord(id=device, address="127.0.0.1", ssh=False, status="starting",
                                                         origin="local cluster", detail="demo agent starting")
                                            for device in self.devices])
        bar = self.agents_bar = QProgressBar()
        bar.setObjectName("demoAgentsBar")
        bar.setRange(0, len(self.devices))
        bar.setValue(0)
        bar.setFormat("demo agents %v/%m up")
        bar.setToolTip("The demo's agents are starting (each loads PyTorch); the planning screens work meanwhile")
        bar.setMaximumWidth(200)
        window.statusBar().addPermanentWidget(bar)

    def _on_agent_up(self, _task: int, device) -> None:
        if self.agents_bar is not None:
            self.agents_bar.setValue(self.agents_bar.value() + 1)
        if self.window is not None:
            self.window.screens.devices.set_status(str(device), "starting", "agent up, attaching")

    def _drop_agents_bar(self) -> None:
        if self.agents_bar is not None:
            self.agents_bar.hide()
            self.agents_bar.deleteLater()
            self.agents_bar = None

    def is_ready(self) -> bool:
        return self._ready or bool(self.error)

    def describe(self) -> str:
        return self.error or ("ready" if self._ready else "starting")

    def _on_setup_finished(self, _task: int, parts: DemoParts) -> None:
        self._drop_agents_bar()
        st = self.state
        st.set_model(DEMO_MODEL_NAME, path=str(parts.model_dir))
        st.set_connection(f"demo cluster: {len(self.devices)} agents on 127.0.0.1")
        if self.window is not None:
            from gui.connection.attach import attach

            emulation = parts.cluster.emulation
            detail = {d: f"emulates {emulation[d].describe()}, link {demo_shape(d).link_mbit:.0f} Mbit/s + "
                         f"{DEMO_LINK_LATENCY_MS:.0f} ms" for d in self.devices}
            attach(
                self.window, parts.coordinator, parts.statuses or {}, origin="local cluster",
                detail=detail, emulated_budgets={d: emulation[d].memory_budget_bytes for d in self.devices},
                profile_options=self.profile_options, model_name=DEMO_MODEL_NAME,
                agent_control=LocalAgentControl(parts), on_profiled=self._keep_profile,
            )
            from gui.screens.run import DEFAULT_PROMPTS

            run = self.window.screens.run
            if run.prompts_edit.toPlainText() == "\n".join(DEFAULT_PROMPTS):  # not the operator's own
                run.prompts_edit.setPlainText("\n".join(DEMO_PROMPTS))  # openings like the quotations it learnt
            if run.penalty_spin.value() == 1.0:  # off: not the operator's own choice
                run.penalty_spin.setValue(DEMO_REPETITION_PENALTY)
            if run.mode_combo.currentText() == "sequential" and run.micro_batches_spin.value() == 0:  # defaults
                run.mode_combo.setCurrentText(DEMO_RUN_MODE[0])
                run.micro_batches_spin.setValue(DEMO_RUN_MODE[1])
        if parts.kept_profile is not None:
            self._use_kept_profile(parts.kept_profile)
        parts.mark("attached")
        st.log("demo ready: " + ", then ".join(" ▸ ".join(step) for step in DEMO_MENU_STEPS))
        if needs_more_training(self.model_root):  # a cached trained model, cut short
            from core.models.training import trained_steps

            steps = trained_steps(trained_model_dir(self.model_root))
            st.log(f"demo model: trained for only {steps} steps (the machine was busy), so its text is still "
                   "rough" + ("; training continues from it now (progress in the status bar), the demo switches "
                              "to it when done" if self.train else ""), "warning")
            if self.train:
                self._start_training(resume=True)
        elif has_trained_model(self.model_root):
            st.log("demo model: trained on English quotations (Debian fortunes); generations read as phrases")
        else:
            st.log("demo model: UNTRAINED (random weights) — its text is gibberish"
                   + ("; training it on English quotations now (about 3 minutes, progress in the status bar); "
                      "the demo switches to it when done" if self.train else ""), "warning")
            if self.train:
                self._start_training()
        self._ready = True
        self.ready.emit()

    # the kept profile ------------------------------------------------------------------------
    def _use_kept_profile(self, kept) -> None:
        """Offer the profile an earlier launch measured for this very demo, saying when."""
        from msgspec.structs import replace

        from core.devices.profile_cache import describe_age

        when = describe_age(kept.measured_at)
        note = (f"profile from {when}, kept from an earlier launch (same model units, devices and agent code on "
                "this machine): Profile cluster re-profiles")
        self.state.set_profile(replace(kept.profile, notes="; ".join(n for n in (kept.profile.notes, note) if n)))
        self.state.log(f"demo: {note}")

    def _keep_profile(self, profile, model_dir: str) -> None:
        """Worker thread, after a profile of the demo's agents: keep it for the next launch."""
        from core.devices.profile_cache import save_cached_profile

        if self.parts.cluster is None or sorted(t.device for t in profile.times) != sorted(self.devices):
            return  # not this demo's agents (a Connect replaced them)
        key = demo_profile_key(Path(model_dir), self.devices, self.parts.cluster.emulation, self.profile_options)
        try:
            save_cached_profile(profile_cache_dir(self.model_root), key, profile)
        except OSError as err:  # a full disk must not fail the profile the operator asked for
            self.state.log(f"demo: could not keep the profile for the next launch ({err.strerror or err})", "warning")

    # the trained model -----------------------------------------------------------------------
    def _start_training(self, resume: bool = False) -> None:
        from core.models.training import trained_steps

        self._steps_before_training = trained_steps(trained_model_dir(self.model_root)) if resume else 0
        if self.window is not None and self.training_bar is None:
            from PySide6.QtWidgets import QProgressBar

            bar = self.training_bar = QProgressBar()
            bar.setObjectName("demoTrainingBar")
            bar.setFormat("training the demo model %p%")
            bar.setToolTip("The demo model is being trained on English quotations in a separate process")
            bar.setMaximumWidth(240)
            self.window.statusBar().addPermanentWidget(bar)
        if self.training_bar is not None:
            # "0%" from the start of each round: a bar without a value is blank, and the tokenizer and
            # the first steps took ~50 s on a busy machine before the first progress report
            self.training_bar.setRange(0, 1000)
            self.training_bar.setValue(0)
        self.trainer.start(train_demo_model, self.model_root, resume)

    def _continue_training(self) -> None:
        if not self._stopped:
            self._start_training(resume=True)

    def _on_training_progress(self, _task: int, done: float, total: float) -> None:
        if self.training_bar is not None and total > 0:
            self.training_bar.setRange(0, 1000)
            self.training_bar.setValue(int(1000 * done / total))

    def _drop_training_bar(self) -> None:
        if self.training_bar is not None:
            self.training_bar.hide()
            self.training_bar.deleteLater()
            self.training_bar = None

    def _on_training_finished(self, _task: int, path) -> None:
        from core.models.training import trained_steps

        self.parts.model_dir = Path(path)
        self.state.set_model(DEMO_MODEL_NAME, path=str(path))
        if self.window is not None:
            self.window.screens.run.model_edit.setText(str(path))
        steps = trained_steps(path)
        if self.train and not self._stopped and self._steps_before_training < steps < DEMO_ENOUGH_STEPS:
            # a busy machine ended the round short: training goes on now, while the studio is open (not
            # only at the next launch), and each round's better model is used by the next run
            self.state.log(f"demo model: trained for {steps} of {DEMO_ENOUGH_STEPS} steps so far (the machine is "
                           "busy), so its text is still rough; the next run uses it, and training continues",
                           "warning")
            self.trained.emit(str(path))
            from PySide6.QtCore import QTimer

            QTimer.singleShot(0, self._continue_training)  # after the runner has finished this round
            return
        self._drop_training_bar()
        self.state.log(f"demo model: trained ({path}, {steps} steps); the next run uses it — same units, the "
                       "profile and plan still hold")
        self.trained.emit(str(path))

    def _on_training_failed(self, _task: int, message: str) -> None:
        self._drop_training_bar()
        self.state.log(f"demo model: training failed, staying with the untrained model: {message}", "warning")

    def _on_setup_failed(self, _task: int, message: str) -> None:
        self._drop_agents_bar()
        self.error = message
        self.state.set_connection("demo cluster failed")
        self.state.log(f"demo could not start: {message}", "error")
        self.failed.emit(message)
        self._cleanup()
        if self.window is not None:
            for device in self.devices:  # the rows show_starting added
                self.window.screens.devices.set_status(device, "offline", "the demo cluster could not start")
            from gui.widgets import show_error

            show_error(self.window, "The demo cluster could not start", message,
                       "The planning screens still work with a loaded profile (File ▸ Load profile…). "
                       "To run models, start agents with `edgeshard cluster local` and use File ▸ Connect to agents….")

    # scripted use (screenshots, tests) --------------------------------------------------------
    def run_once(self, window=None, prompts=DEMO_PROMPTS, max_new_tokens: int = 12) -> bool:
        """Start a run on the Run screen with the demo prompts (as a user would)."""
        target = window or self.window
        if target is None:
            return False
        run = target.screens.run
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
            if self.state.agents is self.parts.coordinator:
                self.state.set_agents(None)
            self.parts.coordinator.close()
            self.parts.coordinator = None
        self.trainer.shutdown(timeout_s=5.0)  # cancelling kills the training process at once
        self.runner.shutdown(timeout_s=60.0)
        self._cleanup()

    def _cleanup(self) -> None:
        p = self.parts
        if p.zygote is not None:  # setup failed before the cluster took it over
            p.zygote.close()
            p.zygote = None
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
