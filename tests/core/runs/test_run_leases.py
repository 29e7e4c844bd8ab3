"""A run is leased to the coordinator that started it: when that coordinator is killed or
stopped mid-run, the agents abort the run on their own and a new run on them succeeds
within 10 s (no "cannot load a shard while running" until they are restarted)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from agents.agent import Agent
from agents.protocol import AgentState
from agents.transport import CurveKeys
from core.models.checkpoints import ModelRecipe, make_model
from core.planning.plan import plan_from_boundaries
from core.runs.coordinator import AgentEndpoint, Coordinator, RunRequest
from tests.core.runs.coordinator_process import LEASE_S

PROMPT = (5, 17, 33, 9, 101, 250)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> str:
    recipe = ModelRecipe(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=13)
    return str(make_model(recipe, tmp_path_factory.mktemp("leases") / "tiny-llama"))


@pytest.fixture
def agents_and_keys(tmp_path):
    keys = CurveKeys.generate()
    keys.save(tmp_path / "coordinator.key")
    agents = [Agent(d, keys.public).start() for d in ("a", "b")]
    yield agents, keys, tmp_path / "coordinator.key"
    for a in agents:
        a.close()


def _start_coordinator_process(agents, key_file, model_dir) -> subprocess.Popen:
    endpoints = [dict(device=a.device, control_address=a.control_address, public_key=a.keys.public) for a in agents]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.core.runs.coordinator_process", json.dumps(endpoints), str(key_file), model_dir],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO, env=env,
    )
    line = proc.stdout.readline()
    assert line.strip() == "started", line
    time.sleep(0.3)
    return proc


def _new_run_succeeds(agents, keys, model_dir) -> float:
    """Seconds a fresh coordinator needs to load and finish a run on the same agents."""
    t0 = time.monotonic()
    endpoints = [AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents]
    with Coordinator(endpoints, keys, heartbeat_interval_s=0.2) as co:
        plan = plan_from_boundaries("tiny-llama", 6, ["a", "b"], [3])
        co.load(plan, model_dir)
        request = RunRequest(input_ids=(PROMPT,), attention_mask=((1,) * len(PROMPT),), max_new_tokens=8,
                             mode="sequential", eos_token_ids=(), pad_token_id=0)
        result = co.run(plan, request)
    assert len(result.tokens[0]) == 8
    return time.monotonic() - t0


def test_after_a_coordinator_is_killed_mid_run_a_new_run_succeeds_within_10_s(agents_and_keys, tiny_llama_dir):
    agents, keys, key_file = agents_and_keys
    proc = _start_coordinator_process(agents, key_file, tiny_llama_dir)
    assert {a._state for a in agents} == {"running"}
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _new_run_succeeds(agents, keys, tiny_llama_dir) < 10


def test_agents_abort_a_killed_coordinators_run_on_their_own_within_a_few_seconds(agents_and_keys, tiny_llama_dir):
    agents, _, key_file = agents_and_keys
    proc = _start_coordinator_process(agents, key_file, tiny_llama_dir)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    t0 = time.monotonic()
    while any(a._state is AgentState.RUNNING for a in agents) and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert [a._state for a in agents] == ["ready", "ready"]
    assert time.monotonic() - t0 < 5
    assert any("lease expired" in line for line in agents[0]._logs)


def test_after_a_coordinator_is_stopped_and_continued_mid_run_a_new_run_succeeds_within_10_s(
    agents_and_keys, tiny_llama_dir
):
    agents, keys, key_file = agents_and_keys
    proc = _start_coordinator_process(agents, key_file, tiny_llama_dir)
    proc.send_signal(signal.SIGSTOP)
    time.sleep(LEASE_S + 1.0)  # longer than the lease and the coordinator's heartbeat timeout (2 s)
    proc.send_signal(signal.SIGCONT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "failed" in out
    assert _new_run_succeeds(agents, keys, tiny_llama_dir) < 10


def test_a_new_coordinator_takes_over_agents_whose_coordinator_is_still_stopped(agents_and_keys, tiny_llama_dir):
    agents, keys, key_file = agents_and_keys
    proc = _start_coordinator_process(agents, key_file, tiny_llama_dir)
    proc.send_signal(signal.SIGSTOP)
    try:
        assert _new_run_succeeds(agents, keys, tiny_llama_dir) < 10
    finally:
        proc.kill()
        proc.wait()
