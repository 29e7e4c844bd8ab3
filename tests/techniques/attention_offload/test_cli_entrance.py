"""`edgeshard attention-offload run` checks the model, the memory devices against its key/value heads
and the workspace before it starts any agent: one line, exit 2 (before: 5 memory devices for a
2-head model started 6 agents and failed at load, 34 s; a folder as workspace failed after them)."""

from __future__ import annotations

from tests.agents.conftest import tiny_llama_dir, tiny_model_dirs  # noqa: F401  (fixtures)
from tests.entrances import forbid_agents, refused


def test_more_memory_devices_than_key_value_heads_are_refused_before_agents_start(tiny_llama_dir, capsys,
                                                                                   monkeypatch):
    forbid_agents(monkeypatch)
    err = refused(["attention-offload", "run", "--local", "--model", tiny_llama_dir, "--compute", "c0",
                   "--memory", "m0,m1,m2,m3,m4", "--prompt", "x", "--no-record"], capsys)
    assert "--memory" in err and "5 attention sides for 2 key/value heads" in err


def test_a_folder_as_workspace_is_refused_before_agents_start(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    forbid_agents(monkeypatch)
    err = refused(["attention-offload", "run", "--local", "--model", tiny_llama_dir, "--compute", "c0",
                   "--memory", "m0", "--prompt", "x", "--workspace", tmp_path], capsys)
    assert "is a directory, expected a workspace file" in err


def test_an_unsupported_model_is_refused_before_agents_start(tmp_path, capsys, monkeypatch):
    forbid_agents(monkeypatch)
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    err = refused(["attention-offload", "run", "--local", "--model", tmp_path, "--compute", "c0", "--memory", "m0",
                   "--prompt", "x", "--no-record"], capsys)
    assert "unsupported model family" in err
