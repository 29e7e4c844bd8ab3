"""`edgeshard spatial run` with a dead agent in the agents file (killed, still listed) fails with one
line naming it at once (nothing listens at its port; a silent host: after the 3-s answer time) (before: 30 s of silence). Real agent processes."""

from __future__ import annotations

from core.formats import save
from tests.entrances import cluster_with_a_dead_agent, refused
from tests.techniques.spatial.conftest import make_problem


def test_spatial_run_names_a_dead_agent_within_the_answer_time(tmp_path, capsys):
    save(tmp_path / "problem.json", make_problem((4.0, 2.0)))
    with cluster_with_a_dead_agent(tmp_path / "cluster", ["d0", "d1"], "d1") as agents:
        err = refused(["spatial", "run", tmp_path / "problem.json", "--agents", agents, "--strategy", "even",
                       "--images", "1", "--workspace", tmp_path / "ws.sqlite"], capsys)
    assert "d1: no answer and nothing listens at tcp://127.0.0.1:" in err
