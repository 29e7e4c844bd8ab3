"""Weight precision in the studio: the quality bound is a constraint of the plan editor, Compare puts the
fp-only optimum beside the precision-aware one, stage rows and the Profile screen name each precision."""

from __future__ import annotations

import msgspec
import pytest

from core.models.weight_quality import PrecisionQuality
from core.planning.solvers.comparison import compare
from gui.screens.profile import ProfilePanel
from gui.studio_state import StudioState
from gui.techniques.layer_sharding.editor import PlanEditorPanel
from tests.gui.problems import make_problem

QUALITY = (PrecisionQuality(weights="fp", perplexity=20.0),
           PrecisionQuality(weights="int8", perplexity=20.1, decode_time_ratio=0.8),
           PrecisionQuality(weights="int4", perplexity=23.0, decode_time_ratio=1.5))


def measured_problem():
    """The GUI tests' problem with quantizable blocks and int8 measured faster than fp (+0.5 % perplexity)."""
    p = make_problem()
    model = p.profile.model
    units = tuple(msgspec.structs.replace(u, linear_params=u.params, linear_rows=4096) if u.kind == "decoder_block"
                  else u for u in model.units)
    profile = msgspec.structs.replace(p.profile, model=msgspec.structs.replace(model, units=units),
                                      weight_quality=QUALITY)
    return msgspec.structs.replace(p, profile=profile)


@pytest.fixture
def editor(qtbot):
    state = StudioState()
    panel = PlanEditorPanel(state)
    qtbot.addWidget(panel)
    yield panel
    panel.shutdown()


def test_the_quality_bound_is_a_constraint_and_compare_shows_the_fp_only_optimum_beside_it(editor):
    editor.state.set_problem(measured_problem())
    assert editor.quality_spin.isEnabled() and editor.state.problem.max_perplexity_increase is None
    editor.quality_spin.setValue(1.0)
    assert editor.state.problem.max_perplexity_increase == pytest.approx(0.01)
    editor.show_comparison(compare(editor.state.problem, "latency"))
    names = [editor.compare_table.item(i, 0).text() for i in range(editor.compare_table.rowCount())]
    assert names[0].startswith("edgeshard (int8 on ") and names[1].startswith("edgeshard-fp —")
    editor.adopt(0)
    units = [editor.stage_table.item(j, 2).text() for j in range(editor.stage_table.rowCount())]
    plan = editor.state.plan
    assert units == [f"[{s.start}, {s.end})" + ("" if s.weights == "fp" else f"  {s.weights}") for s in plan.stages]
    assert "  int8" in units[-1]  # the blocks' stage; the embedding alone has nothing to quantize


def test_the_profile_screen_names_each_stages_precision_and_what_each_was_measured_to_cost(qtbot):
    state = StudioState()
    panel = ProfilePanel(state)
    qtbot.addWidget(panel)
    problem = measured_problem()
    state.set_profile(problem.profile)
    state.set_problem(problem)
    state.set_plan(compare(msgspec.structs.replace(problem, max_perplexity_increase=0.01), "latency")[0].plan)
    text = panel.precision_label.text()
    assert "Weights per stage: " in text and " int8" in text
    assert "int8 +0.50 % perplexity, 0.80× decode time; int4 +15.00 % perplexity" in text
