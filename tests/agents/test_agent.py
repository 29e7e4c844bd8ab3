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
    AgentStatus,
    ErrorReply,
    GetLogs,
    GetStatus,
    Logs,
    Ping,
    Pong,
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
        assert isinstance(status, AgentStatus) and status.req == 9 and status.state == "idle"
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
        status = _ask(sock, encode_control(GetStatus(req=6)))
        assert status.state == "failed" and status.error
    finally:
        ctx.destroy(linger=0)
