"""The paper's Algorithms 1 and 2 beside the exact solvers, on the faithful testbed and small instances."""

import msgspec
import pytest

from core.errors import ModelDoesNotFit
from core.planning.cost import evaluate
from core.planning.problem import Workload
from core.planning.scenarios import DeviceSpec, paper_problem, random_problem, synthetic_problem
from core.planning.solvers import paper_dp_latency, paper_dp_throughput, solve_max_throughput, solve_min_latency
from core.planning.solvers.comparison import run_strategy, shortfall_text

BATCH_1 = Workload(prompt_tokens=32, generated_tokens=96, batch_size=1)


def test_algorithm_1_is_never_better_than_the_exact_optimum_on_random_instances():
    for seed in range(12):
        problem = random_problem(seed, devices=4, units=8, tightness=2.0)
        plan = paper_dp_latency(problem)
        cost = evaluate(problem, plan)
        if cost.feasible:
            assert cost.latency_per_token_s >= solve_min_latency(problem).value * (1 - 1e-9)


def test_algorithm_1_on_the_paper_testbed_is_slower_than_the_optimum_and_says_by_how_much():
    problem = paper_problem("llama-2-7b")  # batch 8: the per-path memory check keeps the wrong path
    dp = run_strategy(problem, "paper-dp-latency", "latency")
    exact = run_strategy(problem, "edgeshard", "latency")
    assert dp.status == "ok" and dp.latency_s > exact.latency_s * 1.05
    assert shortfall_text(dp, exact).endswith("% slower than the optimum")


def test_algorithm_1_may_return_to_a_device_it_left_which_breaks_the_one_stage_per_device_rule():
    problem = msgspec.structs.replace(paper_problem("llama-2-70b"), workload=BATCH_1)
    plan = paper_dp_latency(problem)
    devices = plan.devices()
    assert len(devices) != len(set(devices))
    assert run_strategy(problem, "paper-dp-latency", "latency").status == "invalid"


def test_algorithm_2_returns_a_plan_within_memory_whose_bottleneck_is_no_worse_than_the_exact_plans():
    devices = [DeviceSpec(id=f"d{i}", tflops=10 + 5 * i, memory_bandwidth_gb_s=100 + 40 * i, memory_gib=6) for i in range(5)]
    problem = synthetic_problem(devices, "llama-2-7b", bandwidth_mbit_s=200,
                                workload=Workload(prompt_tokens=16, generated_tokens=16, batch_size=4))
    plan = paper_dp_throughput(problem)
    cost = evaluate(problem, plan)
    assert cost.feasible
    exact = solve_max_throughput(problem).plan
    ours = evaluate(problem, msgspec.structs.replace(exact, micro_batch_size=1, micro_batches=4))
    assert max(cost.stage_compute_s) <= max(ours.stage_compute_s) + 1e-9 or not ours.feasible


def test_algorithm_2_on_the_paper_testbed_falls_short_of_the_exact_throughput():
    problem = paper_problem("llama-2-7b")
    dp = run_strategy(problem, "paper-dp-throughput", "throughput")
    exact = run_strategy(problem, "edgeshard", "throughput")
    assert dp.status == "ok"
    assert dp.tokens_per_s < exact.tokens_per_s
    assert "fewer tokens/s than the optimum" in shortfall_text(dp, exact)


def test_algorithm_2_past_its_time_limit_raises_a_typed_error():
    from core.planning.solvers.paper_dp import PaperAlgorithmTimeout

    with pytest.raises(PaperAlgorithmTimeout, match="device subsets"):
        paper_dp_throughput(paper_problem("llama-2-13b"), time_limit_s=0.0)


def _published_recurrence(stage, occupancy, others, src, n):
    """Algorithm 2's table filled as the paper writes it: every set S in order, every last
    device k, every next device k' (the reference for the layered fill)."""
    import numpy as np

    dn = stage.shape[0]
    g = np.full((1 << len(others), dn, n + 1), np.inf, dtype=np.float32)
    g[0, src, :] = stage[src, 0, :]
    bits = {d: 1 << i for i, d in enumerate(others)}
    for mask in range(1 << len(others)):
        for k in [src] + [d for d in others if mask & bits[d]]:
            for k2 in [d for d in others if not mask & bits[d]]:
                for j in range(n):
                    if not np.isfinite(g[mask, k, j]):
                        continue
                    for i in range(j + 1, n + 1):
                        cand = max(float(g[mask, k, j]), occupancy[k, k2, j], stage[k2, j, i])
                        g[mask | bits[k2], k2, i] = min(g[mask | bits[k2], k2, i], np.float32(cand))
    return g


@pytest.mark.parametrize("seed", range(6))
def test_algorithm_2s_table_equals_the_published_recurrence_bit_for_bit(seed):
    import numpy as np

    from core.planning.solvers.arrays import build_arrays
    from core.planning.solvers.paper_dp import _fill_subset_dp

    problem = random_problem(seed, devices=5, units=7, tightness=1.5 + seed % 3)
    arr = build_arrays(problem, 1, problem.workload.batch_size)
    n, src = arr.n, arr.src
    others = [d for d in range(len(arr.devices)) if d != src]
    ends = np.arange(n + 1)
    stage = arr.prefix[:, None, :] - arr.prefix[:, :, None]
    stage = np.where((ends[None, None, :] > ends[None, :, None]) & (ends[None, None, :] <= arr.emax[:, :, None]),
                     stage, np.inf)
    g = np.full((1 << len(others), len(arr.devices), n + 1), np.inf, dtype=np.float32)
    g[0, src, :] = stage[src, 0, :]
    _fill_subset_dp(g, stage, arr.occupancy, others, {d: 1 << i for i, d in enumerate(others)}, n,
                    deadline=float("inf"), time_limit_s=60, chunk_bytes=64)  # tiny chunks: several per layer
    expected = _published_recurrence(stage, arr.occupancy, others, src, n)
    assert np.isfinite(expected[:, :, n]).any()
    np.testing.assert_array_equal(g, expected)


def _gui_measured_problem():
    """The GUI tests' measured problem (tests/gui/.../test_precision_view.measured_problem: int8 measured
    faster than fp at +0.5 % perplexity) under the 1 % quality bound its Compare tests set."""
    from core.models.weight_quality import PrecisionQuality
    from tests.gui.problems import make_problem

    p = make_problem()
    units = tuple(msgspec.structs.replace(u, linear_params=u.params, linear_rows=4096) if u.kind == "decoder_block"
                  else u for u in p.profile.model.units)
    quality = (PrecisionQuality(weights="fp", perplexity=20.0),
               PrecisionQuality(weights="int8", perplexity=20.1, decode_time_ratio=0.8),
               PrecisionQuality(weights="int4", perplexity=23.0, decode_time_ratio=1.5))
    profile = msgspec.structs.replace(p.profile, model=msgspec.structs.replace(p.profile.model, units=units),
                                      weight_quality=quality)
    return msgspec.structs.replace(p, profile=profile, max_perplexity_increase=0.01)


@pytest.mark.parametrize("objective", ["latency", "throughput"])
def test_algorithm_2_under_a_quality_bound_places_each_device_once_at_fp_on_the_gui_measured_problem(objective):
    problem = _gui_measured_problem()
    out = run_strategy(problem, "paper-dp-throughput", objective)
    assert out.status == "ok", out.error
    devices = out.plan.devices()
    assert len(devices) == len(set(devices)) and {s.weights for s in out.plan.stages} == {"fp"}
    unbounded = paper_dp_throughput(msgspec.structs.replace(problem, max_perplexity_increase=None))
    assert [(s.device, s.start, s.end) for s in out.plan.stages] == [(s.device, s.start, s.end) for s in unbounded.stages]


@pytest.mark.parametrize("seed", range(4))
def test_the_paper_algorithms_ignore_a_quality_bound_and_algorithm_2_never_repeats_a_device(seed):
    from tests.core.planning.test_precision_planning import _quantizable

    plain = random_problem(seed, devices=3, units=6, tightness=1.5)
    bounded = _quantizable(plain, bound=0.1)  # int8 and int4 admitted: each device would be three nodes
    unbounded = msgspec.structs.replace(bounded, max_perplexity_increase=None)
    for algorithm in (paper_dp_latency, paper_dp_throughput):
        try:
            expected = algorithm(unbounded)
        except ModelDoesNotFit:
            with pytest.raises(ModelDoesNotFit):
                algorithm(bounded)
            continue
        assert algorithm(bounded) == expected
    plan = paper_dp_throughput(bounded)
    assert len(plan.devices()) == len(set(plan.devices()))
