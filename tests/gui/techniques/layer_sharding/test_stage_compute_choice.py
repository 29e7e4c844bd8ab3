"""The plan editor lets the operator pick where a stage computes, among what its device's agent reported and
the profile timed (cpu, cuda:0, cuda:1): the predicted cost follows at once (evaluate of the edited
plan), the edit is undoable, a GPU the profile lacks is a violation naming the choices, and a device
without a GPU shows its device combo alone (the demo's rows as they were). The profile's two GPUs are
built by hand (tests/core/planning/test_every_gpu_placement.py); tests/core/devices/test_every_gpu_profiled.py
profiles them through the ``CudaBackend`` seam on real agents."""

from __future__ import annotations

import msgspec
from PySide6.QtWidgets import QComboBox

from core.planning.cost import evaluate
from core.planning.solvers import edgeshard_optimal
from gui.techniques.layer_sharding.stages import fmt_s
from tests.core.planning.test_every_gpu_placement import with_two_gpus
from tests.gui.techniques.layer_sharding.test_precision_view import editor, measured_problem  # noqa: F401


def compute_combo(editor, j: int) -> QComboBox | None:  # noqa: F811
    cell = editor.stage_table.cellWidget(j, 1)
    return next((c for c in cell.findChildren(QComboBox) if c.accessibleName() == f"Compute of stage {j}"), None)


def two_gpu_problem():
    p = measured_problem()
    gpu_box = p.profile.cluster.device_ids()[0]
    return with_two_gpus(p, {gpu_box: ((0.5, 1 << 40), (0.1, 1 << 40))}), gpu_box


def test_picking_a_stages_gpu_updates_the_predicted_cost_and_undoes(editor):  # noqa: F811
    problem, gpu_box = two_gpu_problem()
    editor.state.set_problem(problem)
    plan = msgspec.structs.replace(edgeshard_optimal(problem, "latency"), strategy="manual")
    plan = msgspec.structs.replace(plan, stages=tuple(msgspec.structs.replace(s, torch_device="cpu")
                                                      for s in plan.stages))
    editor.push_plan(plan, "all on the CPU")
    j = next(i for i, s in enumerate(plan.stages) if s.device == gpu_box)
    combo = compute_combo(editor, j)
    assert [combo.itemText(i) for i in range(combo.count())] == ["cpu", "cuda:0", "cuda:1"]
    assert all(compute_combo(editor, i) is None for i in range(len(plan.stages)) if i != j)
    on_cpu = editor.cost.latency_per_token_s
    for gpu in ("cuda:0", "cuda:1"):
        compute_combo(editor, j).setCurrentIndex(compute_combo(editor, j).findData(gpu))
        assert editor.own_plan.stages[j].torch_device == gpu
        assert editor.cost == evaluate(problem, editor.own_plan)  # the live prediction is the edited plan's
        assert editor.latency_card.text() == fmt_s(editor.cost.latency_per_token_s)
    assert editor.cost.latency_per_token_s < on_cpu  # cuda:1 is 10x the CPU for that stage
    assert editor.status_card.text() == "all satisfied"
    editor.undo_stack.undo()
    assert editor.own_plan.stages[j].torch_device == "cuda:0" and compute_combo(editor, j).currentText() == "cuda:0"


def test_a_gpu_the_profile_lacks_is_shown_as_a_violation_with_the_choices(editor):  # noqa: F811
    problem, gpu_box = two_gpu_problem()
    editor.state.set_problem(problem)
    plan = edgeshard_optimal(problem, "latency")
    j = next(i for i, s in enumerate(plan.stages) if s.device == gpu_box)
    stages = list(plan.stages)
    stages[j] = msgspec.structs.replace(stages[j], torch_device="cuda:7")
    editor.push_plan(msgspec.structs.replace(plan, stages=tuple(stages)), "a plan from elsewhere")
    assert compute_combo(editor, j).currentText() == "cuda:7 (not profiled)"
    assert editor.status_card.text() == "1 violated"
    assert f"stage {j} ({gpu_box}) computes on cuda:7" in editor.violations.text()
    assert "pick cpu, cuda:0, cuda:1" in editor.violations.text()
