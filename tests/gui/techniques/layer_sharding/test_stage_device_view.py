"""Where each stage computes, in the studio: on a profile whose devices have a fast GPU, the plan
editor's stage rows, Compare's names and the Profile screen name each GPU stage's torch device beside its
precision (a CPU stage's row stays as it was)."""

from __future__ import annotations

import msgspec

from core.planning.solvers.comparison import compare
from gui.screens.profile import ProfilePanel
from gui.studio_state import StudioState
from tests.core.planning.test_gpu_placement import with_gpus
from tests.gui.techniques.layer_sharding.test_precision_view import editor, measured_problem  # noqa: F401


def gpu_problem():
    """The GUI tests' measured problem with every device's GPU 5x its CPU and roomy, under a 1 % bound."""
    p = measured_problem()
    p = with_gpus(p, {d: (0.2, 1 << 40) for d in p.profile.cluster.device_ids()})
    return msgspec.structs.replace(p, max_perplexity_increase=0.01)


def test_stage_rows_and_compare_name_each_gpu_stages_device_and_precision(editor):  # noqa: F811
    problem = gpu_problem()
    editor.state.set_problem(problem)
    editor.show_comparison(compare(problem, "latency"))
    name = editor.compare_table.item(0, 0).text()
    editor.adopt(0)
    plan = editor.state.plan
    assert any(s.torch_device == "cuda:0" for s in plan.stages)
    units = [editor.stage_table.item(j, 2).text() for j in range(editor.stage_table.rowCount())]
    assert units == [f"[{s.start}, {s.end})" + ("" if s.weights == "fp" else f"  {s.weights}")
                     + ("" if s.torch_device == "cpu" else f"  {s.torch_device}") for s in plan.stages]
    assert name.startswith("edgeshard (") and "cuda:0" in name


def test_the_profile_screen_names_each_stages_device_beside_its_precision(qtbot):
    state = StudioState()
    panel = ProfilePanel(state)
    qtbot.addWidget(panel)
    problem = gpu_problem()
    state.set_profile(problem.profile)
    state.set_problem(problem)
    plan = compare(problem, "latency")[0].plan
    state.set_plan(plan)
    text = panel.precision_label.text()
    assert all(f"{s.device} {s.weights} on {s.torch_device}" in text for s in plan.stages)
    assert "on cuda:0" in text
    assert "GPUs: " + ", ".join(f"{d} cuda:0 1024.0 GiB" for d in problem.profile.cluster.device_ids()) in text


def test_the_profile_screen_names_each_devices_own_quantized_block_time(qtbot):
    from core.models.weight_quality import DevicePrecisionTimes

    state = StudioState()
    panel = ProfilePanel(state)
    qtbot.addWidget(panel)
    problem = measured_problem()
    d = problem.profile.cluster.device_ids()[0]
    own = (DevicePrecisionTimes(device=d, weights="int8", decode_time_ratio=0.92, prefill_time_ratio=1.1),)
    state.set_profile(msgspec.structs.replace(problem.profile, precision_times=own))
    assert f"on each device: {d} int8 0.92×" in panel.precision_label.text()
