"""Attention offloading's cost model, planner and simulator (pure): against brute force, the
paper's claims on its scenario, and each other."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from core.errors import PlanInvalid
from core.techniques import technique_named
from core.techniques.attention_offload import DENSE_KIND, MEMORY_KIND, planner, scenarios
from core.techniques.attention_offload.cost import evaluate, layer_wire_bytes
from core.techniques.attention_offload.problem import OffloadDevice, OffloadModel, OffloadPlan, OffloadProblem, OffloadWorkload
from core.techniques.attention_offload.simulator import simulate

GB = 10**9


def _small(accels=1, mems=3) -> OffloadProblem:
    acc = [OffloadDevice(id=f"acc-{i}", flops=20e12, memory_bandwidth=200 * GB, memory_bytes=20 * GB,
                         link_bandwidth=1.25 * GB, link_latency_s=50e-6, price=2000) for i in range(accels)]
    mem = [OffloadDevice(id=f"mem-{i}", flops=0.5e12, memory_bandwidth=60 * GB + i * GB, memory_bytes=32 * GB,
                         link_bandwidth=0.3 * GB, link_latency_s=100e-6, price=600) for i in range(mems)]
    return OffloadProblem(devices=tuple(acc + mem), model=scenarios.LLAMA3_8B,
                          workload=OffloadWorkload(prompt_tokens=4096, generated_tokens=256, max_batch=64))


def test_the_link_carries_two_query_and_two_kv_heads_per_token_and_layer_whatever_the_context():
    m = scenarios.LLAMA3_70B
    assert m.wire_bytes_per_token_layer() == (2 * 64 + 2 * 8) * 128 * 2
    p = scenarios.paper()
    plan = OffloadPlan(compute=("h100x2-0",), memory=("h20-0", "h20-1"), batch=8, in_flight=2)
    longer = msgspec.structs.replace(p, workload=msgspec.structs.replace(p.workload, prompt_tokens=8 * 2048))
    assert evaluate(p, plan).layer.link_s == evaluate(longer, plan).layer.link_s
    assert evaluate(longer, plan).layer.attention_s > 4 * evaluate(p, plan).layer.attention_s


def test_the_core_wire_size_is_what_the_agents_hand_over(tiny_llama_dir):
    from agents.techniques.attention_offload.heads import HeadShape

    shape = HeadShape.of(tiny_llama_dir)
    model = OffloadModel(name="tiny", layers=shape.layers, hidden=64, q_heads=shape.q_heads, kv_heads=shape.kv_heads,
                         head_dim=shape.head_dim, intermediate=128, vocab=512, bytes_per_element=4)
    assert model.wire_bytes_per_token_layer() == shape.wire_elements_per_token_layer() * 4


def test_more_memory_devices_split_the_attention_time_by_heads():
    p = scenarios.paper()
    one = evaluate(p, OffloadPlan(compute=("h100x2-0",), memory=("h20-0",), batch=16, in_flight=2))
    four = evaluate(p, OffloadPlan(compute=("h100x2-0",), memory=("h20-0", "h20-1", "h20-2", "h20-3"), batch=16,
                                   in_flight=2))
    assert four.layer.attention_s == pytest.approx(one.layer.attention_s / 4)
    kv, prompt = p.model.kv_heads, p.workload.prompt_tokens
    # the KV share splits by heads; each device also holds one prefill attend's transient for its heads
    assert four.memory_bytes - p.model.prefill_attend_bytes(16, prompt, kv // 4) == pytest.approx(
        (one.memory_bytes - p.model.prefill_attend_bytes(16, prompt, kv)) / 4, rel=1e-9)


@pytest.mark.parametrize("objective", ["throughput", "throughput-per-dollar"])
def test_the_exact_search_beats_or_ties_every_plan_found_by_brute_force(objective):
    p = _small(accels=2, mems=2)
    best = evaluate(p, planner.exact(p, objective))
    ids = [d.id for d in p.devices]
    for roles in itertools.product("cmu", repeat=len(ids)):
        compute = tuple(i for i, r in zip(ids, roles) if r == "c")
        memory = tuple(i for i, r in zip(ids, roles) if r == "m")
        if not compute or not memory:
            continue
        for n in range(1, 2 * len(compute) + 3):
            for batch in range(1, p.workload.max_batch + 1, 3):
                cost = evaluate(p, OffloadPlan(compute=compute, memory=memory, batch=batch, in_flight=n))
                if cost.fits:
                    assert planner.score(cost, objective) <= planner.score(best, objective) * (1 + 1e-9)


def test_on_the_papers_scenario_offload_gives_at_least_the_papers_throughput_per_dollar_gain():
    p = scenarios.paper()
    offload = planner.run_strategy(p, "exact", "throughput-per-dollar")
    homogeneous = planner.run_strategy(p, "homogeneous", "throughput-per-dollar")
    assert offload.status == "optimal" and homogeneous.status == "ok"
    assert offload.cost.tokens_per_s_per_dollar / homogeneous.cost.tokens_per_s_per_dollar >= 1.48


def test_on_the_edge_scenario_offload_holds_a_larger_batch_than_the_accelerator_alone():
    p = scenarios.edge()
    offload = planner.exact(p, "throughput")
    alone = planner.homogeneous(p)
    assert offload.batch * offload.in_flight > alone.batch
    assert evaluate(p, offload).tokens_per_s > planner.baseline_cost(p, alone).tokens_per_s


def test_lamina_rule_keeps_attention_within_a_slice_time_over_n_minus_one_when_it_can():
    p = scenarios.paper()
    plan = planner.lamina_rule(p)
    lt = evaluate(p, plan).layer
    assert plan.in_flight == len(plan.compute) + 1
    assert lt.attention_s <= lt.dense_s / (plan.in_flight - 1)


def test_rotational_staggering_beats_fixed_when_batches_do_not_divide_over_replicas():
    p = scenarios.paper()
    plan = OffloadPlan(compute=("h100x2-0", "h100x2-1"), memory=("h20-0", "h20-1", "h20-2", "h20-3"), batch=64,
                       in_flight=3)
    fixed = simulate(p, plan, "fixed", generated_tokens=12)
    rotational = simulate(p, plan, "rotational", generated_tokens=12)
    assert rotational.decode_tokens_per_s > 1.1 * fixed.decode_tokens_per_s
    even = msgspec.structs.replace(plan, in_flight=2, compute=("h100x2-0",))
    assert simulate(p, even, "rotational", generated_tokens=6).decode_tokens_per_s == pytest.approx(
        simulate(p, even, "fixed", generated_tokens=6).decode_tokens_per_s)


@pytest.mark.parametrize("schedule", ["fixed", "rotational"])
def test_the_simulated_decode_throughput_is_the_cost_models_in_steady_state(schedule):
    p = _small(accels=2, mems=3)
    plan = OffloadPlan(compute=("acc-0", "acc-1"), memory=("mem-0", "mem-1", "mem-2"), batch=8, in_flight=3,
                       schedule=schedule)
    sim = simulate(p, plan, generated_tokens=40)
    assert sim.decode_tokens_per_s == pytest.approx(evaluate(p, plan).tokens_per_s, rel=0.15)


def test_the_simulated_timeline_has_attention_lanes_and_no_device_runs_two_things_at_once():
    p = _small(accels=2, mems=2)
    plan = OffloadPlan(compute=("acc-0", "acc-1"), memory=("mem-0", "mem-1"), batch=4, in_flight=3)
    sim = simulate(p, plan, generated_tokens=3)
    computes = [e for e in sim.events if e.kind == "compute"]
    assert {e.device for e in computes} == {"acc-0", "acc-1", "mem-0", "mem-1"}
    for device in {e.device for e in computes}:
        mine = sorted((e for e in computes if e.device == device), key=lambda e: e.start_s)
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(mine, mine[1:]))
    memory = set(plan.memory)
    attention_bytes = sum(e.nbytes for e in sim.events if e.kind == "send" and e.step == 1
                          and (e.device in memory or e.peer in memory))
    assert len(sim.tokens) == 3 * 3 and attention_bytes == \
        3 * p.model.layers * layer_wire_bytes(p.model, 4, 2)  # tensors of 4 sequences + 2 headers per memory device
    residuals = [e for e in sim.events if e.kind == "send" and e.device in plan.compute and e.peer in plan.compute]
    assert residuals and all(e.nbytes == p.model.hidden * p.model.bytes_per_element * (4 if e.step else 4 * 4096)
                             + 240 for e in residuals)  # rotational: the residual follows the batch


@pytest.mark.parametrize("plan, message", [
    (OffloadPlan(compute=("acc-0",), memory=("acc-0",), batch=1, in_flight=1), "appears twice"),
    (OffloadPlan(compute=("gpu-9",), memory=("mem-0",), batch=1, in_flight=1), "'gpu-9' is not in the problem"),
    (OffloadPlan(compute=("acc-0",), memory=(), batch=1, in_flight=1), "at least one compute device and one memory"),
    (OffloadPlan(compute=("acc-0",), memory=("mem-0",), batch=0, in_flight=1), "must be >= 1"),
])
def test_a_bad_plan_is_refused_naming_the_problem(plan, message):
    with pytest.raises(PlanInvalid, match=message):
        evaluate(_small(), plan)


def test_more_memory_devices_than_kv_heads_is_refused():
    model = msgspec.structs.replace(scenarios.LLAMA3_8B, kv_heads=2, q_heads=4)
    p = msgspec.structs.replace(_small(), model=model)
    with pytest.raises(PlanInvalid, match="at most 2"):
        evaluate(p, OffloadPlan(compute=("acc-0",), memory=("mem-0", "mem-1", "mem-2"), batch=1, in_flight=1))


def test_a_problem_nothing_fits_fails_the_strategies_with_what_to_do():
    tiny = tuple(msgspec.structs.replace(d, memory_bytes=GB) for d in _small().devices)
    p = msgspec.structs.replace(_small(), devices=tiny)
    outcomes = technique_named("attention-offload").compare(p, "throughput")
    assert [o.strategy for o in outcomes][0] == "exact"
    assert all(o.status == "failed" and o.error for o in outcomes)
    assert "add a device with more memory" in outcomes[0].error
    assert planner.run_strategy(p, "nope").status == "failed"


def test_the_technique_is_registered_with_both_stage_kinds_the_agents_use():
    from agents.techniques.attention_offload import heads as attention_offload

    t = technique_named("attention-offload")
    assert t.stage_kinds == (DENSE_KIND, MEMORY_KIND) == (attention_offload.DENSE_KIND, attention_offload.MEMORY_KIND)
    assert t.strategy_names()[0] == "exact"


def test_a_layer_sharding_problem_given_to_attention_offload_fails_each_strategy_with_a_message(tmp_path):
    from core.planning.scenarios import paper_problem

    problem = paper_problem()
    outcomes = technique_named("attention-offload").compare(problem, "throughput")
    assert outcomes and all(o.status == "failed" and "attention-offload problem" in o.error for o in outcomes)


def test_the_compute_agent_is_the_first_whose_profiled_budget_holds_the_dense_part():
    from core.techniques.attention_offload.run import choose_compute

    mib = 2**20
    budgets = {"edge-a": 4 * mib, "edge-b": 3 * mib, "edge-c": 11 * mib}
    assert choose_compute(["edge-a", "edge-b", "edge-c"], budgets, 9 * mib, 2) == ("edge-c", 1)  # one holds it
    assert choose_compute(["a", "b", "c"], {}, 9 * mib, 2) == ("a", 2)  # not profiled: the agents decide at load
    assert choose_compute(["a", "b", "c"], {"a": 10 * mib, "b": 10 * mib}, 9 * mib, 5) == ("a", 2)  # c holds KV


def test_when_no_agent_holds_the_dense_part_the_refusal_names_each_budget_and_what_one_needs():
    from core.errors import ModelDoesNotFit
    from core.techniques.attention_offload.run import choose_compute

    mib = 2**20
    budgets = {"edge-a": int(3.8 * mib), "edge-b": int(3.4 * mib), "edge-c": int(3.0 * mib)}
    with pytest.raises(ModelDoesNotFit) as refused:
        choose_compute(["edge-a", "edge-b", "edge-c"], budgets, int(8.5 * mib), 1)
    said = str(refused.value)
    assert "edge-a 3.8 MiB, edge-b 3.4 MiB, edge-c 3.0 MiB" in said
    assert "at least 8.5 MiB" in said and "--memory-budget-mib 8.5 or more" in said
    assert refused.value.missing_bytes == int(8.5 * mib) - int(3.8 * mib)
