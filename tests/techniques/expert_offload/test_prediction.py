"""The predicted timeline of an expert-offload run (core.techniques.expert_offload.cost/simulator)
against independent computations: every routing of a batch enumerated, a routing trace replayed
through the agents' own expert buffer, and the run's batch split as the Run screen predicts it."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from agents.techniques.expert_offload.offload import ExpertBuffer
from core.planning.plan import ShardPlan, Stage
from core.runs.prediction import PlanOrigin, predict_origin_run
from core.techniques.expert_offload import TECHNIQUE
from core.techniques.expert_offload.cost import distinct_experts
from core.techniques.expert_offload.problem import MoeModel, OffloadPlan, OffloadProblem
from core.techniques.expert_offload.simulator import simulate

LAYERS, EXPERTS, TOP_K = 4, 4, 2
MODEL = MoeModel(name="m", layers=LAYERS, experts=EXPERTS, top_k=TOP_K, expert_bytes=150_000, resident_bytes=1000,
                 layer_compute_s=1e-3, expert_compute_s=5e-4, head_s=2e-3)
FIXED_S, BANDWIDTH = 1.5e-4, 1e9
"""A read's measured fixed cost and bandwidth: one expert read takes 0.15 ms + 150 kB at 1 GB/s = 0.3 ms."""


def problem(prompt_tokens: int = 6) -> OffloadProblem:
    return OffloadProblem(model=MODEL, memory_budget_bytes=10**9, bandwidth_bps=BANDWIDTH, read_fixed_s=FIXED_S,
                          prompt_tokens=prompt_tokens)


@pytest.mark.parametrize("experts, top_k, tokens", [(4, 2, 1), (4, 2, 2), (4, 2, 3), (6, 2, 2), (5, 3, 2)])
def test_the_expected_distinct_experts_of_a_batch_equal_every_routing_enumerated(experts, top_k, tokens):
    picks = list(itertools.combinations(range(experts), top_k))
    routings = list(itertools.product(picks, repeat=tokens))
    mean = sum(len(set().union(*routing)) for routing in routings) / len(routings)
    assert distinct_experts(experts, top_k, tokens) == pytest.approx(mean)


def _trace_misses(slots: int, policy: str, batch: int, prompt: int, steps: int, seed: int = 5) -> int:
    """Demand reads of the agents' ``ExpertBuffer`` over a seeded routing trace: each step, each block,
    every token of the batch (of the prompt, at the prefill) picks ``TOP_K`` experts at random."""
    rng = random.Random(seed)
    buffer = ExpertBuffer(slots, lambda block, expert: (torch.zeros(1),), LAYERS, policy)
    for step in range(steps):
        for block in range(LAYERS):
            picked = set()
            for _ in range(batch * prompt if step == 0 else batch):
                picked |= set(rng.sample(range(EXPERTS), TOP_K))
            for expert in sorted(picked):  # as OffloadedExperts.forward acquires them
                buffer.acquire((block, expert))
                buffer.release((block, expert))
    return buffer.misses


@pytest.mark.parametrize("batch, slots", [(1, 4), (3, 8)])
def test_the_storage_lane_is_the_reads_of_a_routing_trace_through_the_agents_buffer_times_the_read_cost(batch, slots):
    """LRU over the cyclic block order (io-exp) misses every expert a decode step picks when a cycle's
    picks outnumber the slots; the prefill reads every expert its prompt tokens pick into the empty buffer."""
    steps = 41
    plan = OffloadPlan(device="d", slots=slots, policy="lru")
    misses = _trace_misses(slots, "lru", batch, 6, steps)
    sim = simulate(problem(6), plan, generated_tokens=steps, micro_batch_sizes=(batch,))
    storage = sum(e.end_s - e.start_s for e in sim.events if e.device == "d:storage")
    one_read = FIXED_S + MODEL.expert_bytes / BANDWIDTH
    assert storage == pytest.approx(misses * one_read, rel=0.05)
    assert sum(e.nbytes for e in sim.events if e.device == "d:storage") == pytest.approx(
        misses * MODEL.expert_bytes, rel=0.05)


def _run_plan() -> ShardPlan:
    return ShardPlan(model="m", num_units=LAYERS + 2,
                     stages=(Stage(device="d", start=0, end=LAYERS + 2, kind="expert-offload"),))


@pytest.mark.parametrize("micro_batches, rows", [(None, [(0, 1, 2)]), (2, [(0, 1), (2,)])])
def test_the_ghosts_of_a_run_of_three_prompts_carry_its_sequences_in_its_micro_batches(micro_batches, rows):
    plan = OffloadPlan(device="d", slots=8)
    prediction = predict_origin_run(PlanOrigin(TECHNIQUE, problem(), plan), _run_plan(), "sequential", 3,
                                    micro_batches, 4)
    result = prediction.result
    assert prediction.group_sizes == tuple(len(r) for r in rows)
    for step in range(4):
        assert [t.sequence_ids for t in result.tokens if t.step == step] == rows
        assert [len(t.token_ids) for t in result.tokens if t.step == step] == [len(r) for r in rows]
        computes = [e for e in result.events if e.step == step and e.kind == "compute"]
        assert sorted(e.micro_batch for e in computes) == list(range(len(rows)))  # one box per micro-batch


def test_a_batch_step_is_priced_from_the_measured_curves_when_the_model_has_them():
    """b = 3 lies between the profiled batches 2 and 4: its block time is their midpoint; the prefill's
    3 x 6 tokens lie on its sample, the head too."""
    import msgspec

    model = msgspec.structs.replace(MODEL, decode_batch_sizes=(1, 2, 4), block_decode_s=(0.002, 0.003, 0.005),
                                    head_decode_s=(0.001, 0.0012, 0.0016), prefill_token_counts=(18,),
                                    block_prefill_s=(0.01,), head_prefill_s=(0.004,))
    p = msgspec.structs.replace(problem(6), model=model, bandwidth_bps=1e15, read_fixed_s=0.0)  # reads ~free
    sim = simulate(p, OffloadPlan(device="d", slots=16), generated_tokens=2, micro_batch_sizes=(3,))
    prefill, decode = (e for e in sim.events if e.kind == "compute")
    assert prefill.end_s - prefill.start_s == pytest.approx(LAYERS * 0.01 + 0.004, rel=1e-6)
    assert decode.end_s - decode.start_s == pytest.approx(LAYERS * 0.004 + 0.0014, rel=1e-6)


def test_a_storage_profile_that_predates_the_warm_split_counts_as_not_measured(tmp_path):
    """Its cold bandwidth priced page-cached reads ~2x slow: the studio's view measures again."""
    import json

    from core.techniques.expert_offload.on_agents import stored_read_cost
    from core.techniques.expert_offload.profiling import STORAGE_FILE

    (tmp_path / STORAGE_FILE).write_text(json.dumps({"format": "edgeshard.storage-profile", "version": 1,
                                                     "bandwidth_bps": 2e8}))
    assert stored_read_cost(tmp_path) is None
    (tmp_path / STORAGE_FILE).write_text(json.dumps({"format": "edgeshard.storage-profile", "version": 2,
                                                     "bandwidth_bps": 2e8, "warm": {"read_s": 3e-4, "fixed_s": 1e-4,
                                                                                    "bandwidth_bps": 1e9}}))
    assert stored_read_cost(tmp_path) == (1e9, 1e-4)
