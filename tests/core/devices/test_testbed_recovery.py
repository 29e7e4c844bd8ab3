"""Recovery on the netns testbed: agents deployed over SSH to 3 namespaced devices, one killed
(SIGKILL) mid-decode; the run re-plans over the other two and finishes with the undisturbed
run's tokens, greedy and seeded (the local-cluster twin is tests/core/runs/test_recovery.py)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import pytest

from agents.protocol import LinkShape, SamplingSpec, TimelineEvent, TokenEvent
from tests.core.conftest import needs_root

PROMPTS = ((5, 17, 33, 9, 101, 250), (0, 0, 7, 8, 9, 10))
MASKS = ((1,) * 6, (0, 0, 1, 1, 1, 1))


class _KillAt:
    def __init__(self, pid: int, step: int) -> None:
        self.pid, self.step = pid, step
        self.killed = threading.Event()

    def on_event(self, event: TimelineEvent) -> None:
        pass

    def on_tokens(self, tokens: TokenEvent) -> None:
        if tokens.step >= self.step and not self.killed.is_set():
            self.killed.set()
            os.kill(self.pid, signal.SIGKILL)  # namespaces share the host's pids


@pytest.fixture
def own_agents(testbed, tmp_path):
    """Agents of this test only (their own ports and folders): killing one leaves the session's
    deployment alone. Stopped at the end."""
    from core.devices.deploy import DeployOptions, SshTarget, deploy_many, stop

    ws = tmp_path / "workspace"
    ws.mkdir()
    (ws / "known_hosts").write_text("\n".join(testbed.known_hosts_lines()) + "\n")
    options = DeployOptions(python=sys.executable, remote_dir=str(tmp_path / "remote" / "{device}"),
                            control_port=17811, data_port=17812)
    conn = dict(key_file=testbed.operator_key, workspace=ws, use_agent=False, user_known=Path("/nonexistent"))
    targets = [SshTarget(d.name, d.address, d.ssh_port, testbed.ssh_user) for d in testbed.devices]
    results = deploy_many(targets, options=options, **conn)
    failed = {k: v for k, v in results.items() if isinstance(v, Exception)}
    try:
        if failed:
            pytest.fail(f"deploy failed: {failed}")
        yield ws, results
    finally:
        for t in targets:
            try:
                stop(t, remote_dir=str(tmp_path / "remote" / "{device}"), **conn)
            except Exception:  # the killed one: nothing left to stop
                pass


@pytest.mark.netns
@needs_root
def test_a_device_killed_mid_decode_on_the_testbed_is_recovered_with_the_same_tokens(own_agents, testbed, tmp_path):
    from agents.transport import CurveKeys
    from core.models.checkpoints import ModelRecipe, make_model
    from core.models.units import load_model_spec
    from core.planning.plan import plan_from_boundaries
    from core.planning.problem import Workload
    from core.planning.scenarios import DeviceSpec, synthetic_problem
    from core.runs.coordinator import AgentEndpoint, Coordinator, RunRequest
    from core.runs.recovery import ExactReplanner

    ws, results = own_agents
    devices = [d.name for d in testbed.devices]
    model_dir = str(make_model(ModelRecipe(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512,
                                           seed=13), tmp_path / "tiny-llama"))
    spec = load_model_spec(model_dir, "fp32", name="tiny-llama")
    problem = synthetic_problem([DeviceSpec(id=d, tflops=1.0, memory_bandwidth_gb_s=10.0, memory_gib=1.0)
                                 for d in devices], spec,
                                workload=Workload(prompt_tokens=6, generated_tokens=40, batch_size=2))
    keys = CurveKeys.load(ws / "coordinator.key")
    endpoints = [AgentEndpoint(d, results[d].record.control_address, results[d].record.public_key) for d in devices]
    plan = plan_from_boundaries("tiny-llama", 6, devices, [2, 4])
    slow = {d: LinkShape(latency_ms=15) for d in devices}
    two = plan_from_boundaries("tiny-llama", 6, devices[:2], [3])
    with Coordinator(endpoints, keys, heartbeat_timeout_s=2.5) as co:
        # greedy: all three stages, the last one killed; seeded: two stages, the second killed
        for current, sampling, mode in ((plan, SamplingSpec(), "no-bubbles"),
                                        (two, SamplingSpec(temperature=0.9, top_p=0.9, seed=7), "bubbles")):
            co.load(current, model_dir, links=slow)
            request = RunRequest(input_ids=PROMPTS, attention_mask=MASKS, max_new_tokens=30, mode=mode,
                                 micro_batches=2, eos_token_ids=(), pad_token_id=0, sampling=sampling)
            undisturbed = co.run(current, request)
            victim = current.devices()[-1]
            killer = _KillAt(int(results[victim].record.pid), step=5)
            recovered = co.run(current, request, killer, replan=ExactReplanner(problem))
            assert killer.killed.is_set() and recovered.tokens == undisturbed.tokens
            assert recovered.recoveries[0].failed == victim and victim not in recovered.plan.devices()
