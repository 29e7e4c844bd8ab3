"""Attention offloading's problem from a measured profile: budgets, links and speeds as profiled."""

from __future__ import annotations

import msgspec
import pytest

from core.errors import PlanInvalid
from core.techniques.attention_offload.measured import problem_from_profile
from core.techniques.attention_offload.planner import run_strategy
from core.techniques.attention_offload.problem import OffloadModel, OffloadWorkload
from tests.gui.problems import make_problem

MODEL = OffloadModel(name="tiny", layers=4, hidden=64, q_heads=4, kv_heads=2, head_dim=16, intermediate=128,
                     vocab=256, bytes_per_element=4)
WORKLOAD = OffloadWorkload(prompt_tokens=16, generated_tokens=32, max_batch=8)


def test_each_profiled_device_keeps_its_budget_and_its_slowest_measured_link():
    profile = make_problem().profile
    problem = problem_from_profile(profile, MODEL, WORKLOAD)
    assert [d.id for d in problem.devices] == ["phone", "laptop", "server"]
    for d in problem.devices:
        assert d.memory_bytes == profile.cluster.device(d.id).memory_bytes
        slowest = min(link.bandwidth_mbit_s for link in profile.cluster.links if d.id in (link.src, link.dst))
        assert d.link_bandwidth == pytest.approx(slowest * 1e6 / 8)
    # the profile's phone decodes 4x slower than its server: so do the problem's speeds
    phone, server = problem.device("phone"), problem.device("server")
    assert server.flops / phone.flops == pytest.approx(4.0) and server.memory_bandwidth > phone.memory_bandwidth


def test_only_the_connected_agents_are_planned_and_the_exact_search_plans_on_them():
    problem = problem_from_profile(make_problem().profile, MODEL, WORKLOAD, devices=("laptop", "server"))
    assert [d.id for d in problem.devices] == ["laptop", "server"]
    out = run_strategy(problem, "exact", "throughput")
    assert out.plan is not None and set(out.plan.compute) | set(out.plan.memory) <= {"laptop", "server"}


def test_a_budget_that_cannot_hold_the_dense_part_keeps_that_device_off_compute():
    profile = make_problem().profile
    small = msgspec.structs.replace(profile.cluster.device("server"), memory_bytes=MODEL.weight_bytes - 1)
    cluster = msgspec.structs.replace(profile.cluster, devices=tuple(
        small if d.id == "server" else d for d in profile.cluster.devices))
    problem = problem_from_profile(msgspec.structs.replace(profile, cluster=cluster), MODEL, WORKLOAD)
    out = run_strategy(problem, "exact", "throughput")
    assert "server" not in out.plan.compute


def test_no_connected_agent_in_the_profile_says_to_profile():
    with pytest.raises(PlanInvalid, match="profile the cluster"):
        problem_from_profile(make_problem().profile, MODEL, WORKLOAD, devices=("elsewhere",))


def test_a_measured_plans_named_roles_run_as_named_and_a_name_not_connected_is_refused():
    from core.errors import RunFailed
    from core.techniques.attention_offload.run import OffloadRunOptions, lane_roles, named_roles

    agents = ["edge-a", "edge-b", "edge-c"]
    options = OffloadRunOptions.of({"compute_replicas": 1, "compute": ["edge-c"], "memory": ["edge-b"]})
    assert named_roles(options, "edge-c", agents) == (["edge-c"], ["edge-b"])  # edge-a: not in the plan
    assert lane_roles("edge-c", agents, options) == {"edge-c": "compute", "edge-b": "attention"}
    with pytest.raises(RunFailed, match="connected agent"):
        named_roles(OffloadRunOptions.of({"compute_replicas": 1, "compute": ["edge-c"], "memory": ["gone"]}),
                    "edge-c", agents)
    with pytest.raises(RunFailed, match="compute_replicas"):
        OffloadRunOptions.of({"compute_replicas": 2, "compute": ["edge-c"], "memory": ["edge-b"]})


def _profile_of_model():
    """The synthetic profile with its blocks' sizes those of ``MODEL`` (a checkpoint's profile and its
    ``checkpoint_model`` describe one model; the synthetic profile's blocks are another's)."""
    profile = make_problem().profile
    n = MODEL.dense_params_per_layer
    units = tuple(msgspec.structs.replace(u, params=n, param_bytes=n * MODEL.bytes_per_element, flops_per_token=2.0 * n)
                  if u.kind == "decoder_block" else u for u in profile.model.units)
    return msgspec.structs.replace(profile, model=msgspec.structs.replace(profile.model, units=units))


def _block_times(profile, device: str) -> tuple[float, float, int]:
    """(decode at the smallest batch, prefill of the most tokens, those tokens), summed over the blocks:
    read off the profile directly."""
    times = profile.times_of(device)
    blocks = [u.index for u in profile.model.units if u.kind == "decoder_block"]
    most = max(range(len(times.prefill_token_counts)), key=lambda i: times.prefill_token_counts[i])
    return (sum(times.decode_s[b][0] for b in blocks), sum(times.prefill_s[b][most] for b in blocks),
            times.prefill_token_counts[most])


def test_a_prefill_of_the_profiled_tokens_costs_what_the_profile_measured_over_a_decode_step():
    """The dense roofline's two terms come from two measured points: a decode step at batch 1 costs
    the profile's decode, a prefill of its most tokens its prefill (before: that many decode steps)."""
    from core.techniques.attention_offload.cost import dense_seconds

    profile = _profile_of_model()
    problem = problem_from_profile(profile, MODEL, WORKLOAD)
    for device in ("phone", "server"):
        decode, prefill, tokens = _block_times(profile, device)
        d = problem.device(device)
        layers = len([u for u in profile.model.units if u.kind == "decoder_block"])
        assert layers * dense_seconds(problem, d, 1) == pytest.approx(decode)
        assert layers * dense_seconds(problem, d, tokens) == pytest.approx(prefill)
        assert prefill / decode < tokens / 2  # the profile's prefill is far from `tokens` decode steps


def test_a_decode_step_s_head_costs_the_profiled_embedding_head_and_stage_overhead():
    from core.techniques.attention_offload.cost import head_seconds

    profile = make_problem().profile
    times = profile.times_of("laptop")
    times = msgspec.structs.replace(times, stage_decode_overhead_s=3e-4)
    profile = msgspec.structs.replace(profile, times=tuple(times if t.device == "laptop" else t for t in profile.times))
    problem = problem_from_profile(profile, MODEL, WORKLOAD)
    units = {u.kind: u.index for u in profile.model.units if u.kind in ("embedding", "head")}
    measured = times.decode_s[units["embedding"]][0] + times.decode_s[units["head"]][0] + 3e-4
    assert head_seconds(problem, problem.device("laptop"), 1) == pytest.approx(measured)
