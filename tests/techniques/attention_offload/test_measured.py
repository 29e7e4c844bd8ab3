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
