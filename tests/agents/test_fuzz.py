"""Thousands of random and mutated frames on a live agent's control and data sockets: after
every batch the agent still answers and a run over it still produces the exact tokens."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from agents.agent import Agent
from agents.protocol import PROTOCOL_VERSION, AgentState, ErrorReply, VersionMismatch, decode_control
from agents.transport import CurveKeys
from core.runs.coordinator import AgentEndpoint, Coordinator, RunRequest
from core.planning.plan import plan_from_boundaries
from tests.agents.fuzz_frames import Mutator, control_refusals, control_seeds, data_seeds

PROMPT = (5, 17, 33, 9, 101, 250)
BATCHES = 4
FRAMES_PER_BATCH = 800
HIDDEN = 64


def _request(n: int) -> RunRequest:
    return RunRequest(input_ids=(PROMPT,), attention_mask=((1,) * len(PROMPT),), max_new_tokens=n,
                      mode="sequential", eos_token_ids=(), pad_token_id=0)


@pytest.fixture
def cluster(tiny_llama_dir):
    keys = CurveKeys.generate()
    agents = {d: Agent(d, keys.public).start() for d in ("a", "b")}
    endpoints = [AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents.values()]
    # an agent decoding thousands of fuzzed frames on a loaded host may be late with its pongs: a
    # 2 s heartbeat timeout declared it lost (its run stopped, its shard dropped) though it was not
    # deaf; deafness is what status_of below finds
    co = Coordinator(endpoints, keys, heartbeat_interval_s=0.2, heartbeat_timeout_s=30.0)
    co.open()
    plan = plan_from_boundaries("tiny-llama", 6, ["a", "b"], [3])
    co.load(plan, tiny_llama_dir)
    reference = co.run(plan, _request(12)).tokens
    yield co, agents, keys, plan, reference
    co.close()
    for a in agents.values():
        a.close()


def _dealer(ctx, keys: CurveKeys, agent: Agent):
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndhwm = 100_000
    sock.curve_secretkey, sock.curve_publickey = keys.secret.encode(), keys.public.encode()
    sock.curve_serverkey = agent.keys.public.encode()
    sock.connect(agent.control_address)
    return sock


def _push(ctx, sender: Agent, target: Agent):
    sock = ctx.socket(zmq.PUSH)
    sock.linger = 0
    sock.sndhwm = 100_000
    sock.curve_secretkey, sock.curve_publickey = sender.keys.secret.encode(), sender.keys.public.encode()
    sock.curve_serverkey = target.keys.public.encode()
    sock.connect(target.data_address)
    return sock


def _still_answers_and_runs_exactly(co, agents, plan, model_dir, reference) -> None:
    statuses = co.status_of(list(agents), timeout_s=30.0)  # raises when one does not answer
    assert set(statuses) == set(agents)
    assert all(t.is_alive() for a in agents.values() for t in a._threads), "an agent thread died"
    co.load(plan, model_dir)  # a fuzzed unload or stray run must not stop the next coordinator
    assert co.run(plan, _request(12)).tokens == reference


def _decode_reply(frame: bytes):
    """A reply decodes in our version, or is a version refusal in the (older) version of the
    frame it answers, so an older coordinator can read it."""
    try:
        return decode_control(frame, max_size=1 << 24)
    except VersionMismatch:
        reply = msgspec.msgpack.decode(frame, type=ErrorReply)
        assert reply.code == "bad_version" and reply.v < PROTOCOL_VERSION, reply
        return reply


def test_fuzzed_control_frames_never_make_an_agent_deaf(cluster, tiny_llama_dir):
    co, agents, keys, plan, reference = cluster
    mutate = Mutator(seed=1)
    seeds, refusals = control_seeds(), control_refusals()
    ctx = zmq.Context()
    sent = 0
    try:
        for batch in range(BATCHES):
            target = agents["a" if batch % 2 == 0 else "b"]
            sock = _dealer(ctx, keys, target)
            for i in range(FRAMES_PER_BATCH):
                if i % 40 == 0:
                    frame = mutate.rng.choice(refusals)
                else:
                    frame = mutate.bytes_(mutate.rng.choice(seeds))
                sock.send(frame)
                sent += 1
            sock.send(b"\x82\xa1v\x01\xa4type\xa4\xff\xfe\xfd\xfc")  # the 14-byte frame of the defect
            sent += 1
            replies = 0
            deadline = time.monotonic() + 10
            # the first answer may take a while on a loaded host (thousands of frames ahead of it);
            # then drain until the answers pause
            while time.monotonic() < deadline and sock.poll(500 if replies else 30_000):
                _decode_reply(sock.recv())
                replies += 1
            assert replies > 0
            sock.close()
            _still_answers_and_runs_exactly(co, agents, plan, tiny_llama_dir, reference)
    finally:
        ctx.destroy(linger=0)
    print(f"control frames tried: {sent}")
    assert sent >= 3000


def test_fuzzed_data_frames_during_runs_are_dropped_and_the_run_is_exact(cluster, tiny_llama_dir):
    co, agents, keys, plan, reference = cluster
    mutate = Mutator(seed=2)
    ctx = zmq.Context()
    sent = 0
    try:
        for batch in range(BATCHES):
            # the source hears "from b", stage 1 "from a": the keys the plan allows
            target, sender = (agents["a"], agents["b"]) if batch % 2 == 0 else (agents["b"], agents["a"])
            co.load(plan, tiny_llama_dir)
            result: dict = {}
            runner = threading.Thread(target=lambda: result.update(r=co.run(plan, _request(40))))
            runner.start()
            deadline = time.monotonic() + 30
            while not target._run_id or target._state is not AgentState.RUNNING:
                assert time.monotonic() < deadline, "the run never started on the target"
                time.sleep(0.005)
            # Connected once the plan is loaded: a load first allows no peer (the gate refuses the
            # handshake and libzmq drops the pipe, after which a PUSH blocks for ever).
            sock = _push(ctx, sender, target)
            seeds = data_seeds(target._run_id, HIDDEN) + data_seeds("old-run", HIDDEN)
            for i in range(FRAMES_PER_BATCH):
                frames = list(mutate.rng.choice(seeds))
                where = mutate.rng.randrange(4)
                if where == 0:
                    frames[0] = mutate.bytes_(frames[0])
                elif where == 1 and len(frames) > 1:
                    frames[1] = frames[1][: len(frames[1]) // 2]
                elif where == 2:
                    frames = frames + [b"extra"] * mutate.rng.randint(1, 5)
                assert sock.poll(10_000, zmq.POLLOUT), "the agent's data socket stopped taking frames"
                sock.send_multipart(frames, flags=zmq.NOBLOCK)
                sent += 1
            runner.join(timeout=60)
            assert not runner.is_alive()
            assert result["r"].tokens[0][:12] == reference[0]
            sock.close()
            _still_answers_and_runs_exactly(co, agents, plan, tiny_llama_dir, reference)
    finally:
        ctx.destroy(linger=0)
    logs = co.logs("a", 2000) + co.logs("b", 2000)
    assert any("dropped data message" in line for line in logs)
    print(f"data frames tried: {sent}")
    assert sent >= 3000
