import pytest

from core.planning.cost import evaluate
from core.errors import ModelDoesNotFit
from core.planning.problem import Workload
from core.planning.scenarios import DeviceSpec, paper_devices, paper_problem, paper_scenario, synthetic_problem, unit_decode_s
from core.planning.solvers import cloud_edge_opt, edge_solo
from core.planning.solvers.comparison import compare


@pytest.fixture(scope="module")
def comparisons():
    return {p.profile.model.name: {o: {x.strategy: x for x in compare(p, o)} for o in ("latency", "throughput")}
            for p in paper_scenario().problems}


def test_the_scenario_holds_the_paper_models_on_its_testbed():
    scen = paper_scenario()
    assert [p.profile.model.name for p in scen.problems] == ["llama-2-7b", "llama-2-13b", "llama-2-70b"]
    names = [d.name for d in scen.devices]
    assert names.count("Jetson AGX Orin 32GB") == 12 and names.count("Jetson Orin NX 16GB") == 2
    assert names.count("RTX 3090 server") == 1


def test_decode_times_are_weight_bytes_over_usable_bandwidth():
    problem = paper_problem("llama-2-7b")
    block = problem.profile.model.units[5]
    t = problem.profile.times_of("agx-00").decode_time(5, 1)
    assert t == pytest.approx(block.param_bytes / (204.8e9 * 0.7), rel=0.02)  # + a little KV reading
    assert problem.profile.times_of("server").decode_time(5, 1) < t / 4


@pytest.mark.parametrize("model", ["llama-2-7b", "llama-2-13b"])
def test_with_1_mbit_to_the_server_cloud_edge_opt_equals_edge_solo(comparisons, model):
    for objective in ("latency", "throughput"):
        row = comparisons[model][objective]
        assert row["cloud-edge-opt"].plan.devices() == ("agx-00",)
        assert row["cloud-edge-opt"].cost.latency_per_token_s == pytest.approx(row["edge-solo"].cost.latency_per_token_s)


def test_with_a_fast_server_link_cloud_edge_opt_uses_the_server():
    problem = paper_problem("llama-2-7b", server_mbit_s=1000.0)
    solo = evaluate(problem, edge_solo(problem)).latency_per_token_s
    opt_plan = cloud_edge_opt(problem)
    assert "server" in opt_plan.devices()
    assert evaluate(problem, opt_plan).latency_per_token_s < solo


@pytest.mark.parametrize("model", ["llama-2-7b", "llama-2-13b", "llama-2-70b"])
def test_the_optimum_is_never_worse_than_any_baseline(comparisons, model):
    lat = comparisons[model]["latency"]
    tput = comparisons[model]["throughput"]
    assert lat["edgeshard"].status == tput["edgeshard"].status == "optimal"
    for name in lat:
        if lat[name].status == "ok":
            assert lat["edgeshard"].cost.latency_per_token_s <= lat[name].cost.latency_per_token_s * (1 + 1e-9)
        if tput[name].status == "ok":
            assert tput["edgeshard"].cost.throughput_tokens_s >= tput[name].cost.throughput_tokens_s * (1 - 1e-9)


def test_70b_fits_only_when_sharded_over_many_devices(comparisons):
    row = comparisons["llama-2-70b"]["latency"]
    assert row["edge-solo"].status == "oom" and row["cloud-edge-even"].status == "oom"
    assert row["cloud-edge-opt"].status == "failed"
    best = row["edgeshard"]
    assert len(best.plan.stages) >= 5 and all(m.fits for m in best.cost.memory)


def test_synthetic_problem_builds_a_plannable_problem_from_device_specs():
    devices = [DeviceSpec(id="phone", tflops=2, memory_bandwidth_gb_s=50, memory_gib=8),
               DeviceSpec(id="laptop", tflops=10, memory_bandwidth_gb_s=100, memory_gib=16)]
    problem = synthetic_problem(devices, "llama-2-7b", bandwidth_mbit_s=100,
                                workload=Workload(prompt_tokens=32, generated_tokens=32, batch_size=2))
    assert problem.source == "phone" and len(problem.profile.cluster.links) == 2
    assert problem.profile.times_of("laptop").decode_time(3, 2) == pytest.approx(
        unit_decode_s(devices[1], problem.profile.model.units[3], 2, 48))
    with pytest.raises(ModelDoesNotFit):  # 12.6 GiB of weights: the phone alone cannot hold stage 0 + rest
        from core.planning.solvers import solve_min_latency
        solve_min_latency(synthetic_problem(devices[:1], "llama-2-7b"))


def test_paper_devices_scale_to_larger_clusters():
    assert len(paper_devices(agx=50, nx=10, servers=4)) == 64
