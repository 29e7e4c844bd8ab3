"""The agent link alone (no coordinator, no run): requests to real agents, their failures."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from agents.agent import Agent
from agents.protocol import (
    PROTOCOL_VERSION,
    ComputeOptions,
    ComputeProfile,
    ConvTimings,
    ErrorReply,
    GetStatus,
    LinkResult,
    Ok,
    ProfileResult,
    UnitTimes,
    encode_control,
)
from agents.transport import CurveKeys, curve_server, harden
from core.devices.agent_link import AgentEndpoint, AgentLink, profile_outcome, unexpected_profile_reply
from core.errors import AgentVersionMismatch, RunFailed


@pytest.fixture
def deaf_agent():
    """A real agent that only answers another coordinator's key: to us it never replies."""
    agent = Agent("deaf", CurveKeys.generate().public).start()
    yield agent
    agent.close()


@pytest.fixture
def agent_and_keys():
    keys = CurveKeys.generate()
    agent = Agent("near", keys.public).start()
    yield agent, keys
    agent.close()


def _deaf_link(agent) -> AgentLink:
    return AgentLink([AgentEndpoint("deaf", agent.control_address, agent.keys.public)], CurveKeys.generate())


REFUSED = "control socket would block (agent unreachable)"
"""The other way a deaf agent fails a request: its authenticator refuses our key, so libzmq drops the connection
after each handshake and makes another ~100 ms later; a request sent between the two has no peer to queue for
and fails at once (seen once in a full suite, where "no reply" is the usual outcome)."""


def test_a_request_without_a_reply_is_a_run_failed_naming_the_device_and_is_forgotten(deaf_agent):
    with _deaf_link(deaf_agent) as link:
        with pytest.raises(RunFailed) as info:
            link.request("deaf", GetStatus(), timeout_s=0.3)
        assert info.value.device == "deaf" and ("no reply to GetStatus within 0.3 s" in str(info.value)
                                                or REFUSED in str(info.value))
        assert link._pending == {}


def test_clock_sync_with_an_agent_that_does_not_answer_is_a_run_failed_naming_it(deaf_agent):
    with _deaf_link(deaf_agent) as link:
        with pytest.raises(RunFailed) as info:
            link.sync_clocks(samples=2, timeout_s=0.3)
        assert info.value.device == "deaf" and ("clock probe" in str(info.value) or REFUSED in str(info.value))
        assert link._pending == {}


def test_a_request_to_a_device_without_an_agent_is_a_run_failed_naming_it(deaf_agent):
    with _deaf_link(deaf_agent) as link:
        with pytest.raises(RunFailed) as info:
            link.request_async("elsewhere", GetStatus())
        assert info.value.device == "elsewhere"
        assert link._pending == {}


def test_a_live_agent_answers_its_status_and_gets_a_clock_estimate(agent_and_keys):
    agent, keys = agent_and_keys
    # no heartbeat probe after the first: one answered between sync_clocks and clock_of would refine
    # the estimate (a loaded host can deschedule the test between the two), and the two would differ
    with AgentLink([AgentEndpoint("near", agent.control_address, agent.keys.public)], keys,
                   heartbeat_interval_s=3600.0) as link:
        assert link.status()["near"].device == "near"
        clock = link.sync_clocks(samples=3)["near"]
        assert clock.rtt_s >= 0 and clock.uncertainty_s == clock.rtt_s / 2 and abs(clock.offset_s) < 1.0
        assert link.clock_of("near") == clock and not link.is_lost("near")


def test_an_agent_that_stops_answering_is_reported_lost_to_every_listener(agent_and_keys):
    agent, keys = agent_and_keys
    lost, told = [], []
    link = AgentLink([AgentEndpoint("near", agent.control_address, agent.keys.public)], keys,
                     heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5)
    link.add_lost_listener(lambda device, why: lost.append((device, why)))
    link.on_lost = told.append
    with link:
        link.status()
        agent.close()
        deadline = time.monotonic() + 30  # lost after 0.5 s of silence; the rest is room for a loaded host
        while not told and time.monotonic() < deadline:
            time.sleep(0.05)
        assert told == ["near"] and lost[0][0] == "near" and "no heartbeat" in lost[0][1]
        assert link.is_lost("near")
        with pytest.raises(RunFailed) as info:
            link.request("near", GetStatus(), timeout_s=0.3)
        assert info.value.device == "near"


class _ScriptedAgent:
    """A CurveZMQ control socket that answers each frame with ``answer(request as a map)``."""

    def __init__(self, answer) -> None:
        self.keys = CurveKeys.generate()
        self._answer = answer
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        harden(self._sock)
        curve_server(self._sock, self.keys, "control")
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.control_address = f"tcp://127.0.0.1:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(50):
                identity, frame = self._sock.recv_multipart()
                self._sock.send_multipart([identity, self._answer(msgspec.msgpack.decode(frame))])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._ctx.destroy(linger=0)


def _as_previous_version_agent(_request: dict) -> bytes:
    """What an agent of the previous protocol version answers to every frame of ours: it
    cannot read it, so ``ErrorReply(code="bad_version", req=0)`` in its own version (no pongs)."""
    old = PROTOCOL_VERSION - 1
    why = f"protocol version {PROTOCOL_VERSION} not supported (this agent speaks {old})"
    return msgspec.msgpack.encode({"type": "error", "v": old, "req": 0, "code": "bad_version", "message": why})


@pytest.fixture
def previous_version_agent():
    agent = _ScriptedAgent(_as_previous_version_agent)
    yield agent
    agent.close()


def test_an_agent_of_the_previous_version_is_refused_naming_both_versions_and_the_upgrade(previous_version_agent):
    old = previous_version_agent
    lost = []
    link = AgentLink([AgentEndpoint("old", old.control_address, old.keys.public)], CurveKeys.generate(),
                     heartbeat_timeout_s=30.0)  # the refusal itself, not a missed heartbeat, must end it
    link.add_lost_listener(lambda device, why: lost.append((device, why)))
    with link:
        with pytest.raises(AgentVersionMismatch) as info:
            link.status(timeout_s=10)
        err = info.value
        assert err.device == "old" and (err.received, err.supported) == (PROTOCOL_VERSION - 1, PROTOCOL_VERSION)
        assert str(err).startswith(f"old: the agent speaks protocol version {PROTOCOL_VERSION - 1}, "
                                   f"this studio speaks version {PROTOCOL_VERSION}")
        assert "edgeshard agents upgrade" in str(err)
        assert link.is_lost("old") and lost == [("old", err.reason)]
        refused = link.request_async("old", GetStatus())
        assert refused.done() and isinstance(refused.exception(), AgentVersionMismatch)  # refused here, unsent
        assert link._pending == {}


def test_a_profiling_reply_of_another_kind_than_asked_is_refused_naming_both():
    link_result = ProfileResult(result=LinkResult(role="send", probe_id="p"))
    assert unexpected_profile_reply(link_result, LinkResult) == ""
    assert "LinkResult, wanted a ConvTimings" in unexpected_profile_reply(link_result, ConvTimings)
    assert "unexpected reply Ok" in unexpected_profile_reply(Ok(), LinkResult)
    with pytest.raises(RunFailed, match="^dev: the agent answered with a LinkResult"):
        profile_outcome("dev", link_result, ConvTimings)


def test_a_compute_profile_comes_back_typed_from_a_real_agent(agent_and_keys):
    agent, keys = agent_and_keys
    config = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    with AgentLink([AgentEndpoint("near", agent.control_address, agent.keys.public)], keys) as link:
        profile = link.profile_compute("near", ComputeOptions(config=config, prompt_tokens=4, batch_sizes=(1,),
                                                              repeats=1, warmup=0), timeout_s=120)
    assert profile.device == "near" and [u.unit for u in profile.units] == [0, 1, 2]
    assert all(u.decode_s[0] > 0 for u in profile.units)


def test_a_profiling_reply_that_does_not_decode_fails_its_request_with_the_reason():
    def answer(request: dict) -> bytes:  # a compute profile with a NaN time, for the request it answers
        unit = UnitTimes(unit=0, decode_s=(float("nan"),), decode_spread=(0.0,), prefill_s=(1e-3,),
                         prefill_spread=(0.0,), param_bytes=1)
        profile = ComputeProfile(device="odd", decode_batch_sizes=(1,), prefill_token_counts=(4,), units=(unit,),
                                 memory_budget_bytes=1, memory_total_bytes=1, memory_available_bytes=1,
                                 accelerator="", threads=1, seconds=0.1)
        return encode_control(ProfileResult(req=request.get("req", 0), result=profile))

    odd = _ScriptedAgent(answer)
    try:
        with AgentLink([AgentEndpoint("odd", odd.control_address, odd.keys.public)], CurveKeys.generate(),
                       heartbeat_timeout_s=30.0) as link:
            with pytest.raises(RunFailed) as info:
                link.profile_compute("odd", ComputeOptions(config={"model_type": "llama"}), timeout_s=20)
            assert info.value.device == "odd" and "does not decode (bad_message)" in str(info.value)
            assert "unit 0" in str(info.value) and link._pending == {}
    finally:
        odd.close()


def test_a_holder_heard_between_two_polls_is_told_from_a_silent_one_by_the_time_between_them():
    from core.devices.agent_link import holder_heard_between_polls

    assert not holder_heard_between_polls(0.15, None)  # the first poll cannot tell
    # heartbeats and polls both ~0.2 s apart: the sampled silence creeps up (0.15 after 0.10) but a
    # heartbeat came in between, which comparing the two silences missed
    assert holder_heard_between_polls(0.15, 0.21)
    assert not holder_heard_between_polls(0.95 + 0.21, 0.21)  # silent: its silence grew by the interval
