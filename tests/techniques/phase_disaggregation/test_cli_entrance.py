"""`edgeshard epd run|profile` check the pools, the model, the agents' names, the workspace and the
output path before connecting to any agent: one line, exit 2 (before: a workspace that is a folder
failed after the whole run, a Llama checkpoint was refused by the agents after loading, 10-22 s)."""

from __future__ import annotations

import pytest

from core.formats import save
from core.techniques.phase_disaggregation.types import PoolConfig
from core.techniques.phase_disaggregation.workload import poisson_workload
from tests.agents.conftest import tiny_model_dirs  # noqa: F401  (fixture)
from tests.entrances import forbid_agents, refused, unreachable_agents_file


@pytest.fixture
def files(tmp_path, monkeypatch):
    """(agents file listing a0, a1; pools over a0, a1; a one-request workload); no agent may start."""
    forbid_agents(monkeypatch)
    pools, workload = tmp_path / "pools.json", tmp_path / "workload.json"
    save(pools, PoolConfig(disaggregation="pd", encode=("a0",), prefill=("a0",), decode=("a1",)))
    save(workload, poisson_workload(rate_rps=1.0, requests=1, seed=0))
    return unreachable_agents_file(tmp_path, ["a0", "a1"]), pools, workload


def test_epd_run_refuses_a_pool_device_without_an_agent(files, model, tmp_path, capsys):
    agents, _, workload = files
    pools = tmp_path / "ghost-pools.json"
    save(pools, PoolConfig(disaggregation="pd", encode=("a0",), prefill=("a0",), decode=("ghost",)))
    err = refused(["epd", "run", "--agents", agents, "--model", model, "--pools", pools, "--workload", workload,
                   "--workspace", tmp_path / "ws.sqlite"], capsys)
    assert "no agent named ghost" in err and "a0, a1" in err


def test_epd_run_refuses_a_folder_as_workspace_before_the_run(files, model, tmp_path, capsys):
    agents, pools, workload = files
    err = refused(["epd", "run", "--agents", agents, "--model", model, "--pools", pools, "--workload", workload,
                   "--workspace", tmp_path], capsys)
    assert "is a directory, expected a workspace file" in err


@pytest.mark.parametrize("verb", ["run", "profile"])
def test_epd_refuses_a_model_that_is_not_llava_from_its_config(verb, files, tmp_path, capsys, tiny_model_dirs):
    agents, pools, workload = files
    extra = ["--workload", workload, "--workspace", tmp_path / "ws.sqlite"] if verb == "run" else \
        ["--out", tmp_path / "costs.json"]
    err = refused(["epd", verb, "--agents", agents, "--model", tiny_model_dirs["llama"], "--pools", pools, *extra],
                  capsys)
    assert "is not 'llava'" in err


def test_epd_profile_refuses_an_output_folder_before_profiling(files, model, tmp_path, capsys):
    agents, pools, _ = files
    err = refused(["epd", "profile", "--agents", agents, "--model", model, "--pools", pools, "--out", tmp_path],
                  capsys)
    assert "--out" in err and "is a folder" in err


def test_epd_make_model_into_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    err = refused(["epd", "make-model", "--out", tmp_path / "file"], capsys)
    assert "--out" in err and "is a file" in err
