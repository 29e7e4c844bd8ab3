"""A run on an agent, driven over its real control socket: long one-stage runs finish and
match the in-process reference, a stop is for one run only (never the next), and a stop wakes a
stage waiting for data at once."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq

from agents.agent import Agent
from agents.local_pipeline import generate_partitioned
from agents.protocol import (
    AgentState,
    AgentStatus,
    ComputeOptions,
    ErrorReply,
    GetStatus,
    LoadShard,
    Ok,
    PeerSpec,
    ProfileCompute,
    ProfileResult,
    RunError,
    RunFinished,
    StartRun,
    StopRun,
    decode_control,
    encode_control,
)
from agents.sampling import SamplingParams
from agents.shard import StageExecutor
from agents.transport import CurveKeys, DataInbox

PROMPT = (5, 17, 33, 9, 101, 250)


class _Control:
    """The coordinator's side of one agent's control socket, kept minimal for tests."""

    def __init__(self, agent: Agent, keys: CurveKeys):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.curve_secretkey = keys.secret.encode()
        self.sock.curve_publickey = keys.public.encode()
        self.sock.curve_serverkey = agent.keys.public.encode()
        self.sock.connect(agent.control_address)
        self.seen: list = []

    def send(self, msg) -> None:
        self.sock.send(encode_control(msg))

    def wait_for(self, match, timeout_s: float = 180.0):
        """The first message (already seen or arriving) for which ``match`` holds. The timeout is
        only an upper bound: at load 15-20 on 2 cores a 400-token run here took over a minute
        (a clean-clone suite at load 20 failed the queued-stop test here; its text was not kept, and the
        test alone failed 1 in 5 at load 12-16 with 30 s / 60 s bounds)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for m in self.seen:
                if match(m):
                    self.seen.remove(m)
                    return m
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise AssertionError(f"no matching message within {timeout_s} s; seen {self.seen[-5:]}")
            self.seen.append(decode_control(self.sock.recv()))

    def ask(self, msg, timeout_s: float = 180.0):
        self.send(msg)
        return self.wait_for(lambda m: getattr(m, "req", 0) == msg.req, timeout_s)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture
def one_stage(tiny_llama_dir):
    """An agent holding the whole tiny model as a one-stage plan (both first and last)."""
    keys = CurveKeys.generate()
    agent = Agent("solo", keys.public).start()
    control = _Control(agent, keys)
    try:
        me = PeerSpec(device="solo", stage=0, data_address=agent.data_address, public_key=agent.keys.public)
        loaded = control.ask(LoadShard(req=1, model_dir=tiny_llama_dir, stage=0, start=0, end=6, peers=(me,)), 60)
        assert isinstance(loaded, Ok), loaded
        yield agent, control
    finally:
        control.close()
        agent.close()


def _start(run_id: str, req: int, max_new_tokens: int, mode: str = "sequential", prompts=(PROMPT,)) -> StartRun:
    return StartRun(req=req, run_id=run_id, mode=mode, max_new_tokens=max_new_tokens,
                    micro_batches=tuple((i,) for i in range(len(prompts))), input_ids=tuple(prompts),
                    attention_mask=tuple((1,) * len(p) for p in prompts), eos_token_ids=(), pad_token_id=0)


def _run_end(run_id: str):
    return lambda m: isinstance(m, (RunFinished, RunError)) and m.run_id == run_id


def _reference(model_dir: str, prompts, max_new_tokens: int) -> list[list[int]]:
    executor = StageExecutor(model_dir, 0, 6)
    out = generate_partitioned([executor], torch.tensor(prompts), torch.ones(len(prompts), len(prompts[0]),
                               dtype=torch.int64), SamplingParams(max_new_tokens=max_new_tokens, pad_token_id=0))
    return out.tokens.tolist()


def test_a_one_stage_run_of_a_thousand_tokens_finishes_and_equals_the_in_process_reference(one_stage,
                                                                                          tiny_llama_dir):
    """The source is also the last stage: each token feeds the next step without the call
    stack growing per token (it used to hit Python's recursion limit near 330 tokens)."""
    _, control = one_stage
    assert isinstance(control.ask(_start("long", 2, 1000)), Ok)
    end = control.wait_for(_run_end("long"), 300)
    assert isinstance(end, RunFinished), end
    assert [list(t) for t in end.tokens] == _reference(tiny_llama_dir, [PROMPT], 1000)


@pytest.mark.parametrize("mode", ["bubbles", "no-bubbles"])
def test_a_one_stage_run_with_two_micro_batches_steps_each_exactly_once(one_stage, tiny_llama_dir, mode):
    _, control = one_stage
    prompts = (PROMPT, (7, 8, 9, 10, 11, 12))
    assert isinstance(control.ask(_start("two", 2, 40, mode, prompts)), Ok)
    end = control.wait_for(_run_end("two"))
    assert isinstance(end, RunFinished), end
    assert [list(t) for t in end.tokens] == [_reference(tiny_llama_dir, [p], 40)[0] for p in prompts]


def test_a_stop_naming_another_run_does_not_stop_the_current_one(one_stage):
    _, control = one_stage
    assert isinstance(control.ask(_start("current", 2, 300)), Ok)
    control.send(StopRun(req=3, run_id="an-earlier-run"))
    end = control.wait_for(_run_end("current"))
    assert isinstance(end, RunFinished) and len(end.tokens[0]) == 300, end


def test_a_stop_queued_before_a_run_never_marks_that_run_ready_while_it_runs(one_stage, tiny_llama_dir):
    """A stop that waits in the worker's queue (here behind a compute profile) until after
    the next StartRun was accepted must not flip that run's state to ready."""
    _, control = one_stage
    config = json.loads((Path(tiny_llama_dir) / "config.json").read_text())
    control.send(ProfileCompute(req=1, options=ComputeOptions(config=config, repeats=3, batch_sizes=(1,))))
    control.send(StopRun(req=2, run_id=""))
    control.send(_start("next", 3, 400))
    states = []
    deadline = time.monotonic() + 180
    req = 10
    while time.monotonic() < deadline:
        req += 1
        status = control.ask(GetStatus(req=req))
        assert isinstance(status, AgentStatus)
        if any(_run_end("next")(m) for m in control.seen):
            break
        states.append(status.state)
        time.sleep(0.01)
    end = control.wait_for(_run_end("next"))
    assert isinstance(end, RunFinished) and len(end.tokens[0]) == 400, end
    assert states and set(states) == {AgentState.RUNNING}, states
    assert isinstance(control.wait_for(lambda m: getattr(m, "req", 0) == 1), ProfileResult)
    assert isinstance(control.wait_for(lambda m: getattr(m, "req", 0) == 2), Ok)
    # as the coordinator ends every run: a stop of it, answered after the worker's clean-up (the
    # last stage posts RunFinished before that clean-up, so a status read at once may still say
    # "running": 1 in 3 at load 12)
    assert isinstance(control.ask(StopRun(req=req + 1, run_id="next")), Ok)
    assert control.ask(GetStatus(req=req + 2)).state is AgentState.READY


def test_a_stop_of_the_current_run_ends_it_and_the_agent_is_ready_for_the_next(one_stage):
    _, control = one_stage
    assert isinstance(control.ask(_start("first", 2, 100000)), Ok)
    time.sleep(0.2)
    assert isinstance(control.ask(StopRun(req=3, run_id="first")), Ok)
    assert control.ask(GetStatus(req=4)).state is AgentState.READY
    assert isinstance(control.ask(_start("second", 5, 3)), Ok)
    assert isinstance(control.wait_for(_run_end("second")), RunFinished)
    assert not any(isinstance(m, ErrorReply) for m in control.seen)


def test_a_stop_wakes_a_data_receive_that_waits_with_no_timeout():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind_to_random_port("tcp://127.0.0.1")
    inbox = DataInbox(sock)
    stop = inbox.stop_event()
    got = []
    waiter = threading.Thread(target=lambda: got.append(inbox.receive(None)))
    try:
        waiter.start()
        time.sleep(0.2)
        assert waiter.is_alive()  # nothing came: it waits
        stop.set()
        waiter.join(5)
        assert not waiter.is_alive() and got == [None]
    finally:
        inbox.close()
        ctx.destroy(linger=0)


def test_a_stage_waiting_for_data_ends_its_run_as_soon_as_it_is_stopped_whatever_the_receive_timeout(
        tiny_llama_dir, monkeypatch):
    """The run's end (the coordinator's StopRun to every stage) must not wait for a receive timeout:
    with the data socket's timeout at a minute, the waiting stage still answers its stop at once."""
    import agents.agent

    monkeypatch.setattr(agents.agent, "DATA_POLL_MS", 60_000)
    keys = CurveKeys.generate()
    agent = Agent("last", keys.public).start()
    control = _Control(agent, keys)
    try:
        source = PeerSpec(device="first", stage=0, data_address="tcp://127.0.0.1:9", public_key=CurveKeys.generate().public)
        me = PeerSpec(device="last", stage=1, data_address=agent.data_address, public_key=agent.keys.public)
        loaded = control.ask(LoadShard(req=1, model_dir=tiny_llama_dir, stage=1, start=3, end=6, peers=(source, me)), 60)
        assert isinstance(loaded, Ok), loaded
        assert isinstance(control.ask(_start("waits", 2, 8)), Ok)
        time.sleep(0.3)  # the stage is blocked on its receive: nothing will come
        asked = time.monotonic()
        assert isinstance(control.ask(StopRun(req=3, run_id="waits"), timeout_s=20), Ok)
        assert time.monotonic() - asked < 20  # far below the minute a receive timeout would take
        assert control.ask(GetStatus(req=4)).state is AgentState.READY
    finally:
        control.close()
        agent.close()
