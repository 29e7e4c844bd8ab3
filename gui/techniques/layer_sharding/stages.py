"""Layer sharding's stage table: one row per stage with its device, units, compute and transfer
per token and memory against budget, and which stages a violation concerns (outlined on the
strip); mixed into the plan editor, which owns the table."""

from __future__ import annotations

import math

from PySide6.QtGui import QColor
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QProgressBar, QTableWidgetItem, QWidget

from core.planning.cost import PlanCost, format_bytes
from core.planning.edits import set_stage_torch_device
from core.planning.placement import profiled_gpus, unprofiled_gpus
from core.planning.plan import ShardPlan, offline_problems
from gui.app import stage_color, theme_colors

STAGE_COLUMNS = ["Stage", "Device", "Units", "Count", "Compute", "Send", "Memory / budget"]
"""Short headers (their tooltips say more): at 1024x700 the memory column must stay on screen."""
STAGE_COLUMN_TIPS = {4: "Compute per generated token (◀: the bottleneck stage)",
                     5: "Sending this stage's output per generated token", 6: "Memory this stage needs / its device's budget"}
MEMORY_COLUMN_PADDING = 24
"""Pixels beside the widest memory bar's text (the bar's frame and margins)."""


def fmt_s(seconds: float) -> str:
    if math.isinf(seconds) or math.isnan(seconds):
        return "∞"
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


class StageTable:
    """The plan editor's stage table, filled from the plan and its cost."""

    def _plan_problems(self, plan: ShardPlan, cost: PlanCost) -> list[str]:
        """Why the plan cannot run as it is: its cost's violations, offline devices, GPUs not profiled."""
        return [*cost.violations, *offline_problems(plan, self.state.offline_devices),
                *(unprofiled_gpus(self.state.problem, plan) if self.state.problem is not None else ())]

    def _bad_stages(self, plan: ShardPlan | None, cost: PlanCost | None) -> set[int]:
        if plan is None or cost is None:
            return set()
        bad = {j for j, m in enumerate(cost.memory) if not m.fits}
        for v in self._plan_problems(plan, cost):
            for j, st in enumerate(plan.stages):
                if f"stage {j} " in v or f"stage {j}:" in v or (j == 0 and v.startswith("stage 0 runs")):
                    bad.add(j)
        return bad

    def _fill_stage_table(self, problem, plan, cost) -> None:
        t = self.stage_table
        selected = t.currentRow()
        t.setRowCount(0)
        if plan is None or problem is None:
            return
        ids = problem.profile.cluster.device_ids()
        t.setRowCount(len(plan.stages))
        c = theme_colors()
        for j, st in enumerate(plan.stages):
            swatch = QTableWidgetItem(f"  {j}")
            swatch.setBackground(stage_color(j))
            swatch.setForeground(QColor("#ffffff"))
            t.setItem(j, 0, swatch)
            combo = QComboBox()
            combo.setAccessibleName(f"Device of stage {j}")
            combo.setToolTip("Run this stage on another device (a device used elsewhere swaps places)")
            for d in ids:
                combo.addItem(d, d)
            if st.device not in ids:
                combo.addItem(f"{st.device} (unknown)", st.device)
            combo.setCurrentIndex(combo.findData(st.device))
            combo.currentIndexChanged.connect(lambda _i, j=j, combo=combo: self.set_stage_device(j, combo.currentData()))
            t.setCellWidget(j, 1, self._with_compute_choice(problem, j, st, combo))
            units = QTableWidgetItem(f"[{st.start}, {st.end})" + ("" if st.weights == "fp" else f"  {st.weights}")
                                     + ("" if st.torch_device == "cpu" else f"  {st.torch_device}"))
            units.setToolTip(f"weights at {'the model dtype' if st.weights == 'fp' else st.weights} (weight-only), "
                             f"computed on {'the CPU' if st.torch_device == 'cpu' else 'the GPU ' + st.torch_device}")
            t.setItem(j, 2, units)
            t.setItem(j, 3, QTableWidgetItem(str(st.num_units)))
            comp = cost.stage_compute_s[j] if cost and j < len(cost.stage_compute_s) else math.inf
            xfer = cost.stage_transfer_s[j] if cost and j < len(cost.stage_transfer_s) else math.inf
            ci = QTableWidgetItem(fmt_s(comp))
            if cost and cost.stage_compute_s and j == cost.bottleneck_stage and len(plan.stages) > 1:
                ci.setText(fmt_s(comp) + " ◀")  # short: the memory column stays on a 1024 px screen
                ci.setToolTip("the bottleneck stage: the slowest, it sets the pipeline's throughput")
            t.setItem(j, 4, ci)
            t.setItem(j, 5, QTableWidgetItem(fmt_s(xfer)))
            mem = cost.memory[j] if cost and j < len(cost.memory) else None
            bar = QProgressBar()
            bar.setAccessibleName(f"Memory of stage {j}")
            if mem is not None:
                frac = mem.total_bytes / max(1, mem.budget_bytes)
                bar.setRange(0, 1000)
                bar.setValue(min(1000, int(frac * 1000)))
                bar.setFormat(f"{format_bytes(mem.total_bytes)} / {format_bytes(mem.budget_bytes)}  ({frac * 100:.0f} %)")
                bar.setToolTip(
                    f"weights {format_bytes(mem.weights_bytes)}, KV cache {format_bytes(mem.kv_cache_bytes)}, "
                    f"workspace {format_bytes(mem.workspace_bytes)}; budget {format_bytes(mem.budget_bytes)}"
                )
                if not mem.fits:
                    bar.setStyleSheet(f"QProgressBar::chunk {{ background: {c['error']}; }}")
            else:
                bar.setRange(0, 1)
                bar.setValue(0)
                bar.setFormat("—")
            t.setCellWidget(j, 6, bar)
        texts = [t.cellWidget(j, 6).text() for j in range(t.rowCount())] + [STAGE_COLUMNS[6]]
        t.horizontalHeader().resizeSection(6, max(t.fontMetrics().horizontalAdvance(x) for x in texts)
                                           + MEMORY_COLUMN_PADDING)
        if 0 <= selected < len(plan.stages):
            t.selectRow(selected)
        self._fit_stage_table()

    def set_stage_torch_device(self, stage: int, torch_device: str) -> None:
        """Compute ``stage`` on its device's CPU or one of its GPUs (undoable, through the editor's ``_edit``)."""
        self._edit(set_stage_torch_device, f"Compute stage {stage} on {torch_device}", stage, torch_device)

    def _with_compute_choice(self, problem, j: int, st, device_combo: QComboBox) -> QWidget:
        """The device combo, and beside it where that device computes the stage (its CPU or one of the
        GPUs its agent reported and the profile timed) when it has a GPU or the plan names one."""
        gpus = profiled_gpus(problem, st.device)
        if not gpus and st.torch_device == "cpu":
            return device_combo
        where = QComboBox()
        where.setAccessibleName(f"Compute of stage {j}")
        where.setToolTip("Where this device computes the stage: its CPU or one of its GPUs (the profile's times "
                         "and memory of that GPU; the predicted cost follows)")
        for name in ("cpu", *gpus):
            where.addItem(name, name)
        if where.findData(st.torch_device) < 0:
            where.addItem(f"{st.torch_device} (not profiled)", st.torch_device)
        where.setCurrentIndex(where.findData(st.torch_device))
        where.currentIndexChanged.connect(lambda _i, j=j, where=where: self.set_stage_torch_device(j, where.currentData()))
        cell = QWidget()
        row = QHBoxLayout(cell)
        row.setContentsMargins(0, 0, 0, 0)
        row.setSpacing(2)
        row.addWidget(device_combo, 1)
        row.addWidget(where)
        return cell

    def _fit_stage_table(self) -> None:
        """The table as tall as its rows (up to 8), so the comparison below gets the rest."""
        t = self.stage_table
        rows = min(max(1, t.rowCount()), 8)
        row_h = t.verticalHeader().defaultSectionSize()
        bar = t.horizontalScrollBar()  # a narrow window scrolls the columns: the bar must not hide a row
        bar_h = bar.sizeHint().height() if bar.maximum() > 0 else 0
        t.setFixedHeight(t.horizontalHeader().height() + rows * row_h + 2 * t.frameWidth() + 2 + bar_h)
