"""`edgeshard epd run` with a dead agent in the agents file (killed, still listed) fails with one line
naming it at once (nothing listens at its port; a silent host: after the 3-s answer time) (before: 30 s of silence). Real agent processes."""

from __future__ import annotations

from core.formats import save
from core.techniques.phase_disaggregation.types import PoolConfig
from core.techniques.phase_disaggregation.workload import poisson_workload
from tests.entrances import cluster_with_a_dead_agent, refused


def test_epd_run_names_a_dead_agent_within_the_answer_time(model, tmp_path, capsys):
    pools, workload = tmp_path / "pools.json", tmp_path / "workload.json"
    save(pools, PoolConfig(disaggregation="pd", encode=("a0",), prefill=("a0",), decode=("a1",)))
    save(workload, poisson_workload(rate_rps=1.0, requests=1, seed=0))
    with cluster_with_a_dead_agent(tmp_path / "cluster", ["a0", "a1"], "a1") as agents:
        err = refused(["epd", "run", "--agents", agents, "--model", model, "--pools", pools, "--workload", workload,
                       "--workspace", tmp_path / "ws.sqlite"], capsys)
    assert "a1: no answer and nothing listens at tcp://127.0.0.1:" in err
