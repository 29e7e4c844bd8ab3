"""EPD plugs in through the seam: listed, its strategies compared, its simulation the shared events."""

from __future__ import annotations

from core.models.units import ModelSpec
from core.techniques import technique_named
from tests.techniques.phase_disaggregation.conftest import image_heavy_problem


def test_epd_is_registered_for_llava_models_only():
    t = technique_named("phase-disaggregation")
    assert t.applies_to(ModelSpec(name="m", family="llava", dtype="fp32", units=()))
    assert not t.applies_to(ModelSpec(name="m", family="llama", dtype="fp32", units=()))
    assert t.strategy_names()[0] == "search"


def test_compare_lists_search_first_and_it_is_at_least_as_good(monkeypatch):
    t = technique_named("phase-disaggregation")
    outs = t.compare(image_heavy_problem(requests=30), "throughput", time_limit_s=5.0)
    assert [o.strategy for o in outs] == ["search", "aggregated", "pd-only"]
    assert all(o.status == "ok" for o in outs)
    assert outs[0].tokens_per_s >= max(o.tokens_per_s for o in outs[1:])


def test_simulate_gives_the_shared_timeline_for_a_plan():
    t = technique_named("phase-disaggregation")
    problem = image_heavy_problem(requests=10)
    plan = t.run_strategy(problem, "pd-only", "throughput").plan
    sim = t.simulate(problem, plan)
    assert sim.events and sim.figures.tokens == sum(r.output_tokens for r in problem.workload.requests)
