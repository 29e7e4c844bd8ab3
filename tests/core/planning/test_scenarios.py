import msgspec
import pytest

from core.planning.cost import evaluate
from core.errors import ModelDoesNotFit
from core.planning.problem import Workload
from core.planning.scenarios import (
    DeviceSpec, legacy_paper_problem, paper_devices, paper_links, paper_problem, paper_scenario, synthetic_problem,
    unit_decode_s,
)
from core.planning.solvers import cloud_edge_opt, edge_solo
from core.planning.solvers.comparison import run_strategy

BATCH_1 = Workload(prompt_tokens=32, generated_tokens=96, batch_size=1)


def _latency(problem, strategy):
    return run_strategy(msgspec.structs.replace(problem, workload=BATCH_1), strategy, "latency")


def test_the_scenario_holds_the_paper_models_on_its_testbed_in_fp32():
    scen = paper_scenario()
    assert [p.profile.model.name for p in scen.problems] == ["llama-2-7b", "llama-2-13b", "llama-2-70b"]
    names = [d.name for d in scen.devices]
    assert names.count("Jetson AGX Orin 32GB") == 12 and names.count("Jetson Orin NX 16GB") == 2
    assert names.count("RTX 3090 server") == 1
    for p in scen.problems:
        assert p.profile.model.dtype == "fp32" and p.source == "agx-00"
        assert (p.workload.prompt_tokens, p.workload.generated_tokens, p.workload.batch_size) == (32, 96, 8)


def test_only_the_source_server_pair_is_slow_and_the_rest_spread_20_percent_around_50_mbit():
    links = {(l.src, l.dst): l.bandwidth_mbit_s for l in paper_links(paper_devices())}
    assert links[("agx-00", "server")] == links[("server", "agx-00")] == 1.0
    others = [bw for pair, bw in links.items() if "agx-00" not in pair or "server" not in pair]
    assert all(40.0 <= bw <= 60.0 for bw in others)
    assert max(others) - min(others) > 15.0  # spread, not one value
    assert paper_links(paper_devices()) == paper_links(paper_devices())  # a fixed seed


def test_edge_solo_7b_is_calibrated_on_the_papers_140_ms():
    assert _latency(paper_problem("llama-2-7b"), "edge-solo").latency_s == pytest.approx(0.14034, rel=0.01)


def test_edgeshard_reaches_the_server_through_another_orin_and_beats_edge_solo():
    problem = paper_problem("llama-2-7b")
    best = _latency(problem, "edgeshard")
    assert "server" in best.plan.devices() and best.plan.stages[1].device != "server"
    assert _latency(problem, "edge-solo").latency_s / best.latency_s >= 1.4


def test_at_1_mbit_cloud_edge_opt_keeps_everything_on_the_source():
    problem = paper_problem("llama-2-7b")
    opt = _latency(problem, "cloud-edge-opt")
    assert opt.plan.devices() == ("agx-00",)


def test_with_a_fast_server_link_cloud_edge_opt_uses_the_server():
    problem = paper_problem("llama-2-7b", server_mbit_s=1000.0)
    solo = evaluate(problem, edge_solo(problem)).latency_per_token_s
    opt_plan = cloud_edge_opt(problem)
    assert "server" in opt_plan.devices()
    assert evaluate(problem, opt_plan).latency_per_token_s < solo


def test_the_older_testbed_puts_every_edge_behind_the_slow_server_link():
    problem = legacy_paper_problem("llama-2-7b")
    links = {(l.src, l.dst): l for l in problem.profile.cluster.links}
    assert links[("agx-05", "server")].bandwidth_mbit_s == 1.0 and links[("agx-05", "server")].latency_ms == 20.0
    assert problem.profile.model.dtype == "fp16"


def test_70b_fits_only_when_sharded_over_many_devices():
    problem = paper_problem("llama-2-70b")
    assert run_strategy(problem, "edge-solo", "latency").status == "oom"
    assert run_strategy(problem, "cloud-edge-even", "latency").status == "oom"
    assert run_strategy(problem, "cloud-edge-opt", "latency").status == "failed"
    best = run_strategy(problem, "edgeshard", "latency", time_limit_s=5.0)
    assert len(best.plan.stages) >= 9 and all(m.fits for m in best.cost.memory)


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
