"""Output paths are checked before the work that writes them: `experiment --out FILE` (before: the
experiment ran, 39 s for `algorithms`, then ``File exists``) and `make-model` into a file are one
line, exit 2."""

from __future__ import annotations

import pytest

from tests.entrances import refused


def test_an_experiment_into_a_file_is_refused_before_it_runs(tmp_path, capsys, monkeypatch):
    import core.cli.experiments

    monkeypatch.setattr(core.cli.experiments, "run_experiment",
                        lambda *_a, **_k: pytest.fail("the experiment ran before --out was checked"))
    file = tmp_path / "results"
    file.write_text("x")
    err = refused(["experiment", "algorithms", "--out", file, "--quiet"], capsys)
    assert "--out" in err and "is a file: give a folder" in err


def test_an_experiment_below_a_file_is_refused_before_it_runs(tmp_path, capsys, monkeypatch):
    import core.cli.experiments

    monkeypatch.setattr(core.cli.experiments, "run_experiment",
                        lambda *_a, **_k: pytest.fail("the experiment ran before --out was checked"))
    (tmp_path / "file").write_text("x")
    err = refused(["experiment", "table-iv", "--out", tmp_path / "file" / "out", "--quiet"], capsys)
    assert "cannot be written" in err


def test_make_model_into_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    err = refused(["make-model", tmp_path / "file", "--family", "llama", "--layers", "2", "--hidden", "32",
                   "--heads", "2", "--vocab", "300"], capsys)
    assert "OUT_DIR" in err and "is a file" in err
