"""A command's first contact with its agents (``AgentLink.answering``): an agent whose port refuses
connections (killed, crashed) is named at once, not after the answer time; one whose port accepts but
never answers (a hung agent, a wrong key) is named when the answer time has passed. Real sockets."""

from __future__ import annotations

import socket
import time

import pytest

from agents.transport import CurveKeys
from core.devices.agent_link import AgentLink, refuses_connections
from core.errors import RunFailed
from core.runs.coordinator import AgentEndpoint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _link(address: str) -> AgentLink:
    return AgentLink([AgentEndpoint("edge-a", address, CurveKeys.generate().public)], CurveKeys.generate())


def test_a_port_nothing_listens_at_refuses_and_a_listening_one_does_not():
    port = _free_port()
    assert refuses_connections(f"tcp://127.0.0.1:{port}")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert not refuses_connections(f"tcp://127.0.0.1:{server.getsockname()[1]}")
    assert not refuses_connections("ipc:///tmp/x")


def test_an_agent_whose_port_refuses_is_named_at_once():
    address = f"tcp://127.0.0.1:{_free_port()}"
    with _link(address) as link:
        t = time.monotonic()
        with pytest.raises(RunFailed) as err:
            link.answering(timeout_s=30.0)
        assert time.monotonic() - t < 15.0  # not the 30 s answer time (room for a loaded host)
    assert err.value.device == "edge-a" and f"nothing listens at {address}" in str(err.value)


def test_an_agent_that_accepts_but_never_answers_is_named_after_the_answer_time():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with _link(f"tcp://127.0.0.1:{server.getsockname()[1]}") as link:
            t = time.monotonic()
            with pytest.raises(RunFailed) as err:
                link.answering(timeout_s=0.8)
            assert time.monotonic() - t >= 0.8
    assert err.value.device == "edge-a" and "did not answer within" in str(err.value)


def test_offline_agents_are_named_with_why_a_refusing_one_at_once_a_silent_host_after_its_wait():
    from core.devices.agent_link import unanswering_agents

    refusing = f"tcp://127.0.0.1:{_free_port()}"
    keys = CurveKeys.generate()
    t = time.monotonic()
    why = unanswering_agents([AgentEndpoint("edge-a", refusing, keys.public)], keys, timeout_s=60.0)
    assert time.monotonic() - t < 30.0  # not the 60 s a silent host gets (room for a loaded host)
    assert why == {"edge-a": f"nothing listens at {refusing}: its agent is not running"}
    with socket.socket() as server:  # accepts, never answers: a hung agent or a silent host
        server.bind(("127.0.0.1", 0))
        server.listen()
        silent = f"tcp://127.0.0.1:{server.getsockname()[1]}"
        t = time.monotonic()
        why = unanswering_agents([AgentEndpoint("edge-a", refusing, keys.public),
                                  AgentEndpoint("edge-b", silent, keys.public)], keys, timeout_s=0.8)
        assert time.monotonic() - t >= 0.8
    assert list(why) == ["edge-a", "edge-b"] and why["edge-b"].startswith("no answer within 0.8 s")
