"""An agent stays up and answers precisely whatever arrives on its control socket, and
serves control only to the coordinator's key."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from agents.agent import Agent
from agents.protocol import (
    MAX_CONTROL_FRAME,
    PROTOCOL_VERSION,
    AgentState,
    AgentStatus,
    ConvSweepOptions,
    ErrorReply,
    GetLogs,
    GetStatus,
    Logs,
    Ping,
    Pong,
    ProfileCompute,
    StartRun,
    decode_control,
    encode_control,
)
from agents.transport import CurveKeys


@pytest.fixture
def agent():
    coordinator = CurveKeys.generate()
    a = Agent("dev-a", coordinator.public).start()
    a.test_coordinator_keys = coordinator
    yield a
    a.close()


def _client(agent: Agent, keys: CurveKeys):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.curve_secretkey = keys.secret.encode()
    sock.curve_publickey = keys.public.encode()
    sock.curve_serverkey = agent.keys.public.encode()
    sock.connect(agent.control_address)
    return ctx, sock


def _ask(sock, payload, timeout_ms=5000):
    sock.send_multipart(payload if isinstance(payload, list) else [payload])
    if not sock.poll(timeout_ms):
        return None
    return decode_control(sock.recv())


def test_a_coordinator_of_the_previous_version_gets_a_version_error_it_can_read(agent):
    """The refusal is encoded in the older coordinator's own version and echoes its request id,
    so its request fails with the reason instead of timing out on a reply it would drop."""
    ctx, sock = _client(agent, agent.test_coordinator_keys)
    try:
        sock.send(msgspec.msgpack.encode({"v": PROTOCOL_VERSION - 1, "type": "get_status", "req": 5}))
        assert sock.poll(5000)
        reply = msgspec.msgpack.decode(sock.recv(), type=ErrorReply)
        assert (reply.v, reply.req, reply.code) == (PROTOCOL_VERSION - 1, 5, "bad_version")
        assert f"this agent speaks protocol version {PROTOCOL_VERSION}" in reply.message
        assert f"the coordinator sent version {PROTOCOL_VERSION - 1}" in reply.message
        assert "edgeshard agents upgrade" in reply.message
        status = _ask(sock, encode_control(GetStatus(req=6)))
        assert isinstance(status, AgentStatus) and status.req == 6 and status.state is AgentState.IDLE
    finally:
        ctx.destroy(linger=0)


def test_a_request_refused_at_decode_is_answered_with_its_own_request_id(agent):
    ctx, sock = _client(agent, agent.test_coordinator_keys)
    try:
        reply = _ask(sock, encode_control(ProfileCompute(req=21, options=ConvSweepOptions(sizes=(100_000,)))))
        assert isinstance(reply, ErrorReply) and (reply.req, reply.code) == (21, "bad_message")
        assert "conv-sweep options" in reply.message
    finally:
        ctx.destroy(linger=0)


def test_garbage_oversized_and_wrong_version_frames_get_error_replies_and_the_agent_stays_up(agent):
    ctx, sock = _client(agent, agent.test_coordinator_keys)
    try:
        cases = {
            b"\x93garbage\xff\x00": "bad_frame",
            b"\x00" * (MAX_CONTROL_FRAME + 10): "too_large",
            msgspec.msgpack.encode({"v": PROTOCOL_VERSION + 41, "type": "get_status"}): "bad_version",
            msgspec.msgpack.encode({"v": PROTOCOL_VERSION, "type": "get_status", "evil": True}): "bad_message",
        }
        for frame, code in cases.items():
            reply = _ask(sock, frame)
            assert isinstance(reply, ErrorReply) and reply.code == code, (code, reply)
        reply = _ask(sock, [encode_control(GetStatus()), b"second frame"])
        assert isinstance(reply, ErrorReply) and reply.code == "bad_frame"
        status = _ask(sock, encode_control(GetStatus(req=9)))
        assert isinstance(status, AgentStatus) and status.req == 9 and status.state is AgentState.IDLE
        logs = _ask(sock, encode_control(GetLogs(req=10)))
        assert isinstance(logs, Logs) and any("rejected control frame" in line for line in logs.lines)
    finally:
        ctx.destroy(linger=0)


def test_a_run_before_any_shard_is_loaded_is_refused_with_bad_state(agent):
    ctx, sock = _client(agent, agent.test_coordinator_keys)
    try:
        reply = _ask(sock, encode_control(StartRun(req=4, run_id="r", mode="sequential", max_new_tokens=2)))
        assert isinstance(reply, ErrorReply) and reply.code == "bad_state" and reply.req == 4
    finally:
        ctx.destroy(linger=0)


def test_control_from_a_key_other_than_the_coordinators_gets_no_answer(agent):
    ctx, sock = _client(agent, CurveKeys.generate())
    try:
        assert _ask(sock, encode_control(GetStatus(req=1)), timeout_ms=700) is None
    finally:
        ctx.destroy(linger=0)
    ctx, sock = _client(agent, agent.test_coordinator_keys)
    try:
        assert isinstance(_ask(sock, encode_control(Ping(req=2, t0=1.0))), Pong)
    finally:
        ctx.destroy(linger=0)


def test_pings_carry_the_agents_clock_for_offset_estimation(agent):
    ctx, sock = _client(agent, agent.test_coordinator_keys)
    try:
        pong = _ask(sock, encode_control(Ping(req=3, t0=123.0)))
        assert pong.t0 == 123.0 and pong.t1 <= pong.t2 and abs(pong.t1 - agent.clock()) < 5
    finally:
        ctx.destroy(linger=0)


def test_a_shard_that_cannot_load_is_reported_and_the_agent_stays_up(agent, tmp_path):
    from agents.protocol import LoadShard, PeerSpec

    ctx, sock = _client(agent, agent.test_coordinator_keys)
    try:
        me = PeerSpec(device="dev-a", stage=0, data_address=agent.data_address, public_key=agent.keys.public)
        reply = _ask(sock, encode_control(LoadShard(req=5, model_dir=str(tmp_path / "missing"), stage=0, start=0,
                                                    end=3, peers=(me,))), timeout_ms=30000)
        assert isinstance(reply, ErrorReply) and reply.code == "failed" and reply.req == 5
        # the reply names the device and the path as the agent saw it
        assert "dev-a" in reply.message and str(tmp_path / "missing") in reply.message
        status = _ask(sock, encode_control(GetStatus(req=6)))
        assert status.state is AgentState.FAILED and status.error
    finally:
        ctx.destroy(linger=0)


def test_pings_and_status_are_answered_while_a_shard_load_is_held_half_way(tiny_llama_dir):
    """Loading runs on the worker: the control thread keeps answering pings while the load cannot
    finish (held half-way until the test has asked), and status says what is loading and how far
    it got. A gate, not a time bound: a control thread that waited for the load would answer
    nothing while it is held, however quick the host."""
    import threading
    import time

    from agents.executors import layers_executor
    from agents.protocol import LoadShard, Ok, PeerSpec

    held, release = threading.Event(), threading.Event()

    def held_real_load(model_dir, start, end, *, dtype, threads, progress=None):
        def holding(fraction):  # a disk that stalls half-way until released
            progress(fraction)
            if 0 < fraction < 1 and not held.is_set():
                held.set()
                release.wait(120)

        return layers_executor(model_dir, start, end, dtype=dtype, threads=threads, progress=holding)

    coordinator = CurveKeys.generate()
    agent = Agent("dev-a", coordinator.public, executor_factory=held_real_load).start()
    ctx, sock = _client(agent, coordinator)
    try:
        me = PeerSpec(device="dev-a", stage=0, data_address=agent.data_address, public_key=agent.keys.public)
        sock.send(encode_control(LoadShard(req=1, model_dir=tiny_llama_dir, stage=0, start=0, end=6, peers=(me,))))
        assert held.wait(60), "the load never reported a fraction between 0 and 1"
        pongs, statuses = 0, []
        for req in range(101, 111):  # each answered while the load is held: its reply cannot come first
            reply = _ask(sock, encode_control(Ping(req=req, t0=time.time()) if req % 2 else GetStatus(req=req)),
                         timeout_ms=30_000)  # an upper bound for a loaded host; the load is held 120 s
            assert reply is not None and reply.req == req, reply
            pongs += isinstance(reply, Pong)
            statuses += [reply] if isinstance(reply, AgentStatus) else []
        assert pongs == 5 and all(s.state is AgentState.LOADING for s in statuses), statuses
        assert all(s.activity.startswith("loading units [0, 6)") and 0 < s.progress < 1 for s in statuses)
        release.set()
        loaded = decode_control(sock.recv()) if sock.poll(60_000) else None
        assert isinstance(loaded, Ok) and loaded.req == 1, loaded
        final = _ask(sock, encode_control(GetStatus(req=7)))
        assert final.state is AgentState.READY and final.activity == "" and final.memory_bytes > 0
    finally:
        release.set()
        ctx.destroy(linger=0)
        agent.close()


def test_a_stopped_agent_does_not_wait_for_the_work_in_flight(agent):
    """Stopping (the studio quitting) abandons a step in flight: close returns while the worker
    is still busy, and the worker ends on its own once its item returns."""
    import threading
    from types import SimpleNamespace

    entered, release = threading.Event(), threading.Event()

    def busy_unload():
        entered.set()
        release.wait(30)

    agent._unload = busy_unload
    agent._work.put(("Unload", SimpleNamespace(req=1), None, None))
    assert entered.wait(30)
    assert agent.close(join_s=0.0) is False
    worker = next(t for t in agent._threads if t.name.startswith("agent-worker"))
    assert worker.is_alive()  # still in its item: close did not wait for it
    release.set()
    worker.join(30)
    assert not worker.is_alive()


def test_a_load_waiting_for_the_model_code_import_says_so_in_its_status_and_log(agent, tmp_path):
    from agents.model_code import MODEL_CODE_IMPORTED
    from agents.protocol import LoadShard, PeerSpec

    ctx, sock = _client(agent, agent.test_coordinator_keys)
    MODEL_CODE_IMPORTED.clear()  # as while a forked agent imports transformers in the background
    try:
        me = PeerSpec(device="dev-a", stage=0, data_address=agent.data_address, public_key=agent.keys.public)
        sock.send(encode_control(LoadShard(req=5, model_dir=str(tmp_path / "missing"), stage=0, start=0,
                                           end=3, peers=(me,))))
        import time

        status = None
        for req in range(6, 3006):  # until the worker has taken the load (at most ~30 s)
            status = _ask(sock, encode_control(GetStatus(req=req)))
            if status.activity:
                break
            time.sleep(0.01)
        assert "importing the model code" in status.activity
        MODEL_CODE_IMPORTED.set()
        reply = decode_control(sock.recv()) if sock.poll(30000) else None
        assert isinstance(reply, ErrorReply) and reply.req == 5  # the load itself went on once imported
        logs = _ask(sock, encode_control(GetLogs(req=4000, lines=50)))
        assert any("LoadShard waited" in line and "model code import" in line for line in logs.lines)
    finally:
        MODEL_CODE_IMPORTED.set()
        ctx.destroy(linger=0)
