"""A dead agent in the agents file (killed, still listed) makes `edgeshard run` and `edgeshard
profile` fail in seconds with one line naming it, exit 2 (before: `run` ended in a
``KeyError: 'local-1'`` traceback from Coordinator.load, also with ``--on-failure replan``;
`profile` waited 30 s in silence). Real agent processes; one is SIGKILLed."""

from __future__ import annotations

import pytest

from core import formats
from core.models.checkpoints import ModelRecipe, make_model
from core.models.units import load_model_spec
from core.planning.plan import ShardPlan, plan_from_boundaries
from core.planning.scenarios import DeviceSpec, synthetic_problem
from tests.entrances import cluster_with_a_dead_agent, refused

DEVICES = ["local-0", "local-1"]


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    """(agents file with local-1 dead, checkpoint, plan over both, the plan's problem)."""
    folder = tmp_path_factory.mktemp("dead-agent")
    model = make_model(ModelRecipe(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3),
                       folder / "tiny-llama")
    plan, problem = folder / "plan.json", folder / "problem.json"
    formats.save(plan, plan_from_boundaries("tiny-llama", 6, DEVICES, [3]))
    spec = load_model_spec(model, "fp32", "tiny-llama")
    formats.save(problem, synthetic_problem([DeviceSpec(id=d, tflops=1, memory_bandwidth_gb_s=10, memory_gib=8)
                                             for d in DEVICES], spec))
    with cluster_with_a_dead_agent(folder / "cluster", DEVICES, "local-1") as agents:
        yield agents, model, plan, problem


@pytest.mark.parametrize("on_failure", ["stop", "replan"])
def test_run_on_a_dead_agent_is_one_line_naming_it(on_failure, setting, capsys):
    agents, model, plan, problem = setting
    err = refused(["run", "--agents", agents, "--model", model, "--plan", plan, "--prompt", "x", "--no-record",
                   "--on-failure", on_failure, "--problem", problem], capsys)
    assert err.startswith("edgeshard: error: local-1: ") and "Traceback" not in err


def test_serve_on_a_dead_agent_is_one_line_naming_it_before_the_model_loads(setting, capsys):
    """Before: the server loaded its tokenizer and sent the plan, then failed on a lost heartbeat (40.5 s at
    load 14); now 2.5 s from a fresh shell at load 14."""
    agents, model, plan, _ = setting
    err = refused(["serve", "--agents", agents, "--model", model, "--plan", plan, "--port", "0", "--no-record"],
                  capsys)
    assert "local-1: no answer and nothing listens at tcp://127.0.0.1:" in err


def test_profile_with_a_dead_agent_names_it_within_the_answer_time(setting, tmp_path, capsys):
    agents, model, _, _ = setting
    err = refused(["profile", "--agents", agents, "--model", model, "--out", tmp_path / "p.json", "--repeats", "1",
                   "--no-network"], capsys)
    assert "local-1: no answer and nothing listens at tcp://127.0.0.1:" in err


def test_loading_a_plan_on_a_dead_agent_names_it_instead_of_a_key_error(setting):
    """What the GUI's Run screen calls: Coordinator.load once the link has declared the agent lost."""
    import time

    from core.devices.local_cluster import load_agents_file
    from core.errors import RunFailed
    from core.runs.coordinator import Coordinator

    agents, model, plan, _ = setting
    endpoints, keys = load_agents_file(agents)
    # 2 s, not 0.5: the live local-0 must not be declared lost too on a loaded host (the error would
    # then name it); local-1 never answers, so it is lost 2 s in
    with Coordinator(endpoints, keys, heartbeat_timeout_s=2.0) as coordinator:
        deadline = time.monotonic() + 30
        while not coordinator.link.is_lost("local-1"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(RunFailed) as err:
            coordinator.load(formats.load(plan, ShardPlan), str(model))
    assert err.value.device == "local-1" and "stopped answering" in str(err.value)

