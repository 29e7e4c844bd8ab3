"""``edgeshard run --draft DIR --speculate K`` refuses what it cannot run before any agent is
started: one line, exit 2 (the speculative run itself: tests/core/runs/test_speculative.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from core import formats
from core.models.checkpoints import ModelRecipe, make_model
from core.planning.plan import plan_from_boundaries


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-speculative")
    target = make_model(ModelRecipe(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3),
                        root / "target")
    other = root / "other"
    shutil.copytree(target, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 1024}))
    plan = root / "plan.json"
    formats.save(plan, plan_from_boundaries("target", 4, ["a", "b"], [2]))
    return target, other, plan


@pytest.mark.parametrize("extra, message", [
    (["--draft", "{other}"], "vocabulary of 1024 tokens, the target 512"),
    (["--draft", "{target}", "--speculate", "0"], "--speculate"),
    (["--speculate", "2"], "--speculate needs --draft DIR"),
    (["--draft", "{target}", "--repetition-penalty", "1.2"], "takes no --repetition-penalty"),
    (["--draft", "{target}", "--presence-penalty", "0.5"], "takes no --frequency-penalty, --presence-penalty"),
    (["--draft", "{target}", "--speculate", "auto"], "--speculate auto: invalid: needs --problem"),
    (["--draft", "{target}", "--speculate", "two"], "must be auto or an integer"),
    (["--draft", "{target}", "--prompt", "two"], "speculative decoding runs one prompt, got 2"),
    (["--draft", "{target}", "--draft-device", "c"], "--draft-device 'c' is not a device of the plan (a, b)"),
    (["--draft-device", "b"], "--draft-device needs --draft DIR"),
], ids=["another-vocabulary", "k-zero", "no-draft", "penalty", "openai-penalty", "auto-without-problem", "k-word", "two-prompts",
        "unknown-draft-device", "draft-device-without-draft"])
def test_a_speculative_run_it_cannot_do_is_refused_in_one_line_before_any_agent(files, extra, message):
    target, other, plan = files
    args = [a.format(target=target, other=other) for a in extra]
    proc = subprocess.run([sys.executable, "-m", "core.cli", "run", "--local", "--model", str(target), "--plan",
                           str(plan), "--prompt", "one", "--no-record", *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in proc.stderr
    assert "starting" not in proc.stdout + proc.stderr
