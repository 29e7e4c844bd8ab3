import json
import subprocess
import sys

import msgspec
import pytest

from core.cli import main
from core.planning.cost import validate
from core.formats import load, save
from core.planning.plan import ShardPlan
from core.planning.scenarios import legacy_paper_problem, random_problem

SCENARIO = "resources/scenarios/edgeshard-testbed-fp16.json"  # fp16: quick to solve


@pytest.fixture
def problem_file(tmp_path):
    problem = legacy_paper_problem("llama-2-13b")
    path = tmp_path / "problem.json"
    save(path, problem)
    return path, problem


def test_plan_prints_a_stage_table_and_writes_the_plan(problem_file, tmp_path, capsys):
    path, problem = problem_file
    out_plan = tmp_path / "plan.json"
    assert main(["plan", str(path), "--objective", "latency", "--out", str(out_plan)]) == 0
    text = capsys.readouterr().out
    assert "proven optimal" in text and "agx-00" in text and "ms/token" in text
    plan = load(out_plan, ShardPlan)
    assert validate(problem, plan) == []


def test_plan_json_is_machine_readable(problem_file, capsys):
    path, _ = problem_file
    assert main(["plan", str(path), "--objective", "throughput", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "edgeshard.plan-result" and doc["status"] == "optimal"
    assert doc["plan"]["objective"] == "throughput"
    assert doc["cost"]["feasible"] and doc["cost"]["memory"][0]["fits"]


def test_a_baseline_that_overflows_memory_is_shown_as_oom_with_exit_1(tmp_path, capsys):
    path = tmp_path / "p70.json"
    save(path, legacy_paper_problem("llama-2-70b"))
    assert main(["plan", str(path), "--strategy", "edge-solo"]) == 1
    assert "OOM" in capsys.readouterr().out


def test_a_profile_is_plannable_with_workload_flags(tmp_path, capsys):
    problem = random_problem(11, 4, 8, tightness=3.0)
    path = tmp_path / "profile.json"
    save(path, problem.profile)
    rc = main(["plan", str(path), "--source", "d1", "--prompt-tokens", "16", "--generated-tokens", "8", "--batch", "2", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["plan"]["stages"][0]["device"] == "d1"
    assert doc["plan"]["micro_batch_size"] == 2


def test_a_profile_with_an_unknown_source_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "profile.json"
    save(path, random_problem(11, 4, 8).profile)
    assert main(["plan", str(path), "--source", "nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_plan_on_a_scenario_needs_a_problem_choice(capsys):
    assert main(["plan", SCENARIO]) == 2
    assert "--problem" in capsys.readouterr().err
    assert main(["plan", SCENARIO, "--problem", "llama-2-7b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["model"] == "llama-2-7b"


def test_compare_prints_every_strategy_side_by_side(capsys):
    assert main(["compare", SCENARIO, "--problem", "llama-2-70b", "--objective", "latency"]) == 0
    text = capsys.readouterr().out
    for name in ("edgeshard", "edge-solo", "cloud-edge-even", "cloud-edge-opt", "even", "memory-proportional"):
        assert name in text
    assert "OOM" in text and "proven optimal" in text and "GiB" in text


def test_compare_json_lists_outcomes_per_problem_and_objective(capsys):
    assert main(["compare", SCENARIO, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "edgeshard.comparison"
    assert [p["model"] for p in doc["problems"]] == ["llama-2-7b", "llama-2-13b", "llama-2-70b"]
    seventy = {o["strategy"]: o for o in doc["problems"][2]["objectives"]["latency"]}
    assert seventy["edge-solo"]["status"] == "oom"
    assert seventy["cloud-edge-opt"]["status"] == "failed" and "missing" in seventy["cloud-edge-opt"]["error"]
    assert seventy["edgeshard"]["status"] == "optimal"


def test_a_malformed_file_gives_a_message_and_exit_2_without_traceback(tmp_path):
    doc = json.loads(msgspec.json.encode(random_problem(2, 3, 5)))
    doc["workload"]["batch_size"] = "four"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    proc = subprocess.run([sys.executable, "-m", "core.cli", "plan", str(bad)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert str(bad) in proc.stderr and "$.workload.batch_size" in proc.stderr


def test_a_model_that_fits_nowhere_is_a_message_not_a_traceback(tmp_path, capsys):
    problem = legacy_paper_problem("llama-2-70b")
    only = msgspec.structs.replace(problem, excluded_devices=tuple(d for d in problem.profile.cluster.device_ids() if d != "agx-00"))
    path = tmp_path / "p.json"
    save(path, only)
    assert main(["plan", str(path)]) == 2
    assert "GiB missing" in capsys.readouterr().err


def test_a_file_of_the_wrong_kind_is_refused(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    save(plan, ShardPlan(model="m", num_units=1, stages=()))
    assert main(["compare", str(plan)]) == 2
    assert "edgeshard.plan" in capsys.readouterr().err


def test_a_profile_whose_times_do_not_match_the_model_is_a_format_error(tmp_path, capsys):
    profile = random_problem(4, 3, 6).profile
    times = list(profile.times)
    times[1] = msgspec.structs.replace(times[1], decode_s=times[1].decode_s[:-1])
    path = tmp_path / "short.json"
    save(path, msgspec.structs.replace(profile, times=tuple(times)))
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "$.times[1].decode_s" in err and "the model has 6 units" in err


def test_a_problem_with_an_unknown_source_is_a_format_error(tmp_path, capsys):
    path = tmp_path / "p.json"
    save(path, msgspec.structs.replace(random_problem(4, 3, 6), source="ghost"))
    assert main(["compare", str(path)]) == 2
    assert "$.source" in capsys.readouterr().err


def test_even_split_over_a_chosen_device_set(problem_file, capsys):
    path, problem = problem_file
    assert main(["plan", str(path), "--strategy", "even", "--devices", "agx-00,agx-03", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [s["device"] for s in doc["plan"]["stages"]] == ["agx-00", "agx-03"]
    assert doc["plan"]["stages"][0]["end"] == problem.profile.model.num_units // 2


def test_a_search_cut_short_reports_its_gap(tmp_path, capsys):
    import random as _random

    from core.planning.scenarios import DeviceSpec

    rng = _random.Random(1)
    devs = [DeviceSpec(id=f"dev-{i:02d}", tflops=rng.uniform(5, 60), memory_bandwidth_gb_s=rng.uniform(50, 400),
                       memory_gib=rng.choice([8, 16, 32, 64])) for i in range(256)]
    path = tmp_path / "p.json"
    # Its throughput proof takes seconds (4.7 s on the 2-core dev machine); 0.05 s cuts it short on any machine.
    save(path, legacy_paper_problem("llama-2-70b", devices=devs))
    assert main(["plan", str(path), "--objective", "throughput", "--time-limit", "0.05", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "ok" and doc["gap"] > 0
    assert doc["bound"] > doc["cost"]["throughput_tokens_s"]


def test_plan_with_agents_leaves_out_a_device_whose_agent_does_not_answer(tmp_path, capsys):
    import msgspec

    from agents.agent import Agent
    from agents.transport import CurveKeys
    from core import formats as fmt
    from core.cli import main as cli_main
    from core.devices.local_cluster import AgentEntry, AgentsFile
    from core.planning.scenarios import DeviceSpec, synthetic_problem

    specs = [DeviceSpec(id="src", tflops=2, memory_bandwidth_gb_s=20, memory_gib=8),
             DeviceSpec(id="fast", tflops=60, memory_bandwidth_gb_s=900, memory_gib=24),
             DeviceSpec(id="mid", tflops=20, memory_bandwidth_gb_s=200, memory_gib=24)]
    problem = tmp_path / "problem.json"
    fmt.save(problem, synthetic_problem(specs, "llama-2-7b", bandwidth_mbit_s=1000))
    keys = CurveKeys.generate()
    keys.save(tmp_path / "coordinator.key")
    agents = {d: Agent(d, keys.public).start() for d in ("src", "fast", "mid")}
    try:
        entries = tuple(AgentEntry(device=a.device, control_address=a.control_address, public_key=a.keys.public,
                                   pid=0) for a in agents.values())
        (tmp_path / "agents.json").write_bytes(msgspec.json.encode(
            AgentsFile(coordinator_key_file="coordinator.key", agents=entries)))
        out_plan = tmp_path / "plan.json"
        assert cli_main(["plan", str(problem), "--out", str(out_plan)]) == 0
        assert "fast" in fmt.load(out_plan, ShardPlan).devices()  # all online: the optimum uses it
        agents["fast"].close()
        assert cli_main(["plan", str(problem), "--agents", str(tmp_path / "agents.json"), "--out", str(out_plan)]) == 0
        printed = capsys.readouterr().out
        assert f"left out, offline: fast (nothing listens at {agents['fast'].control_address}: its agent is not " \
               "running)" in printed
        assert "fast" not in fmt.load(out_plan, ShardPlan).devices()
    finally:
        for a in agents.values():
            a.close()
