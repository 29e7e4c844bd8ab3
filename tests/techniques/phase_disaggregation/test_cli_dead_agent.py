"""`edgeshard epd run` and `epd profile` with a dead agent in the agents file (killed, still listed) fail
with one line naming it at once (nothing listens at its port; a silent host: after the 3-s answer time)
(before: 30 s of silence). Real agent processes, one cluster for the module."""

from __future__ import annotations

import pytest

from core.formats import save
from core.techniques.phase_disaggregation.types import PoolConfig
from core.techniques.phase_disaggregation.workload import poisson_workload
from tests.entrances import cluster_with_a_dead_agent, refused


@pytest.fixture(scope="module")
def dead_cluster(tmp_path_factory):
    """(the agents file of a0 alive and a1 killed, pools over both, a one-request workload)."""
    tmp = tmp_path_factory.mktemp("epd-dead")
    pools, workload = tmp / "pools.json", tmp / "workload.json"
    save(pools, PoolConfig(disaggregation="pd", encode=("a0",), prefill=("a0",), decode=("a1",)))
    save(workload, poisson_workload(rate_rps=1.0, requests=1, seed=0))
    with cluster_with_a_dead_agent(tmp / "cluster", ["a0", "a1"], "a1") as agents:
        yield agents, pools, workload


def test_epd_run_names_a_dead_agent_within_the_answer_time(dead_cluster, model, tmp_path, capsys):
    agents, pools, workload = dead_cluster
    err = refused(["epd", "run", "--agents", agents, "--model", model, "--pools", pools, "--workload", workload,
                   "--workspace", tmp_path / "ws.sqlite"], capsys)
    assert "a1: no answer and nothing listens at tcp://127.0.0.1:" in err


def test_epd_profile_of_every_agent_names_a_dead_one_before_measuring(dead_cluster, model, tmp_path, capsys):
    agents, _, _ = dead_cluster
    err = refused(["epd", "profile", "--agents", agents, "--model", model, "--out", tmp_path / "costs.json"], capsys)
    assert "a1: no answer and nothing listens at tcp://127.0.0.1:" in err and not (tmp_path / "costs.json").exists()


def test_epd_profile_refuses_an_agent_the_agents_file_does_not_list(
        dead_cluster, model, tmp_path, capsys):
    agents, _, _ = dead_cluster
    err = refused(["epd", "profile", "--agents", agents, "--model", model, "--devices", "a0,ghost", "--out",
                   tmp_path / "costs.json"], capsys)
    assert "no agent named ghost, which --devices names (agents: a0, a1)" in err
