"""What goes wrong around a run gets a typed error naming the device, and only what the
run depends on can end it: an idle agent that dies is reported, the run goes on."""

from __future__ import annotations

import threading

import pytest
import torch

from agents.agent import Agent
from agents.local_pipeline import generate_partitioned
from agents.protocol import AgentState, GetStatus, LinkShape
from agents.sampling import SamplingParams
from agents.shard import StageExecutor
from agents.transport import CurveKeys
from core.models.checkpoints import ModelRecipe, make_model
from core.runs.coordinator import AgentEndpoint, Coordinator, RunRequest, split_micro_batches
from core.errors import FormatError, RunFailed
from core.planning.plan import plan_from_boundaries

PROMPT = (5, 17, 33, 9, 101, 250)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    recipe = ModelRecipe(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=13)
    return str(make_model(recipe, tmp_path_factory.mktemp("coord-failures") / "tiny-llama"))


@pytest.fixture
def deaf_agent():
    """A real agent that only answers another coordinator's key: to us it never replies."""
    agent = Agent("deaf", CurveKeys.generate().public).start()
    yield agent
    agent.close()


def _request(max_new_tokens: int, mode: str = "sequential") -> RunRequest:
    return RunRequest(input_ids=(PROMPT,), attention_mask=((1,) * len(PROMPT),), max_new_tokens=max_new_tokens,
                      mode=mode, eos_token_ids=(), pad_token_id=0)


def test_losing_an_idle_agent_outside_the_plan_is_reported_and_the_run_goes_on(model_dir):
    keys = CurveKeys.generate()
    agents = {d: Agent(d, keys.public).start() for d in ("a", "b", "idle")}
    lost: list[str] = []
    try:
        endpoints = [AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents.values()]
        with Coordinator(endpoints, keys, heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0) as co:
            co.on_lost = lost.append
            plan = plan_from_boundaries("tiny-llama", 6, ["a", "b"], [3])
            slow = LinkShape(latency_ms=25)  # 2 hops per token: the run lasts well past the detection
            co.load(plan, model_dir, links={"a": slow, "b": slow})
            killer = threading.Timer(0.3, agents["idle"].close)
            killer.start()
            try:
                result = co.run(plan, _request(80))
            finally:
                killer.join()
            assert lost == ["idle"]
            executors = [StageExecutor(model_dir, s.start, s.end) for s in plan.stages]
            ref = generate_partitioned(executors, torch.tensor([PROMPT]), torch.ones(1, len(PROMPT), dtype=torch.int64),
                                       SamplingParams(max_new_tokens=80, pad_token_id=0))
            assert [list(t) for t in result.tokens] == ref.tokens.tolist()
            assert {s.state for s in co.status_of(["a", "b"]).values()} == {AgentState.READY}
    finally:
        for a in agents.values():
            a.close()


def test_a_run_in_an_unknown_mode_is_a_format_error_naming_the_mode(deaf_agent):
    keys = CurveKeys.generate()
    with Coordinator([AgentEndpoint("deaf", deaf_agent.control_address, deaf_agent.keys.public)], keys) as co:
        with pytest.raises(FormatError) as info:
            co.run(plan_from_boundaries("m", 6, ["deaf"], []), _request(2, mode="fastest"))
        assert info.value.field == "mode" and "'fastest'" in str(info.value) and "no-bubbles" in str(info.value)
        assert co._run is None


def test_splitting_zero_sequences_into_micro_batches_is_refused():
    with pytest.raises(FormatError, match="at least one sequence"):
        split_micro_batches(0, 2)
    assert split_micro_batches(1, 3) == ((0,),)


def test_a_plan_that_avoids_an_offline_agent_loads_and_runs_as_if_it_were_not_there(model_dir):
    keys = CurveKeys.generate()
    agents = {d: Agent(d, keys.public).start() for d in ("a", "b", "gone")}
    try:
        endpoints = [AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents.values()]
        with Coordinator(endpoints, keys, heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0) as co:
            lost = threading.Event()
            co.on_lost = lambda device: lost.set()
            agents["gone"].close()
            assert lost.wait(10)
            plan = plan_from_boundaries("tiny-llama", 6, ["a", "b"], [3])
            co.load(plan, model_dir)
            result = co.run(plan, _request(5))
            assert len(result.tokens[0]) == 5
    finally:
        for a in agents.values():
            a.close()


def test_a_failed_runs_stops_and_unloads_never_wait_on_an_agent_whose_port_refuses(model_dir):
    """c (the last stage) is closed mid-decode and b reports losing it; the heartbeats (60 s) never decide. The
    failure path asks once which agents are lost (c's port refuses) and awaits no stop or unload reply from c,
    while the live a and b are still stopped and unloaded (idle) before the error reaches the caller."""
    from agents.protocol import RunError, TokenEvent

    keys = CurveKeys.generate()
    agents = {d: Agent(d, keys.public).start() for d in ("a", "b", "c")}
    try:
        endpoints = [AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents.values()]
        with Coordinator(endpoints, keys, heartbeat_interval_s=0.2, heartbeat_timeout_s=60.0) as co:
            plan = plan_from_boundaries("tiny-llama", 6, list(agents), [2, 4])
            co.load(plan, model_dir, links={d: LinkShape(latency_ms=15) for d in agents})
            awaited: list[tuple[str, str]] = []
            await_reply = co.link.await_reply

            def counted(device, fut, timeout_s, what, **kw):
                awaited.append((device, what))
                return await_reply(device, fut, timeout_s, what, **kw)

            co.link.await_reply = counted

            class LoseC:
                lost = threading.Event()

                def on_event(self, event) -> None:
                    pass

                def on_tokens(self, tokens: TokenEvent) -> None:
                    if tokens.step >= 3 and not self.lost.is_set():
                        self.lost.set()
                        threading.Thread(target=self.lose_c, daemon=True).start()

                def lose_c(self) -> None:
                    agents["c"].close()
                    agents["b"].post(RunError(run_id=agents["b"].run_id, device="b", message="lost its peer c"))

            with pytest.raises(RunFailed):
                co.run(plan, _request(200, mode="no-bubbles"), LoseC())
            assert not co.link.is_lost("c")  # the heartbeats had not decided: the failure path's own ask did
            assert [w for d, w in awaited if d == "c" and w in ("stopping", "unloading after the failure")] == []
            assert {(d, w) for d, w in awaited} >= {("a", "stopping"), ("b", "stopping"),
                                                    ("a", "unloading after the failure"),
                                                    ("b", "unloading after the failure")}
            assert {d: s.state for d, s in co.status_of(["a", "b"]).items()} == {"a": AgentState.IDLE,
                                                                                  "b": AgentState.IDLE}
    finally:
        for a in agents.values():
            a.close()
