import math
import random

import msgspec
import pytest

from core.devices.cluster import Cluster, Device, Link
from core.planning.cost import evaluate, link_occupancy_s, transfer_s, validate
from core.models.units import ModelSpec, ModelUnit
from core.planning.plan import Stage, ShardPlan, plan_from_boundaries
from core.planning.problem import PlanningProblem, Workload
from core.devices.profile import DeviceTimes, Profile
from core.planning.scenarios import random_problem
from core.planning.solvers.arrays import build_arrays
from core.planning.solvers.exact import sequence_terms


def _problem(batch=2, headroom=0.0):
    units = (
        ModelUnit(index=0, kind="embedding", name="embed", param_bytes=100, activation_bytes_per_token=1000,
                  workspace_bytes_per_token=10),
        ModelUnit(index=1, kind="decoder_block", name="block 0", param_bytes=300, activation_bytes_per_token=1000,
                  kv_bytes_per_token=2, workspace_bytes_per_token=30),
        ModelUnit(index=2, kind="head", name="head", param_bytes=200, activation_bytes_per_token=4,
                  workspace_bytes_per_token=50),
    )
    model = ModelSpec(name="toy", family="llama", dtype="fp16", units=units)
    cluster = Cluster(
        devices=(Device(id="a", memory_bytes=10_000), Device(id="b", memory_bytes=10_000)),
        links=(Link(src="a", dst="b", bandwidth_mbit_s=8.0, latency_ms=2.0),
               Link(src="b", dst="a", bandwidth_mbit_s=0.8, latency_ms=5.0)),
    )

    def times(dev, scale):
        return DeviceTimes(device=dev, decode_batch_sizes=(1, 2), decode_s=tuple((scale * (u + 1), scale * (u + 1) * 1.5) for u in range(3)),
                           prefill_token_counts=(4, 8), prefill_s=tuple((scale * 10 * (u + 1), scale * 20 * (u + 1)) for u in range(3)))

    profile = Profile(model=model, cluster=cluster, times=(times("a", 0.01), times("b", 0.001)))
    return PlanningProblem(profile=profile, source="a", memory_headroom=headroom,
                           workload=Workload(prompt_tokens=4, generated_tokens=6, batch_size=batch))


def _plan(m=2, k=1):
    return ShardPlan(model="toy", num_units=3, stages=(Stage(device="a", start=0, end=1), Stage(device="b", start=1, end=3)),
                     micro_batch_size=m, micro_batches=k)


def test_latency_is_compute_plus_transfers_plus_token_ids_back_to_the_source():
    cost = evaluate(_problem(), _plan(m=2))
    compute = 0.01 * 1.5 + 0.001 * (2 + 3) * 1.5  # decode at batch 2
    to_b = 1000 * 2 * 8 / 8e6 + 0.002
    back = 4 * 2 * 8 / 0.8e6 + 0.005
    assert cost.latency_per_token_s == pytest.approx(compute + to_b + back)
    assert cost.stage_transfer_s == pytest.approx((to_b, back))


def test_prefill_sends_prompt_sized_activations_but_returns_only_token_ids():
    cost = evaluate(_problem(), _plan(m=2))
    compute = 0.01 * 20 * 1 + 0.001 * 20 * (2 + 3)  # 8 prompt tokens
    to_b = 1000 * 8 * 8 / 8e6 + 0.002
    back = 4 * 2 * 8 / 0.8e6 + 0.005
    assert cost.prefill_s == pytest.approx(compute + to_b + back)


def _with_overhead(problem, decode, prefill):
    times = tuple(msgspec.structs.replace(t, stage_decode_overhead_s=decode[t.device],
                                          stage_prefill_overhead_s=prefill[t.device]) for t in problem.profile.times)
    return msgspec.structs.replace(problem, profile=msgspec.structs.replace(problem.profile, times=times))


def test_the_stage_overhead_is_charged_once_per_stage_that_holds_a_decoder_block():
    base = _problem()
    problem = _with_overhead(base, {"a": 0.003, "b": 0.0005}, {"a": 0.007, "b": 0.001})
    # a runs the embedding only (no block, no mask or rotary to build); b runs block + head
    plan = _plan(m=2)
    before, after = evaluate(base, plan), evaluate(problem, plan)
    assert after.stage_compute_s == pytest.approx((before.stage_compute_s[0], before.stage_compute_s[1] + 0.0005))
    assert after.latency_per_token_s == pytest.approx(before.latency_per_token_s + 0.0005)
    assert after.prefill_s == pytest.approx(before.prefill_s + 0.001)
    # a runs embedding + block: charged once; b runs the head only: not charged
    plan2 = ShardPlan(model="toy", num_units=3, stages=(Stage(device="a", start=0, end=2),
                                                        Stage(device="b", start=2, end=3)), micro_batch_size=2)
    before, after = evaluate(base, plan2), evaluate(problem, plan2)
    assert after.latency_per_token_s == pytest.approx(before.latency_per_token_s + 0.003)
    assert after.prefill_s == pytest.approx(before.prefill_s + 0.007)
    m, k = 1, 2
    plan3 = msgspec.structs.replace(plan, micro_batch_size=m, micro_batches=k)
    cost3 = evaluate(problem, plan3)
    occ = [1000 * m * 8 / 8e6, 4 * m * 8 / 0.8e6]
    periods = [max(c, o) for c, o in zip(cost3.stage_compute_s, occ)]
    assert cost3.throughput_tokens_s == pytest.approx(k * m / max(k * max(periods), cost3.latency_per_token_s))


def test_a_negative_stage_overhead_is_a_profile_error():
    from core.devices.profile import profile_errors

    problem = _with_overhead(_problem(), {"a": -1.0, "b": 0.0}, {"a": 0.0, "b": float("inf")})
    errors = profile_errors(problem.profile)
    assert "$.times[0].stage_decode_overhead_s: must be finite and not negative" in errors
    assert "$.times[1].stage_prefill_overhead_s: must be finite and not negative" in errors


def test_throughput_is_k_m_over_the_larger_of_k_bottlenecks_and_the_cycle():
    problem = _problem(batch=4)
    for m, k in [(1, 1), (1, 4), (2, 2)]:
        cost = evaluate(problem, _plan(m=m, k=k))
        occ = [1000 * m * 8 / 8e6, 4 * m * 8 / 0.8e6]
        periods = [max(c, o) for c, o in zip(cost.stage_compute_s, occ)]
        expected = k * m / max(k * max(periods), cost.latency_per_token_s)
        assert cost.throughput_tokens_s == pytest.approx(expected)
        assert cost.bottleneck_stage == periods.index(max(periods))


def test_memory_counts_weights_kv_for_resident_sequences_and_one_pass_of_workspace():
    problem = _problem(batch=4)
    cost = evaluate(problem, _plan(m=2, k=2))
    a, b = cost.memory
    assert (a.weights_bytes, a.kv_cache_bytes, a.workspace_bytes) == (100, 0, 10 * 2 * 4)
    # KV: 2 bytes/token × 4 resident sequences × 10 context tokens; workspace: max(30, 50) × 2 × 4
    assert (b.weights_bytes, b.kv_cache_bytes, b.workspace_bytes) == (500, 2 * 4 * 10, 50 * 8)


def test_memory_headroom_shrinks_every_budget():
    cost = evaluate(_problem(headroom=0.25), _plan())
    assert all(m.budget_bytes == 7500 for m in cost.memory)


def test_the_cost_model_and_the_solvers_apply_the_headroom_alike():
    problem = _problem(headroom=0.3)
    arrays = build_arrays(problem, 2, 1)
    budgets = dict(zip(arrays.devices, arrays.budgets.tolist()))
    assert budgets == {m.device: m.budget_bytes for m in evaluate(problem, _plan()).memory} == {"a": 7000, "b": 7000}


def test_every_violation_is_listed_at_once():
    problem = msgspec.structs.replace(_problem(batch=1), excluded_devices=("b",))
    plan = ShardPlan(model="toy", num_units=3, micro_batch_size=2, stages=(
        Stage(device="b", start=0, end=1), Stage(device="b", start=1, end=3)))
    text = "\n".join(validate(problem, plan))
    assert "source" in text and "more than one stage" in text and "excluded" in text and "exceed the workload" in text


def test_a_plan_that_overflows_memory_names_the_device_and_sizes():
    problem = _problem()
    small = msgspec.structs.replace(problem, profile=msgspec.structs.replace(problem.profile, cluster=Cluster(
        devices=(Device(id="a", memory_bytes=10_000), Device(id="b", memory_bytes=500)), links=problem.profile.cluster.links)))
    violations = validate(small, _plan())
    assert len(violations) == 1 and violations[0].startswith("b: needs") and "budget" in violations[0]


def test_a_memory_violation_gives_sizes_in_a_unit_that_reads():
    problem = _problem()
    mib = 2**20  # a few-MiB model (the demo's) read "needs 0.00 GiB ... budget is 0.00 GiB"
    small = msgspec.structs.replace(problem, profile=msgspec.structs.replace(problem.profile, cluster=Cluster(
        devices=(Device(id="a", memory_bytes=10_000), Device(id="b", memory_bytes=3 * mib // 2)),
        links=problem.profile.cluster.links)))
    big = msgspec.structs.replace(small.profile.model, units=tuple(
        msgspec.structs.replace(u, param_bytes=u.param_bytes * 4 * 1024) for u in small.profile.model.units))
    small = msgspec.structs.replace(small, profile=msgspec.structs.replace(small.profile, model=big))
    (violation,) = [v for v in validate(small, _plan()) if v.startswith("b:")]
    assert "budget is 1.50 MiB" in violation and "0.00 GiB" not in violation


def test_missing_link_and_gaps_are_violations():
    problem = _problem()
    no_back = msgspec.structs.replace(problem, profile=msgspec.structs.replace(problem.profile, cluster=Cluster(
        devices=problem.profile.cluster.devices, links=problem.profile.cluster.links[:1])))
    assert any("no link from 'b' to 'a'" in v for v in validate(no_back, _plan()))
    gap = ShardPlan(model="toy", num_units=3, stages=(Stage(device="a", start=0, end=1), Stage(device="b", start=2, end=3)))
    assert any("expected 1" in v for v in validate(problem, gap))
    assert not evaluate(problem, gap).feasible


def test_transfer_on_one_device_is_free_and_without_a_link_impossible():
    problem = _problem()
    assert transfer_s(problem, "a", "a", 1e9) == 0.0
    assert transfer_s(problem, "a", "zz", 1) == math.inf
    assert link_occupancy_s(problem, "a", "b", 1e6) == pytest.approx(1.0)


def test_solver_arrays_agree_with_evaluate_on_random_plans():
    rng = random.Random(5)
    checked = 0
    for seed in range(30):
        problem = random_problem(seed, 5, 9, batch=4)
        ids = list(problem.profile.cluster.device_ids())
        for _ in range(5):
            m, k = rng.choice([(1, 1), (2, 2), (4, 1), (1, 3)])
            arr = build_arrays(problem, m, k)
            seq = [0] + rng.sample(range(1, len(ids)), rng.randint(0, 4))
            ends = sorted(rng.sample(range(1, 9), len(seq) - 1)) + [9]
            plan = plan_from_boundaries(problem.profile.model.name, 9, [arr.devices[d] for d in seq], ends[:-1],
                                        micro_batch_size=m, micro_batches=k)
            cost = evaluate(problem, plan)
            lat, bott = sequence_terms(arr, seq, ends)
            if math.isinf(lat):
                assert any("no link" in v for v in cost.violations)
                continue
            assert lat == pytest.approx(cost.latency_per_token_s, rel=1e-12)
            assert k * m / max(k * bott, lat) == pytest.approx(cost.throughput_tokens_s, rel=1e-12)
            start = 0
            for d, e, mem in zip(seq, ends, cost.memory):
                assert arr.stage_bytes[start, e] == mem.total_bytes
                assert (e <= arr.emax[d, start]) == mem.fits
                start = e
            checked += 1
    assert checked > 100


def test_link_bytes_per_token_is_each_stages_last_unit_output_and_the_token_back_to_the_source():
    from core.planning.cost import link_bytes_per_token

    problem = _problem()
    two = ShardPlan(model=problem.profile.model.name, num_units=3,
                    stages=(Stage(device="a", start=0, end=2), Stage(device="b", start=2, end=3)))
    assert link_bytes_per_token(problem, two) == {("a", "b"): 1000, ("b", "a"): 4}
    one = ShardPlan(model=problem.profile.model.name, num_units=3, stages=(Stage(device="a", start=0, end=3),))
    assert link_bytes_per_token(problem, one) == {}
