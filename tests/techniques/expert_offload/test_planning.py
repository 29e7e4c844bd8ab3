"""EdgeMoE's planner, cost model and simulator (core.techniques.expert_offload)."""

from __future__ import annotations

import itertools

import pytest

from core.errors import EdgeShardError, FormatError
from core.techniques import technique_named
from core.techniques.expert_offload.cost import evaluate
from core.techniques.expert_offload.problem import FULL_PRECISION, MoeModel, OffloadPlan, OffloadProblem
from core.techniques.expert_offload.scenarios import ASSUMED_BIT_OPTIONS, paper_shaped
from core.techniques.expert_offload.strategies import MAX_PRELOAD, run_strategy, slots_that_fit

MODEL = MoeModel(name="m", layers=4, experts=8, top_k=2, expert_bytes=1_000_000, resident_bytes=2_000_000,
                 layer_compute_s=0.002, expert_compute_s=0.001, head_s=0.001)


def problem(budget_fraction=0.5, recall=0.6, bound=0.05, bandwidth=100e6) -> OffloadProblem:
    full = MODEL.resident_bytes + MODEL.layers * MODEL.experts * MODEL.expert_bytes
    return OffloadProblem(model=MODEL, memory_budget_bytes=int(budget_fraction * full), bandwidth_bps=bandwidth,
                          predictor_recall=recall, accuracy_bound=bound, bit_options=ASSUMED_BIT_OPTIONS)


def test_the_technique_is_registered_for_moe_models_only():
    t = technique_named("expert-offload")
    assert t.stage_kinds == ("expert-offload",) and t.strategy_names()[0] == "edgemoe"
    assert set(t.strategies) == {"edgemoe", "io-free", "io-exp", "io-qexp", "sti"}


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_edgemoe_plan_is_the_fastest_fitting_plan_within_the_accuracy_bound(fraction):
    p = problem(fraction)
    best = run_strategy(p, "edgemoe")
    brute = []
    for bits, slots, preload, policy in itertools.product(
            ASSUMED_BIT_OPTIONS, range(1, MODEL.layers * MODEL.experts + 1), range(MAX_PRELOAD + 1), ("edgemoe", "lru")):
        plan = OffloadPlan(device="device", slots=slots, bits=bits, preload=preload, policy=policy)
        c = evaluate(p, plan)
        if c.fits and c.accuracy_loss <= p.accuracy_bound:
            brute.append(c.latency_per_token_s)
    assert best.status == "optimal" and best.cost.fits
    assert best.latency_s == pytest.approx(min(brute))


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_edgemoe_beats_io_exp_and_sti_at_the_same_budget(fraction):
    p = problem(fraction)
    edge = run_strategy(p, "edgemoe").latency_s
    assert edge < run_strategy(p, "io-exp").latency_s
    sti = run_strategy(p, "sti")
    assert sti.status == "failed" or edge < sti.latency_s


def test_io_free_is_out_of_memory_below_the_whole_model():
    out = run_strategy(problem(0.5), "io-free")
    assert out.status == "oom" and not out.cost.fits


def test_a_tighter_accuracy_bound_keeps_experts_at_higher_precision():
    loose = run_strategy(problem(0.25, bound=0.05), "edgemoe").plan.bits.avg_bits
    tight = run_strategy(problem(0.25, bound=0.0), "edgemoe").plan.bits
    assert tight == FULL_PRECISION and loose < 32


def test_preloading_helps_only_with_a_predictor_that_recalls():
    assert evaluate(problem(recall=0.0), OffloadPlan(device="d", slots=8, preload=2)).latency_per_token_s == \
        evaluate(problem(recall=0.0), OffloadPlan(device="d", slots=8, preload=0)).latency_per_token_s
    assert evaluate(problem(recall=0.8), OffloadPlan(device="d", slots=8, preload=2)).latency_per_token_s < \
        evaluate(problem(recall=0.8), OffloadPlan(device="d", slots=8, preload=0)).latency_per_token_s


def test_a_budget_below_the_resident_weights_fails_naming_what_to_do():
    p = OffloadProblem(model=MODEL, memory_budget_bytes=MODEL.resident_bytes, bandwidth_bps=1e8)
    with pytest.raises(EdgeShardError, match="more memory"):
        slots_that_fit(p, FULL_PRECISION)
    out = run_strategy(p, "io-exp")
    assert out.status == "failed" and "more memory" in out.error


@pytest.mark.parametrize("change, words", [
    (dict(bandwidth_bps=0), "bandwidth"), (dict(predictor_recall=1.5), "recall"), (dict(memory_budget_bytes=0), "budget"),
])
def test_bad_problems_are_refused_naming_the_field(change, words):
    values = dict(model=MODEL, memory_budget_bytes=10**8, bandwidth_bps=1e8)
    values.update(change)
    with pytest.raises(FormatError, match=words):
        OffloadProblem(**values)


@pytest.mark.parametrize("strategy", ["edgemoe", "io-exp", "sti"])
def test_the_simulated_per_token_latency_is_the_cost_models(strategy):
    p = paper_shaped(0.5)
    out = run_strategy(p, strategy)
    if out.status == "failed":
        pytest.skip(out.error)
    sim = technique_named("expert-offload").simulate(p, out.plan, generated_tokens=6)
    # decode steps after the first (that one overlaps reads with the costlier prefill)
    times = [t.t_s for t in sim.tokens]
    assert [b - a for a, b in zip(times[1:], times[2:])] == pytest.approx([out.latency_s] * 4, rel=1e-6)


def test_the_simulation_puts_expert_reads_on_a_storage_lane_overlapping_compute():
    p = problem(0.5, recall=0.6)
    plan = OffloadPlan(device="dev", slots=8, preload=2)
    events = technique_named("expert-offload").simulate(p, plan, generated_tokens=3).events
    reads = [e for e in events if e.device == "dev:storage"]
    computes = [e for e in events if e.device == "dev" and e.kind == "compute"]
    assert reads and all(e.kind == "io" and e.peer == "storage" and e.nbytes > 0 for e in reads)
    assert any(r.start_s < c.end_s and c.start_s < r.end_s for r in reads for c in computes)  # preloads overlap


def test_adaptation_lowers_the_most_experts_the_bound_allows_least_important_first():
    from core.techniques.expert_offload.adaptation import adapt_bit_widths, average_bits

    importance = {(0, e): float(e) for e in range(8)}  # expert e costs e when alone at INT2
    measure = lambda bits: sum(importance[k] for k, b in bits.items() if b == 2) / 100  # noqa: E731
    bits, loss, k = adapt_bit_widths(importance, measure, bound=0.06)
    assert k == 4 and loss == pytest.approx(0.06)  # 0+1+2+3 = 6 %, adding expert 4 would be 10 %
    assert {key for key, b in bits.items() if b == 2} == {(0, 0), (0, 1), (0, 2), (0, 3)}
    assert average_bits(bits, 8) == 3.0
