"""An agent builds the executor of the stage kind a LoadShard names (agents.executors), so a
technique's agent side plugs in by registering (agents.registry); an unknown kind is refused,
naming the known ones."""

from __future__ import annotations

import pytest

from agents.agent import Agent
from agents import registry
from agents.executors import executor_factory_for
from agents.protocol import AgentState, ErrorReply, GetStatus, LoadShard, Ok, PeerSpec, encode_control
from agents.transport import CurveKeys
from tests.agents.test_agent import _ask, _client
from tests.techniques.whole_model_agent import AGENT_TECHNIQUE, STAGE_KIND, WholeModelExecutor


@pytest.fixture
def agent_and_socket():
    coordinator = CurveKeys.generate()
    agent = Agent("dev-a", coordinator.public).start()
    ctx, sock = _client(agent, coordinator)
    me = PeerSpec(device="dev-a", stage=0, data_address=agent.data_address, public_key=agent.keys.public)
    yield agent, sock, me
    ctx.destroy(linger=0)
    agent.close()


def test_layers_is_the_shipped_stage_kind():
    assert executor_factory_for("layers").__name__ == "layers_executor"


def test_a_registered_stage_kind_is_loaded_with_its_own_executor(agent_and_socket, tiny_llama_dir):
    agent, sock, me = agent_and_socket
    registry.register(AGENT_TECHNIQUE)
    try:
        reply = _ask(sock, encode_control(LoadShard(req=1, model_dir=tiny_llama_dir, stage=0, start=0, end=6,
                                                    peers=(me,), kind=STAGE_KIND)), timeout_ms=60000)
        assert isinstance(reply, Ok), reply
        assert isinstance(agent._loaded.executor, WholeModelExecutor)
        assert _ask(sock, encode_control(GetStatus(req=2))).state is AgentState.READY
    finally:
        registry.unregister(AGENT_TECHNIQUE.name)


def test_an_unknown_stage_kind_is_refused_naming_the_kinds_this_agent_runs(agent_and_socket, tiny_llama_dir):
    agent, sock, me = agent_and_socket
    reply = _ask(sock, encode_control(LoadShard(req=1, model_dir=tiny_llama_dir, stage=0, start=0, end=6,
                                                peers=(me,), kind="attention-offload")), timeout_ms=30000)
    if isinstance(reply, Ok):
        pytest.fail("an unknown stage kind was loaded")
    status = reply if not isinstance(reply, ErrorReply) else _ask(sock, encode_control(GetStatus(req=3)))
    text = reply.message if isinstance(reply, ErrorReply) else status.error
    assert "attention-offload" in text and "layers" in text
