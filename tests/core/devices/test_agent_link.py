"""The agent link alone (no coordinator, no run): requests to real agents, their failures."""

from __future__ import annotations

import time

import pytest

from agents.agent import Agent
from agents.protocol import GetStatus
from agents.transport import CurveKeys
from core.devices.agent_link import AgentEndpoint, AgentLink
from core.errors import RunFailed


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


def test_a_request_without_a_reply_is_a_run_failed_naming_the_device_and_is_forgotten(deaf_agent):
    with _deaf_link(deaf_agent) as link:
        with pytest.raises(RunFailed) as info:
            link.request("deaf", GetStatus(), timeout_s=0.3)
        assert info.value.device == "deaf" and "no reply to GetStatus" in str(info.value)
        assert link._pending == {}


def test_clock_sync_with_an_agent_that_does_not_answer_is_a_run_failed_naming_it(deaf_agent):
    with _deaf_link(deaf_agent) as link:
        with pytest.raises(RunFailed) as info:
            link.sync_clocks(samples=2, timeout_s=0.3)
        assert info.value.device == "deaf" and "clock probe" in str(info.value)
        assert link._pending == {}


def test_a_request_to_a_device_without_an_agent_is_a_run_failed_naming_it(deaf_agent):
    with _deaf_link(deaf_agent) as link:
        with pytest.raises(RunFailed) as info:
            link.request_async("elsewhere", GetStatus())
        assert info.value.device == "elsewhere"
        assert link._pending == {}


def test_a_live_agent_answers_its_status_and_gets_a_clock_estimate(agent_and_keys):
    agent, keys = agent_and_keys
    with AgentLink([AgentEndpoint("near", agent.control_address, agent.keys.public)], keys) as link:
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
        deadline = time.monotonic() + 5
        while not told and time.monotonic() < deadline:
            time.sleep(0.05)
        assert told == ["near"] and lost[0][0] == "near" and "no heartbeat" in lost[0][1]
        assert link.is_lost("near")
        with pytest.raises(RunFailed) as info:
            link.request("near", GetStatus(), timeout_s=0.3)
        assert info.value.device == "near"
