"""An agent serves one coordinator's work at a time: while a spatial session, an attention hold or a
layer-sharded run holds it, other work is refused at once with ``busy`` naming what it serves and
whose it is, and the agent takes new work as soon as that ends (two real coordinators' control
sockets on one agent)."""

from __future__ import annotations

import time

import pytest
from msgspec import structs

import agents.lease as lease_module
from agents.agent import Agent
from agents.protocol import (
    AgentState,
    AgentStatus,
    ConvSweepOptions,
    ErrorReply,
    GetStatus,
    LoadShard,
    Ok,
    PeerSpec,
    ProfileCompute,
    StopRun,
    Unload,
)
from agents.techniques.attention_offload.messages import HoldHeads
from agents.techniques.spatial.messages import SpatialNet, SpatialSetup
from agents.techniques.spatial.network import network_for
from agents.transport import CurveKeys
from tests.agents.test_agent_runs import _Control, _start

NET = SpatialNet(network="vgg16", image=32, width_div=8, classes=10)


@pytest.fixture
def agent_and_two_coordinators():
    """One agent and two coordinators (separate control connections with the coordinator key)."""
    keys = CurveKeys.generate()
    agent = Agent("a", keys.public).start()
    first, second = _Control(agent, keys), _Control(agent, keys)
    yield agent, first, second
    first.close()
    second.close()
    agent.close()


def _me(agent: Agent) -> PeerSpec:
    return PeerSpec(device=agent.device, stage=0, data_address=agent.data_address, public_key=agent.keys.public)


def _session(agent: Agent, run_id: str, req: int, lease_s: float = 0.0) -> SpatialSetup:
    """The agent alone as the gateway of a one-tile spatial run (it computes every column)."""
    net = network_for(NET.network, NET.image, NET.width_div, NET.classes, NET.seed)
    layers = net.spec.layers
    return SpatialSetup(req=req, run_id=run_id, net=NET, devices=(_me(agent),), gateway=agent.device,
                        groups=((0, len(layers)),), widths=((layers[-1].w_out,),), lease_s=lease_s)


def _load(agent: Agent, model_dir: str, req: int) -> LoadShard:
    return LoadShard(req=req, model_dir=model_dir, stage=0, start=0, end=6, peers=(_me(agent),))


def _busy(reply) -> str:
    assert isinstance(reply, ErrorReply) and reply.code == "busy", reply
    return reply.message


def test_a_spatial_session_refuses_another_coordinators_load_session_and_hold_at_once_naming_itself(
        agent_and_two_coordinators, tiny_llama_dir):
    agent, first, second = agent_and_two_coordinators
    assert isinstance(first.ask(_session(agent, "s1", 1)), Ok)
    for req, msg in enumerate([_load(agent, tiny_llama_dir, 0), _session(agent, "s2", 0),
                               HoldHeads(run_id="h", model_dir=tiny_llama_dir, kv_start=0, kv_stop=1, dense=(_me(agent),)),
                               ProfileCompute(options=ConvSweepOptions())], start=2):
        # refused at once, not queued behind the session: it has no lease and is never stopped here, so
        # work queued behind it would get no answer and ask() would fail (the bound is for a loaded host)
        why = _busy(second.ask(structs.replace(msg, req=req), 30))
        assert "spatial run s1 of vgg16" in why and "another coordinator" in why, why
    seen = second.ask(GetStatus(req=9))
    assert isinstance(seen, AgentStatus) and seen.held_by == "another coordinator" and "spatial run s1" in seen.activity
    assert first.ask(GetStatus(req=10)).held_by == "you"


def test_once_the_session_is_stopped_another_coordinator_loads_a_stage(agent_and_two_coordinators, tiny_llama_dir):
    agent, first, second = agent_and_two_coordinators
    assert isinstance(first.ask(_session(agent, "s1", 1)), Ok)
    assert isinstance(first.ask(StopRun(req=2, run_id="s1")), Ok)
    assert isinstance(second.ask(_load(agent, tiny_llama_dir, 3), 60), Ok)
    assert second.ask(GetStatus(req=4)).held_by == "you"


def test_a_stop_that_names_no_run_does_not_end_another_coordinators_leased_session(agent_and_two_coordinators):
    agent, first, second = agent_and_two_coordinators
    assert isinstance(first.ask(_session(agent, "s1", 1, lease_s=30.0)), Ok)
    assert "stop a run it did not name" in _busy(second.ask(StopRun(req=2)))
    assert agent._state is AgentState.RUNNING
    assert isinstance(second.ask(StopRun(req=3, run_id="s1")), Ok)  # naming the run stops it, from anyone
    assert second.ask(GetStatus(req=4)).state is AgentState.IDLE


def test_a_stop_of_another_run_is_answered_at_once_while_a_session_runs(agent_and_two_coordinators):
    agent, first, second = agent_and_two_coordinators
    assert isinstance(first.ask(_session(agent, "s1", 1)), Ok)
    # answered while the session (no lease, never stopped here) runs: an answer queued behind it
    # would never come and ask() would fail; 30 s is room for a loaded host, not for the session
    assert isinstance(second.ask(StopRun(req=2, run_id="gone"), 30), Ok)
    assert agent._state is AgentState.RUNNING


def test_a_layer_sharded_run_refuses_a_spatial_session_and_takes_it_once_the_run_is_over(
        agent_and_two_coordinators, tiny_llama_dir):
    agent, first, second = agent_and_two_coordinators
    assert isinstance(first.ask(_load(agent, tiny_llama_dir, 1), 60), Ok)
    assert isinstance(first.ask(_start("long", 2, 3000)), Ok)
    why = _busy(second.ask(_session(agent, "s1", 3), 30))
    assert "layers run long" in why and "another coordinator" in why, why
    assert "unload" in _busy(second.ask(Unload(req=4), 30))
    assert isinstance(first.ask(StopRun(req=5, run_id="long"), 30), Ok)  # answered once the run is over
    assert isinstance(first.ask(_session(agent, "s1", 6)), Ok)  # its own coordinator may switch technique
    assert any("unloading its layers stage" in line for line in agent._logs)


def test_a_stage_whose_coordinator_still_speaks_is_not_replaced_by_another_coordinators_session(
        agent_and_two_coordinators, tiny_llama_dir, monkeypatch):
    # "still speaks": silent for less than LOADER_SILENT_S since its load request; at the default 5 s a
    # load on a loaded host can outlast that, so the test sets what "still" means
    monkeypatch.setattr(lease_module, "LOADER_SILENT_S", 120.0)
    agent, first, second = agent_and_two_coordinators
    assert isinstance(first.ask(_load(agent, tiny_llama_dir, 1), 60), Ok)
    why = _busy(second.ask(_session(agent, "s1", 2), 30))
    assert "a loaded layers stage (units [0, 6)" in why and "another coordinator" in why, why
    assert agent._state is AgentState.READY and agent._loaded is not None


def test_a_stage_whose_coordinator_went_silent_may_be_replaced_by_a_session(
        agent_and_two_coordinators, tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(lease_module, "LOADER_SILENT_S", 0.3)
    agent, first, second = agent_and_two_coordinators
    assert isinstance(first.ask(_load(agent, tiny_llama_dir, 1), 60), Ok)
    time.sleep(0.5)
    assert isinstance(second.ask(_session(agent, "s1", 2), 10), Ok)
    assert agent._loaded is None


def test_a_session_that_fails_to_start_leaves_the_agent_free_for_another_coordinator(
        agent_and_two_coordinators, tiny_llama_dir):
    agent, first, second = agent_and_two_coordinators
    ok = _session(agent, "s1", 1)
    bad = structs.replace(ok, widths=((ok.widths[0][0] + 1,),))  # does not fit the network
    reply = first.ask(bad, 10)
    assert isinstance(reply, ErrorReply) and reply.code == "failed", reply
    assert isinstance(second.ask(_load(agent, tiny_llama_dir, 2), 60), Ok)
