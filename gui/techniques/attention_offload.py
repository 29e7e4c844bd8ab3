"""Attention offloading's plan view: which device holds the dense layers, which holds which heads' KV.

The attention-offload technique's face on the Plan screen (gui.techniques). The problem is the
cluster you have — the connected agents' measured profile (budgets, links, speeds from the
blocks' decode times: ``core.techniques.attention_offload.measured``) for the chosen checkpoint,
re-planned whenever the profile or the model changes — or, as a what-if, a scenario (the
paper's H100 + H20 pairing, or an edge lab); a strategy gives the plan
(Auto-solve: the exact search; Compare: exact, Lamina's rule and the two baselines). The
placement canvas draws one row per device: a compute device's bar spans the layers whose dense
part it holds, a memory device's bar the key/value heads whose KV and attention it holds, each
with memory used over capacity; baselines show each device's layer range.
"""

from __future__ import annotations

from PySide6.QtCore import QRectF, QSize, Qt, Signal
from PySide6.QtGui import QColor, QPainter, QPen
from PySide6.QtWidgets import (
    QComboBox, QFormLayout, QGridLayout, QGroupBox, QHBoxLayout, QLabel, QLayout, QPushButton, QSpinBox,
    QVBoxLayout, QWidget,
)

from core.errors import EdgeShardError
from core.techniques.attention_offload.cost import evaluate
from core.techniques.attention_offload.planner import BaselinePlan, run_strategy
from core.techniques.attention_offload.problem import OffloadPlan, OffloadProblem, OffloadWorkload
from core.techniques.attention_offload.scenarios import SCENARIOS
from gui.app import stage_color
from gui.studio_state import StudioState
from gui.techniques.attention_probe import AttentionProbe, Same
from gui.widgets import InlineMessage, borderless_scroll, comparison_table, fill_table, panel_header, say_why_disabled

STRATEGIES = ("exact", "lamina-rule", "homogeneous", "layer-sharding")
GIB = 2**30
MEASURED = "measured cluster"
"""The source picker's entry for the connected agents' measured profile (the others: what-if scenarios)."""
MEASURED_WORKLOAD = OffloadWorkload(prompt_tokens=16, generated_tokens=32, max_batch=8)
"""A measured cluster's workload when its profile names no prompt length: a demo-sized run."""


def measured_problem(profile, model_dir: str, agents) -> OffloadProblem:
    """The measured cluster as this view plans it: the profiled agents that are connected, the
    checkpoint's geometry (float32, as the agents load it), the profiled prompt length."""
    from core.techniques.attention_offload.measured import problem_from_profile
    from core.techniques.attention_offload.run import checkpoint_model

    workload = MEASURED_WORKLOAD
    if profile.profiled_workload is not None:
        workload = OffloadWorkload(prompt_tokens=profile.profiled_workload.prompt_tokens,
                                   generated_tokens=MEASURED_WORKLOAD.generated_tokens,
                                   max_batch=MEASURED_WORKLOAD.max_batch)
    return problem_from_profile(profile, checkpoint_model(model_dir), workload,
                                devices=tuple(agents) if agents else None)


def used_of(used: float, cap: float) -> str:
    """"used/capacity" in GiB, or in MiB where the capacity is under a GiB (an edge agent's budget)."""
    unit, name = (GIB, "GiB") if cap >= GIB else (2**20, "MiB")
    return f"{used / unit:.1f}/{cap / unit:.1f} {name}"


def placement_rows(problem: OffloadProblem, plan) -> list[tuple[str, str, float, float, str]]:
    """Per device: (device, role, bar start, bar end as fractions of its axis, label). Pure: the
    canvas draws it, tests check it. Role: dense | kv | layers | unused."""
    m = problem.model
    rows: dict[str, tuple[str, str, float, float, str]] = {
        d.id: (d.id, "unused", 0.0, 0.0, "unused") for d in problem.devices}
    if isinstance(plan, OffloadPlan):
        cost = evaluate(problem, plan)
        for d in plan.compute:
            cap = problem.device(d).memory_bytes
            rows[d] = (d, "dense", 0.0, 1.0, f"dense part of layers 0–{m.layers - 1} · no KV · "
                                             f"{used_of(cost.compute_bytes, cap)}")
        for d, heads in plan.kv_heads_of(m.kv_heads).items():
            cap = problem.device(d).memory_bytes
            g = m.q_heads // m.kv_heads
            used = plan.in_flight * plan.batch * problem.workload.context_tokens * m.kv_bytes_per_token() \
                * len(heads) / m.kv_heads
            rows[d] = (d, "kv", heads.start / m.kv_heads, heads.stop / m.kv_heads,
                       f"KV + attention of kv heads {heads.start}–{heads.stop - 1} (q heads {heads.start * g}–"
                       f"{heads.stop * g - 1}), all layers · {used_of(used, cap)}")
    elif isinstance(plan, BaselinePlan):
        start = 0
        for d, layers in plan.stages:
            rows[d] = (d, "layers", start / m.layers, (start + layers) / m.layers,
                       f"layers {start}–{start + layers - 1} with their KV")
            start += layers
        if plan.kind == "homogeneous":
            top = max(x.flops for x in problem.devices)
            for x in problem.devices:
                if x.flops == top:
                    rows[x.id] = (x.id, "layers", 0.0, 1.0, f"all {m.layers} layers with their own KV (a replica)")
    return list(rows.values())


class PlacementCanvas(QWidget):
    """One row per device: its bar on the layer axis (dense / layers) or the head axis (KV)."""

    ROW = 34
    LABEL = 170

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.rows: list[tuple[str, str, float, float, str]] = []
        self.axis = ""
        self.setAccessibleName("Placement")
        self.setMinimumWidth(500)

    def show_rows(self, rows, axis: str) -> None:
        self.rows, self.axis = rows, axis
        self.setMinimumHeight(40 + len(rows) * self.ROW + 20)
        self.updateGeometry()
        self.update()

    def paintEvent(self, _event) -> None:  # noqa: N802 (Qt)
        p = QPainter(self)
        pal = self.palette()
        text = pal.color(pal.ColorRole.WindowText)
        p.setPen(text)
        p.drawText(QRectF(self.LABEL, 4, self.width() - self.LABEL - 12, 20), Qt.AlignLeft | Qt.AlignVCenter, self.axis)
        x0, width = self.LABEL, max(50, self.width() - self.LABEL - 16)
        for i, (device, role, a, b, label) in enumerate(self.rows):
            y = 30 + i * self.ROW
            p.setPen(text)
            p.drawText(QRectF(8, y, self.LABEL - 16, self.ROW - 6), Qt.AlignLeft | Qt.AlignVCenter,
                       f"{device} · {role}")
            frame = QRectF(x0, y, width, self.ROW - 8)
            p.setPen(QPen(pal.color(pal.ColorRole.Mid)))
            p.setBrush(Qt.NoBrush)
            p.drawRect(frame)
            if role != "unused" and b > a:
                color = stage_color(0 if role in ("dense", "layers") and a == 0 else i)
                if role == "kv":
                    color = QColor(stage_color(i + 3))
                bar = QRectF(x0 + a * width, y, (b - a) * width, self.ROW - 8)
                p.fillRect(bar, color)
            p.setPen(text)
            p.drawText(frame.adjusted(6, 0, -6, 0), Qt.AlignLeft | Qt.AlignVCenter, label)
        p.end()


class OffloadRunControls(QGroupBox):
    """The Run screen's attention-offloading options (shown for a plan of its dense stage): how many
    compute replicas (more than one: Lamina's staggered pipelining) and which staggering; the roles
    they give the connected agents (``agent_roles``: the plan's compute device is replica 0)."""

    changed = Signal()
    REPLICAS_TIP = ("Compute agents that each hold the whole dense part; more than one runs Lamina's staggered "
                    "pipelining over the micro-batches (the rest of the connected agents are memory agents: KV "
                    "cache and attention, split by heads)")

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Attention offloading", parent)
        self.setAccessibleName("Attention offloading run options")
        self.replicas = QSpinBox()
        self.replicas.setRange(1, 1)
        self.replicas.setAccessibleName("Compute replicas")
        self.replicas.setToolTip(self.REPLICAS_TIP)
        self.schedule = QComboBox()
        self.schedule.addItems(["rotational", "fixed"])
        self.schedule.setAccessibleName("Staggering")
        self.schedule.setItemData(0, "Consecutive slices of a batch move from replica to replica (no bubbles)",
                                  Qt.ItemDataRole.ToolTipRole)
        self.schedule.setItemData(1, "Each batch stays on one replica (bubbles when batches do not divide "
                                  "over the replicas)", Qt.ItemDataRole.ToolTipRole)
        self.schedule.setToolTip("How the micro-batches' slices go over the compute replicas")
        self.roles = QLabel("")
        self.roles.setAccessibleName("Agent roles")
        self.roles.setWordWrap(True)
        form = QFormLayout(self)
        form.addRow("Compute replicas", self.replicas)
        form.addRow("Staggering", self.schedule)
        form.addRow(self.roles)
        self._dense, self._agents = "", []
        self._holders: list[str] = []
        """The other agents whose budgets hold the dense part: the replicas after the plan's device."""
        self._roles: tuple[tuple[str, ...], tuple[str, ...]] | None = None
        """(compute, memory) named by a proposal (a plan of the measured cluster); None: ``agent_roles``."""
        self._applying = False
        self.replicas.valueChanged.connect(self._on_changed)
        self.schedule.currentTextChanged.connect(self._on_changed)
        self.hide()

    def show_for(self, plan, agents: list[str], budgets: dict[str, int] | None = None, dense_bytes: int = 0) -> None:
        """Show the options when ``plan`` is an attention-offload dense plan (else hide them).
        ``budgets`` (profiled, bytes) and ``dense_bytes`` (what a replica holds): only agents whose
        budget holds the dense part can be replicas (an agent without a profiled budget may be)."""
        from core.techniques.attention_offload import DENSE_KIND

        stages = getattr(plan, "stages", ())
        if len(stages) != 1 or stages[0].kind != DENSE_KIND:
            self.hide()
            return
        if (stages[0].device, list(agents)) != (self._dense, self._agents):
            self._roles = None  # named for another plan or other agents
        self._dense, self._agents = stages[0].device, list(agents)
        others = [a for a in agents if a != self._dense]
        budgets = budgets or {}
        small = [a for a in others if dense_bytes and budgets.get(a, 0) > 0 and budgets[a] < dense_bytes]
        self._holders = [a for a in others if a not in small]
        # every agent but one (a memory agent must be left) may be a replica if its budget holds the dense part
        self.replicas.setMaximum(max(1, min(len(others), 1 + len(self._holders))))
        self.replicas.setToolTip(self.REPLICAS_TIP + ("" if not small else (
            f". Here at most {self.replicas.maximum()}: "
            + ", ".join(f"{a} ({budgets[a] / 2**20:.1f} MiB)" for a in small)
            + f" cannot hold a replica's {dense_bytes / 2**20:.1f} MiB of dense weights")))
        self.show()
        self._update_roles()

    def options(self) -> dict:
        roles = self._roles
        others = [a for a in self._agents if a != self._dense]
        r = self.replicas.value()
        if roles is None and r > 1 and others[:r - 1] != self._holders[:r - 1]:
            # the next agents in order (``agent_roles``) include one too small for a replica: name the ones that hold it
            compute = (self._dense, *self._holders[:r - 1])
            roles = (compute, tuple(a for a in others if a not in compute))
        named = {} if roles is None else {"compute": list(roles[0]), "memory": list(roles[1])}
        return {"compute_replicas": self.replicas.value(), "schedule": self.schedule.currentText(), **named}

    def apply(self, options: dict) -> None:
        """Take proposed (or recorded) options; ``compute``/``memory`` name each agent's role (a plan of
        the measured cluster), kept until the operator changes the replicas or another plan comes."""
        roles = None
        if options.get("compute") and options.get("memory"):
            roles = (tuple(options["compute"]), tuple(options["memory"]))
        self._applying = True
        try:
            if "compute_replicas" in options:
                self.replicas.setValue(int(options["compute_replicas"]))
            if options.get("schedule") in ("rotational", "fixed"):
                self.schedule.setCurrentText(options["schedule"])
        finally:
            self._applying = False
        self._roles = roles if roles and len(roles[0]) == self.replicas.value() else None
        self._on_changed()

    def lane_notes(self) -> dict[str, str]:
        """Device -> its role in the run these options give (the timeline's lane notes)."""
        from core.techniques.attention_offload.run import lane_roles

        from core.techniques.attention_offload.run import OffloadRunOptions

        return lane_roles(self._dense, self._agents or [self._dense], OffloadRunOptions.of(self.options()))

    def _on_changed(self, *_args) -> None:
        if not self._applying and self._roles is not None and len(self._roles[0]) != self.replicas.value():
            self._roles = None  # the operator chose another replica count: the next agents, as usual
        self._update_roles()
        self.changed.emit()

    def _update_roles(self) -> None:
        notes = self.lane_notes()
        if not notes:
            self.roles.setText("connect two agents at least: one compute, one or more memory")
            return
        compute = [d for d, n in notes.items() if n.startswith("compute")]
        memory = [d for d, n in notes.items() if n == "attention"]
        how = (f"{self.schedule.currentText()} staggered pipelining over the micro-batches"
               if len(compute) > 1 else "one compute agent (more micro-batches: staggered)")
        self.roles.setText(f"compute: {', '.join(compute)} · memory (attention): {', '.join(memory)} — {how}")


class WrappingControls(QWidget):
    """Labelled pickers in one row where the view is wide, in two where it is not (a 1024 px
    screen): the minimum width is the two-row one, so the screen never scrolls sideways for them."""

    SPLIT = 3
    """Pairs in the first row when wrapped."""

    def __init__(self, pairs: list[tuple[QWidget, QWidget]]) -> None:
        super().__init__()
        self.pairs = pairs
        self.grid = QGridLayout(self)
        self.grid.setContentsMargins(0, 0, 0, 0)
        self.grid.setSizeConstraint(QLayout.SizeConstraint.SetNoConstraint)
        self.wrapped: bool | None = None
        self._arrange(wrapped=False)

    def _row_width(self, pairs) -> int:
        spacing = max(0, self.grid.horizontalSpacing())
        return sum(label.sizeHint().width() + w.sizeHint().width() + 2 * spacing for label, w in pairs)

    def minimumSizeHint(self) -> QSize:  # noqa: N802 (Qt)
        return QSize(max(self._row_width(self.pairs[:self.SPLIT]), self._row_width(self.pairs[self.SPLIT:])),
                     super().minimumSizeHint().height())

    def _arrange(self, wrapped: bool) -> None:
        if wrapped == self.wrapped:
            return
        self.wrapped = wrapped
        for label, w in self.pairs:
            self.grid.removeWidget(label)
            self.grid.removeWidget(w)
        for i, (label, w) in enumerate(self.pairs):
            row, col = (1, 2 * (i - self.SPLIT)) if wrapped and i >= self.SPLIT else (0, 2 * i)
            self.grid.addWidget(label, row, col)
            self.grid.addWidget(w, row, col + 1)
        self.grid.setColumnStretch(2 * len(self.pairs), 1)  # the pickers keep their width, left-aligned
        self.updateGeometry()

    def resizeEvent(self, event) -> None:  # noqa: N802 (Qt)
        super().resizeEvent(event)
        self._arrange(wrapped=event.size().width() < self._row_width(self.pairs))


class AttentionOffloadPlanView(QWidget):
    """Scenario, strategy and objective pickers, the plan's figures, Compare, the placement, and
    *Run on agents*: the plan's split (one compute agent, the others memory agents) on the
    connected agents, through the Run screen (live timeline, recorded like every run)."""

    run_requested = Signal()

    def __init__(self, state: StudioState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self.problem: OffloadProblem | None = None
        self.plan = None
        self.probe = AttentionProbe(self)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(16, 12, 16, 12)
        lay.addWidget(panel_header("Attention offloading (Lamina)",
                                   "Dense layers on compute devices; the KV cache and attention on memory devices, "
                                   "split by heads."))
        self.scenario = QComboBox()
        self.scenario.addItems([MEASURED, *SCENARIOS])
        self.scenario.setAccessibleName("Scenario")
        self.scenario.setItemData(0, "The connected agents as profiled (Profile cluster): their memory budgets, "
                                  "links and speeds, for the Run screen's checkpoint", Qt.ItemDataRole.ToolTipRole)
        for i, name in enumerate(SCENARIOS, start=1):
            self.scenario.setItemData(i, f"What-if: the {name} scenario's datasheet devices",
                                      Qt.ItemDataRole.ToolTipRole)
        self.scenario.setCurrentText("paper")
        self._source_picked = False
        """The operator picked a source: a profile arriving no longer switches to the measured cluster."""
        self.accelerators = QSpinBox()
        self.accelerators.setRange(1, 4)
        self.accelerators.setValue(2)
        self.accelerators.setAccessibleName("Accelerators")
        self.memory_devices = QSpinBox()
        self.memory_devices.setRange(1, 8)
        self.memory_devices.setValue(4)
        self.memory_devices.setAccessibleName("Memory devices")
        self.objective = QComboBox()
        self.objective.addItems(["throughput-per-dollar", "throughput"])
        self.objective.setAccessibleName("Objective")
        self.strategy = QComboBox()
        self.strategy.addItems(list(STRATEGIES))
        self.strategy.setAccessibleName("Strategy")
        self.controls = WrappingControls([(QLabel(label), w) for label, w in (
            ("Scenario", self.scenario), ("Accelerators", self.accelerators),
            ("Memory devices", self.memory_devices), ("Objective", self.objective), ("Strategy", self.strategy))])
        lay.addWidget(self.controls)
        self.scenario.activated.connect(self._on_scenario_activated)
        for w in (self.scenario, self.objective, self.strategy):
            w.currentTextChanged.connect(lambda _t: self.refresh())
        for w in (self.accelerators, self.memory_devices):
            w.valueChanged.connect(lambda _v: self.refresh())
        self.summary = QLabel("")
        self.summary.setAccessibleName("Plan summary")
        self.summary.setWordWrap(True)
        lay.addWidget(self.summary)
        self.message = InlineMessage()
        lay.addWidget(self.message)
        self.table = comparison_table(["strategy", "tokens/s", "tokens/s per k$", "price $", "batch", "status"])
        lay.addWidget(self.table)
        self.canvas = PlacementCanvas()
        lay.addWidget(borderless_scroll(self.canvas), 1)
        run_row = QHBoxLayout()
        self.run_button = QPushButton("Run on agents")
        self.run_button.setToolTip("Run this split on the connected agents: the first is the compute agent "
                                   "(dense layers, no KV), every other one a memory agent (KV and attention, "
                                   "split by heads); opens the Run screen with its live timeline, recorded")
        self.run_button.clicked.connect(self.run_on_agents)
        self.run_where = QLabel("")
        self.run_where.setAccessibleName("Run on agents")
        self.run_where.setWordWrap(True)
        run_row.addWidget(self.run_button)
        run_row.addWidget(self.run_where, 1)
        lay.addLayout(run_row)
        # a new profile, model or set of agents re-plans the measured cluster (and re-picks the agents)
        for signal in (state.agents_changed, state.offline_changed, state.model_changed, state.profile_changed):
            signal.connect(lambda _v: self._on_cluster_changed())
        self._use_measured_when_there()
        self.refresh()

    # the problem ----------------------------------------------------------------------
    def measured_available(self) -> str:
        """Why the measured cluster cannot be planned now ("" when it can)."""
        profile = self.state.profile
        if profile is None or profile.source != "measured":
            return "no measured profile: Profile cluster on the Profile screen (with agents connected)"
        if not self.state.model_path:
            return "no checkpoint chosen: pick the model on the Run screen"
        return ""

    def _use_measured_when_there(self) -> None:
        """Open on the measured cluster once there is one, unless the operator picked a source."""
        if not self._source_picked and not self.measured_available() and self.scenario.currentText() != MEASURED:
            self.scenario.setCurrentText(MEASURED)  # refreshes

    def _on_scenario_activated(self, _index: int) -> None:
        self._source_picked = True

    def pick_source(self, name: str) -> None:
        """What the operator's pick in the Scenario picker does: that source, kept when a profile arrives."""
        self._source_picked = True
        self.scenario.setCurrentText(name)

    def _on_cluster_changed(self) -> None:
        if self.scenario.currentText() == MEASURED:
            self.refresh()
        else:
            self._use_measured_when_there()
        self.update_run_controls()

    def is_measured(self) -> bool:
        return self.scenario.currentText() == MEASURED

    def refresh(self) -> None:
        measured = self.is_measured()
        for w in (self.accelerators, self.memory_devices):
            w.setEnabled(not measured)
        say_why_disabled({w: "the measured cluster has its own devices" for w in (self.accelerators,
                                                                                   self.memory_devices)})
        self.table.hide()
        if measured:
            why = self.measured_available()
            if why:
                self._no_plan(why, "Cannot plan the measured cluster:")
                return
            if self.objective.currentText() == "throughput-per-dollar":
                self.objective.setCurrentText("throughput")  # measured devices have no price (refreshes)
                return
            try:
                self.problem = measured_problem(self.state.profile, self.state.model_path, self._agent_names())
            except (EdgeShardError, OSError, ValueError) as err:  # a checkpoint it cannot read, a partial profile
                self._no_plan(str(err), "Cannot plan the measured cluster:")
                return
        else:
            make = SCENARIOS[self.scenario.currentText()]
            self.problem = make(self.accelerators.value(), self.memory_devices.value())
        self.show_strategy(self.strategy.currentText())

    def _no_plan(self, why: str, title: str) -> None:
        self.problem, self.plan = None, None
        self.message.show_lines([why], title)
        self.summary.setText("")
        self.canvas.show_rows([], "")
        self.update_run_controls()

    def show_strategy(self, name: str) -> None:
        if self.problem is None:
            return
        out = run_strategy(self.problem, name, self.objective.currentText())
        if out.plan is None:
            self.plan = None
            self.message.show_lines([out.error], f"{name} found no plan:")
            self.summary.setText("")
            self.canvas.show_rows([], "")
            self.update_run_controls()
            return
        self.message.show_lines([])
        self.plan, c = out.plan, out.cost
        shape = (f"batch {out.plan.batch} × {out.plan.in_flight} in flight, {out.plan.schedule} staggering"
                 if isinstance(out.plan, OffloadPlan) else f"{out.plan.kind}, batch {out.plan.batch}")
        priced = (f", {c.tokens_per_s_per_dollar * 1e3:.1f} tokens/s per k$ (devices ${c.price:,.0f})"
                  if c.price > 0 else "")
        self.summary.setText(
            f"{self.problem.name}. {name}: {c.tokens_per_s:,.0f} tokens/s{priced}, {shape}"
            + ("" if c.fits else " — does NOT fit in memory"))
        axis = ("layers 0 → L (dense) · key/value heads 0 → h_kv (KV)" if isinstance(out.plan, OffloadPlan)
                else "layers 0 → L")
        self.canvas.show_rows(placement_rows(self.problem, out.plan), axis)
        self.update_run_controls()

    # running on agents --------------------------------------------------------------
    def _agent_names(self) -> list[str]:
        agents = self.state.agents
        return [] if agents is None else [a for a in agents.endpoints if a not in self.state.offline_devices]

    def run_blocker(self) -> str:
        """Why *Run on agents* cannot start now ("" when it can): what the operator must do."""
        if self.state.agents is None:
            return "no agents connected: start the demo cluster or connect an agents.json (File menu)"
        if len(self._agent_names()) < 2:
            return "attention offloading needs two agents at least (one compute, one or more memory)"
        if not isinstance(self.plan, OffloadPlan):
            return "pick an attention-offload plan (strategy exact or lamina-rule), not a baseline"
        if not self.state.model_path:
            return "choose the model checkpoint on the Run screen (Browse…) first"
        try:
            self.agent_split()
        except EdgeShardError as err:  # no agent holds the dense part; a checkpoint it cannot read
            return str(err)
        return ""

    def agent_split(self) -> tuple[list[str], list[str]]:
        """(compute, memory) agents for the plan: the compute agent is the first connected agent whose
        profiled memory budget holds the whole dense part (an agent not profiled decides at load),
        with up to the plan's compute count of replicas (``choose_compute``); the others hold KV."""
        from core.techniques.attention_offload.run import agent_roles, choose_compute, dense_weight_bytes

        names = self._agent_names()
        if self.is_measured() and set(self.plan.compute) | set(self.plan.memory) <= set(names):
            return list(self.plan.compute), list(self.plan.memory)  # planned on these very agents
        profile = self.state.profile
        budgets = {d.id: d.memory_bytes for d in profile.cluster.devices} if profile is not None else {}
        dense, replicas = choose_compute(names, budgets, dense_weight_bytes(self.state.model_path),
                                         len(self.plan.compute))
        return agent_roles(dense, names, replicas)

    def update_run_controls(self) -> None:
        from core.techniques.attention_offload.run import dense_weight_bytes

        why = self.run_blocker()
        self.run_button.setEnabled(not why)
        say_why_disabled({self.run_button: why})
        if why:
            self.run_where.setText(why)
            return
        compute, memory = self.agent_split()
        replicas = len(compute)
        staggering = (f", {self.plan.schedule} staggering of {self.plan.in_flight} batches" if replicas > 1 else "")
        profile = self.state.profile
        profiled = profile is not None and set(compute) <= set(profile.cluster.device_ids())
        why = (f"; {' and '.join(compute)}: a profiled memory budget that holds the dense part "
               f"({dense_weight_bytes(self.state.model_path) / 2**20:.1f} MiB of weights)" if profiled else "")
        how = ("planned on the measured agents" if self.is_measured() else
               f"the scenario's {len(self.plan.compute)} compute / {len(self.plan.memory)} memory devices map onto "
               "the connected agents")
        self.run_where.setText(f"compute: {', '.join(compute)} · memory: {', '.join(memory)}{staggering} ({how}{why})")

    def run_on_agents(self) -> None:
        """Put the split of the connected agents in the studio state and ask for it to run; a measured
        plan's memory agents' attention is probed first (``gui.techniques.attention_probe``: the Run
        screen's predicted attention lanes are of these agents, which the profile never timed)."""
        why = self.run_blocker()
        self.message.show_lines([why] if why else [], "Cannot run on agents:")
        if why:
            return
        compute, memory = self.agent_split()

        def then(fit, why: str) -> None:  # a failed probe does not stop the run: its prediction says less
            self.message.show_lines([why, "The predicted attention lanes are the profile's KV reads only."] if why
                                    else [], "Could not measure the memory agents' attention:")
            self._run(compute, memory, fit)

        key = (Same(self.state.profile), self.state.model_path, tuple(compute), tuple(memory))
        if not self.is_measured():
            self._run(compute, memory, None)
        elif self.probe.measure_then(key, then, self.state.agents, self.problem, self.state.model_path, compute[0],
                                     memory):
            self.run_button.setEnabled(False)
            self.run_where.setText(f"measuring the attention of {', '.join(memory)} (a short probe run)…")

    def _run(self, compute: list[str], memory: list[str], fit) -> None:
        from core.techniques import technique_named

        self.update_run_controls()  # a probe disabled the button; the plan may have gone meanwhile
        if not self.run_button.isEnabled():
            return
        replicas = len(compute)
        # a plan of the measured cluster runs as planned: its batches in flight staggered even over one
        staggered = replicas > 1 or (self.is_measured() and self.plan.in_flight > 1)  # replica; a scenario's: not
        on_agents = OffloadPlan(compute=tuple(compute), memory=tuple(memory), batch=self.plan.batch,
                                in_flight=self.plan.in_flight if staggered else 1, schedule=self.plan.schedule)
        try:
            shard_plan = technique_named("attention-offload").run_plan(on_agents, self.state.model_path)
        except (ValueError, OSError) as err:  # a checkpoint it cannot read (CheckpointError): say so here
            self.message.show_lines([f"{type(err).__name__}: {err}"], "Cannot run on agents:")
            return
        from core.runs.prediction import PlanOrigin

        # the Run screen's ghosts: Lamina's staggered schedule of this plan, the memory agents' attention as
        problem = fit.onto(self.problem) if fit is not None else self.problem  # probed; a scenario's: none
        self.state.set_plan(shard_plan, origin=PlanOrigin(technique_named("attention-offload"), problem, on_agents)
                            if self.is_measured() else None)
        named = {"compute": list(compute), "memory": list(memory)} if self.is_measured() else {}
        self.state.propose_run_options({"compute_replicas": replicas, "schedule": self.plan.schedule, **named},
                                       on_agents.in_flight if staggered else 0)
        self.run_requested.emit()

    def auto_solve(self) -> None:
        self.strategy.setCurrentText("exact")
        self.show_strategy("exact")

    def compare(self) -> None:
        outs = [run_strategy(self.problem, n, self.objective.currentText()) for n in STRATEGIES]
        rows = []
        for o in outs:
            c = o.cost
            shape = "—" if o.plan is None else (f"{o.plan.batch} × {o.plan.in_flight} in flight"
                                                 if isinstance(o.plan, OffloadPlan)
                                                 else f"{o.plan.batch} × {o.plan.replicas} replica(s)")
            rows.append([o.strategy, f"{c.tokens_per_s:,.0f}" if c else "—",
                         f"{c.tokens_per_s_per_dollar * 1e3:.1f}" if c else "—", f"{c.price:,.0f}" if c else "—",
                         shape, o.status if not o.error else f"{o.status}: {o.error}"])
        fill_table(self.table, rows)
        self.table.show()
