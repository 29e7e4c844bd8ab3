"""`edgeshard run --torch-device DEVICE=WHERE`: where a stage computes, over the plan's own
(``Stage.torch_device``). A GPU its agent does not report is refused in one line naming the agent
before any stage is loaded; a malformed or stray choice before any agent is started."""

from __future__ import annotations

import pytest

from core.sessions.store import SessionStore
from tests.core.cli.test_cli_run import DEVICES, cli_run_files, run_cli
from tests.entrances import forbid_agents, refused


def test_a_run_placing_a_stage_on_the_cpu_by_name_completes_and_records_the_plan_with_it(tmp_path):
    model, plan = cli_run_files(tmp_path)
    workspace = tmp_path / "ws.sqlite"
    code, out = run_cli(["run", "--model", model, "--plan", plan, "--local", "--prompt", "the river",
                         "--max-new-tokens", "3", "--torch-device", f"{DEVICES[1]}=cpu", "--workspace", workspace])
    assert code == 0, out
    with SessionStore(workspace) as store:
        [session] = store.sessions()
        [run] = store.runs(session.id)
        assert [s.torch_device for s in store.plan(run.plan_id).stages] == ["cpu", "cpu"]
    assert run.status == "completed" and run.figures["tokens"] == 3


def test_a_cuda_stage_on_an_agent_without_a_gpu_is_refused_in_one_line_naming_the_agent(tmp_path, capsys):
    model, plan = cli_run_files(tmp_path)
    code, out = run_cli(["run", "--model", model, "--plan", plan, "--local", "--prompt", "x", "--no-record",
                         "--torch-device", f"{DEVICES[1]}=cuda:0"])
    err = capsys.readouterr().err.splitlines()  # the agents' start is reported above it
    assert code == 2 and out == "" and err[-1].startswith("edgeshard: error: ")
    assert f"{DEVICES[1]}: stage 1 asked to compute on cuda:0" in err[-1] and "torch sees no CUDA device" in err[-1]
    assert not any(line.startswith("edgeshard: error") for line in err[:-1])


@pytest.mark.parametrize("choice, words", [("edge-1=gpu", "cpu, cuda or cuda:N"), ("cuda:0", "DEVICE=WHERE")])
def test_a_malformed_torch_device_is_refused_by_the_parser(tmp_path, monkeypatch, capsys, choice, words):
    forbid_agents(monkeypatch)
    model, plan = cli_run_files(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        run_cli(["run", "--model", model, "--plan", plan, "--local", "--prompt", "x", "--torch-device", choice])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and words in err


def test_a_torch_device_for_a_device_the_plan_does_not_use_is_refused_before_any_agent_starts(
        tmp_path, monkeypatch, capsys):
    forbid_agents(monkeypatch)
    model, plan = cli_run_files(tmp_path)
    line = refused(["run", "--model", model, "--plan", plan, "--local", "--prompt", "x",
                    "--torch-device", "edge-9=cpu"], capsys)
    assert "no stage on edge-9" in line
