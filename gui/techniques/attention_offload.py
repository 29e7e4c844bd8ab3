"""Attention offloading's plan view: which device holds the dense layers, which holds which heads' KV.

The attention-offload technique's face on the Plan screen (gui.techniques). A scenario (the
paper's H100 + H20 pairing, or an edge lab) gives the problem; a strategy gives the plan
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
from core.techniques.attention_offload.problem import OffloadPlan, OffloadProblem
from core.techniques.attention_offload.scenarios import SCENARIOS
from gui.app import stage_color
from gui.studio_state import StudioState
from gui.widgets import InlineMessage, borderless_scroll, comparison_table, fill_table, panel_header, say_why_disabled

STRATEGIES = ("exact", "lamina-rule", "homogeneous", "layer-sharding")
GIB = 2**30


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
                                             f"{cost.compute_bytes / GIB:.1f}/{cap / GIB:.1f} GiB")
        for d, heads in plan.kv_heads_of(m.kv_heads).items():
            cap = problem.device(d).memory_bytes
            g = m.q_heads // m.kv_heads
            used = plan.in_flight * plan.batch * problem.workload.context_tokens * m.kv_bytes_per_token() \
                * len(heads) / m.kv_heads
            rows[d] = (d, "kv", heads.start / m.kv_heads, heads.stop / m.kv_heads,
                       f"KV + attention of kv heads {heads.start}–{heads.stop - 1} (q heads {heads.start * g}–"
                       f"{heads.stop * g - 1}), all layers · {used / GIB:.1f}/{cap / GIB:.1f} GiB")
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

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Attention offloading", parent)
        self.setAccessibleName("Attention offloading run options")
        self.replicas = QSpinBox()
        self.replicas.setRange(1, 1)
        self.replicas.setAccessibleName("Compute replicas")
        self.replicas.setToolTip("Compute agents that each hold the whole dense part; more than one runs "
                                 "Lamina's staggered pipelining over the micro-batches (the rest of the "
                                 "connected agents are memory agents: KV cache and attention, split by heads)")
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
        self.replicas.valueChanged.connect(self._on_changed)
        self.schedule.currentTextChanged.connect(self._on_changed)
        self.hide()

    def show_for(self, plan, agents: list[str]) -> None:
        """Show the options when ``plan`` is an attention-offload dense plan (else hide them)."""
        from core.techniques.attention_offload import DENSE_KIND

        stages = getattr(plan, "stages", ())
        if len(stages) != 1 or stages[0].kind != DENSE_KIND:
            self.hide()
            return
        self._dense, self._agents = stages[0].device, list(agents)
        self.replicas.setMaximum(max(1, len([a for a in agents if a != self._dense]) - 1))
        self.show()
        self._update_roles()

    def options(self) -> dict:
        return {"compute_replicas": self.replicas.value(), "schedule": self.schedule.currentText()}

    def apply(self, options: dict) -> None:
        if "compute_replicas" in options:
            self.replicas.setValue(int(options["compute_replicas"]))
        if options.get("schedule") in ("rotational", "fixed"):
            self.schedule.setCurrentText(options["schedule"])

    def lane_notes(self) -> dict[str, str]:
        """Device -> its role in the run these options give (the timeline's lane notes)."""
        from core.techniques.attention_offload.run import lane_roles

        return lane_roles(self._dense, self._agents or [self._dense], self.replicas.value())

    def _on_changed(self, *_args) -> None:
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
        lay = QVBoxLayout(self)
        lay.setContentsMargins(16, 12, 16, 12)
        lay.addWidget(panel_header("Attention offloading (Lamina)",
                                   "Dense layers on compute devices, the KV cache and attention on memory devices, "
                                   "split by heads; per token and layer only q, k, v and the output cross."))
        self.scenario = QComboBox()
        self.scenario.addItems(list(SCENARIOS))
        self.scenario.setAccessibleName("Scenario")
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
        state.agents_changed.connect(lambda _a: self.update_run_controls())
        state.offline_changed.connect(lambda _o: self.update_run_controls())
        state.model_changed.connect(lambda _m: self.update_run_controls())
        state.profile_changed.connect(lambda _p: self.update_run_controls())  # the profiled budgets pick the compute agent
        self.refresh()

    def refresh(self) -> None:
        make = SCENARIOS[self.scenario.currentText()]
        self.problem = make(self.accelerators.value(), self.memory_devices.value())
        self.table.hide()
        self.show_strategy(self.strategy.currentText())

    def show_strategy(self, name: str) -> None:
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
        self.summary.setText(
            f"{self.problem.name}. {name}: {c.tokens_per_s:,.0f} tokens/s, {c.tokens_per_s_per_dollar * 1e3:.1f} "
            f"tokens/s per k$ (devices ${c.price:,.0f}), {shape}"
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
        self.run_where.setText(f"compute: {', '.join(compute)} · memory: {', '.join(memory)}"
                               f"{staggering} (the scenario's {len(self.plan.compute)} compute / "
                               f"{len(self.plan.memory)} memory devices map onto the connected agents{why})")

    def run_on_agents(self) -> None:
        """Put the split of the connected agents in the studio state and ask for it to run."""
        why = self.run_blocker()
        if why:
            self.message.show_lines([why], "Cannot run on agents:")
            return
        from core.techniques import technique_named

        compute, memory = self.agent_split()
        replicas = len(compute)
        on_agents = OffloadPlan(compute=tuple(compute), memory=tuple(memory), batch=self.plan.batch,
                                in_flight=self.plan.in_flight if replicas > 1 else 1, schedule=self.plan.schedule)
        try:
            shard_plan = technique_named("attention-offload").run_plan(on_agents, self.state.model_path)
        except (ValueError, OSError) as err:  # a checkpoint it cannot read (CheckpointError): say so here
            self.message.show_lines([f"{type(err).__name__}: {err}"], "Cannot run on agents:")
            return
        self.message.show_lines([])
        self.state.set_plan(shard_plan)
        self.state.propose_run_options({"compute_replicas": replicas, "schedule": self.plan.schedule},
                                       on_agents.in_flight if replicas > 1 else 0)
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
