"""bench/serve.py refuses a bad argument while the command line is parsed: one line naming the option, exit
status 2, no traceback, before any server, model or agent is started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from core.models.checkpoints import ModelRecipe, make_model

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "serve.py"


@pytest.mark.parametrize(("argv", "option"), [
    (["--rounds", "-1"], "--rounds"),
    (["--new-tokens", "x"], "--new-tokens"),
    (["--stages", "4"], "--stages"),
    (["--stages", "2,2"], "--stages"),
    (["--baseline", "/nonexistent-checkout"], "--baseline"),
    (["--model", "/nonexistent-model"], "--model"),
])
def test_a_bad_argument_is_one_line_and_exit_2(argv, option):
    got = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=60)
    assert got.returncode == 2
    assert "Traceback" not in got.stderr
    last = got.stderr.strip().splitlines()[-1]
    assert last.startswith("serve.py: error: argument ") and option in last, last
    assert got.stdout == ""


def test_a_model_of_another_depth_is_refused(tmp_path):
    model = make_model(ModelRecipe(family="llama", layers=4, hidden=32, heads=2, kv_heads=1, vocab=512, seed=1),
                       tmp_path / "four")
    got = subprocess.run([sys.executable, str(SCRIPT), "--model", str(model)], capture_output=True, text=True,
                         timeout=60)
    assert got.returncode == 2 and "has 4 blocks" in got.stderr


def test_a_config_without_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 6}')
    got = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tmp_path)], capture_output=True, text=True,
                         timeout=60)
    last = got.stderr.strip().splitlines()[-1]
    assert got.returncode == 2 and "Traceback" not in got.stderr and "not a checkpoint the agents can run" in last
