"""`edgeshard attention-offload run` with a dead memory agent in the agents file (killed, still listed)
fails with one line naming it at once (nothing listens at its port; a silent host: after the 3-s answer time), before torch is imported and before any
agent is set to work (it named it by a lost heartbeat after loading the dense stage: 86 s at load 17).
Real agent processes."""

from __future__ import annotations

from agents.protocol import AgentState
from tests.entrances import cluster_with_a_dead_agent, refused


def test_attention_offload_run_names_a_dead_memory_agent_within_the_answer_time(tiny_llama_dir, tmp_path, capsys):
    from core.devices.local_cluster import load_agents_file
    from core.devices.agent_link import AgentLink

    with cluster_with_a_dead_agent(tmp_path / "cluster", ["c0", "m0", "m1"], "m1") as agents:
        err = refused(["attention-offload", "run", "--model", tiny_llama_dir, "--agents", agents, "--compute", "c0",
                       "--memory", "m0,m1", "--prompt", "x", "--no-record"], capsys)
        endpoints, keys = load_agents_file(agents)
        with AgentLink([e for e in endpoints if e.device == "c0"], keys) as link:
            state = link.wait_ready(timeout_s=5)["c0"].state
    assert "m1: no answer and nothing listens at tcp://127.0.0.1:" in err
    assert state is AgentState.IDLE  # the dense stage was never loaded
