"""Training the demo model: real text from the fortunes package, a real HF checkpoint out,
progress through the reporter, and a child process that a cancel ends at once."""

from __future__ import annotations

import json
import threading
import time

import pytest

from core.errors import FormatError
from core.models.checkpoints import ModelRecipe
from core.models.training import (
    FORTUNES_DIR,
    TrainingSettings,
    fortune_lines,
    learning_rate_factor,
    prose_quotation,
    schedule_progress,
    train_in_subprocess,
    train_model,
    trained_steps,
)
from core.reporting import Cancelled, RecordingReporter

pytestmark = pytest.mark.skipif(not FORTUNES_DIR.is_dir(), reason="Debian package `fortunes` not installed")

TINY = ModelRecipe(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=1)


def test_fortune_lines_are_whole_quotations_one_per_line():
    lines = fortune_lines()
    assert len(lines) > 1000
    assert all("\n" not in line and 20 <= len(line) <= 400 for line in lines)


def test_a_missing_text_is_a_clear_error_naming_the_package(tmp_path):
    with pytest.raises(FormatError, match="fortunes"):
        fortune_lines(tmp_path)


def test_training_lowers_the_loss_and_writes_a_checkpoint_transformers_loads(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rep = RecordingReporter()
    lines = fortune_lines()[:400]
    # no time budget: the learning-rate schedule follows the steps alone, not this host's speed or load
    out = train_model(TINY, lines, tmp_path / "m", rep,
                      TrainingSettings(steps=60, batch=8, seq_len=32, threads=1, max_seconds=0.0))
    losses = [float(s.rsplit("loss ", 1)[1]) for s in rep.statuses if "loss " in s]
    assert losses[-1] < losses[0] - 0.5
    assert rep.progresses[-1] == (60, 60)
    info = json.loads((out / "training.json").read_text())
    assert info["steps"] == 60 and "fortunes" in info["text"]
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok(lines[0], return_tensors="pt").input_ids
    assert tok.decode(ids[0]) == lines[0]  # the tokenizer was trained on this text
    with torch.inference_mode():
        assert model(ids).logits.shape == (1, ids.shape[1], TINY.vocab)


def test_a_cancel_ends_the_training_process_at_once(tmp_path):
    rep = RecordingReporter()
    cancelled_at = []
    timer = threading.Timer(3.0, lambda: (cancelled_at.append(time.monotonic()), rep.cancel()))
    timer.start()
    with pytest.raises(Cancelled):
        train_in_subprocess(rep, TINY, tmp_path / "m", TrainingSettings(steps=100_000, threads=1))
    # from the cancel, not from the start (a loaded host starts the child late); 100,000 steps take
    # minutes, the kill a fraction of a second: 10 s is room for the load, not for the steps
    assert time.monotonic() - cancelled_at[0] < 10.0
    assert not (tmp_path / "m").exists()


def test_a_quotation_is_kept_as_plain_prose_without_its_attribution():
    assert prose_quotation("Noise proves  nothing.\n\t\t-- Mark Twain") == "Noise proves nothing."
    assert prose_quotation('"Imitation is the sincerest form of television."') == (
        "Imitation is the sincerest form of television.")


@pytest.mark.parametrize("entry", [
    "Q: Why did the chicken cross the road? A: To get to the other side.",  # dialogue
    "I think it is true for all _n, where n >= 3 holds.",  # markup and numbers
    "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG.",  # shouting
    "and then it was over, as they always said it would be",  # not a capitalised sentence
    "He said \"never and then he left the room for good.",  # unbalanced quotes
])
def test_what_is_not_plain_prose_is_left_out(entry):
    assert prose_quotation(entry) is None


def test_the_learning_rate_warms_up_then_decays_to_a_tenth_by_the_end_of_the_progress():
    assert learning_rate_factor(0, 10, 0.0) == pytest.approx(0.1)
    assert learning_rate_factor(9, 10, 0.01) == pytest.approx(1.0)
    assert learning_rate_factor(50, 10, 0.5) == pytest.approx(0.55)
    assert learning_rate_factor(50, 10, 1.0) == pytest.approx(0.1)


def test_progress_is_the_further_of_steps_and_time():
    s = TrainingSettings(steps=1000, max_seconds=100.0)
    assert schedule_progress(100, s, 50.0) == pytest.approx(0.5)  # a slow machine: time leads
    assert schedule_progress(800, s, 10.0) == pytest.approx(0.8)  # a fast one: steps lead


def test_the_time_budget_ends_training_early_and_the_checkpoint_records_the_steps_done(tmp_path):
    rep = RecordingReporter()
    out = train_model(TINY, fortune_lines()[:200], tmp_path / "m", rep,
                      TrainingSettings(steps=100_000, batch=2, seq_len=16, threads=1, max_seconds=1.0))
    info = json.loads((out / "training.json").read_text())
    assert 0 < info["steps"] < 100_000
    assert any("time budget reached" in s for s in rep.statuses)
    assert rep.progresses[-1] == (100_000, 100_000)


def test_the_training_process_lowers_its_own_priority_so_profiling_and_runs_keep_the_cores(tmp_path, monkeypatch):
    import os

    from core.models import training

    niced: list[int] = []
    monkeypatch.setattr(os, "nice", lambda inc: niced.append(inc) or inc)
    settings = json.dumps({"steps": 2, "batch": 2, "seq_len": 16, "threads": 1})
    assert training.main(["--out", str(tmp_path / "m"), "--recipe", json.dumps(TINY.__dict__),
                          "--settings", settings]) == 0
    assert niced == [TrainingSettings().niceness] and TrainingSettings().niceness > 0


def test_a_resumed_training_continues_from_the_checkpoints_weights_and_tokenizer(tmp_path):
    import torch
    from safetensors.torch import load_file

    lines = fortune_lines()[:200]
    settings = TrainingSettings(steps=4, batch=2, seq_len=16, threads=1)
    out = train_model(TINY, lines, tmp_path / "m", RecordingReporter(), settings)
    first = load_file(str(out / "model.safetensors"))
    tokenizer_before = (out / "tokenizer.json").read_text()
    rep = RecordingReporter()
    train_model(TINY, lines, out, rep, TrainingSettings(steps=3, batch=2, seq_len=16, threads=1), resume=True)
    assert trained_steps(out) == 7
    assert any("after its 4 steps" in s for s in rep.statuses)
    assert not any("training the tokenizer" in s for s in rep.statuses)
    assert (out / "tokenizer.json").read_text() == tokenizer_before
    second = load_file(str(out / "model.safetensors"))
    fresh = train_model(TINY, lines, tmp_path / "fresh", RecordingReporter(),
                        TrainingSettings(steps=3, batch=2, seq_len=16, threads=1))
    again = load_file(str(fresh / "model.safetensors"))
    name = next(k for k in second if k.endswith("q_proj.weight"))
    assert not torch.equal(second[name], first[name])  # it trained further
    assert not torch.equal(second[name], again[name])  # and not from scratch


def test_a_folder_without_a_training_record_counts_no_steps(tmp_path):
    assert trained_steps(tmp_path) == 0
    (tmp_path / "training.json").write_text("{not json")
    assert trained_steps(tmp_path) == 0


class _CancelAtFirstStep(RecordingReporter):
    """Cancels as soon as the training process reports its first step: a step is then in flight."""

    def progress(self, done: float, total: float) -> None:
        super().progress(done, total)
        if done > 0:
            self.cancel()


def test_quitting_during_a_resumed_training_cancels_it_and_keeps_the_checkpoint_loadable(tmp_path):
    from transformers import AutoModelForCausalLM

    out = train_model(TINY, fortune_lines()[:200], tmp_path / "m", RecordingReporter(),
                      TrainingSettings(steps=4, batch=2, seq_len=16, threads=1))
    rep = _CancelAtFirstStep()
    with pytest.raises(Cancelled):
        train_in_subprocess(rep, TINY, out, TrainingSettings(steps=100_000, batch=2, seq_len=16, threads=1),
                            resume=True)
    assert trained_steps(out) == 4  # the abandoned round wrote nothing over it
    AutoModelForCausalLM.from_pretrained(out)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no half-written checkpoint left beside it


def test_a_terminate_while_the_checkpoint_is_replaced_ends_the_process_right_after_it(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    done = tmp_path / "replaced"
    code = ("import os, signal, sys; from core.models.training import terminate_after\n"
            "with terminate_after():\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            f"    open({str(done)!r}, 'w').write('whole')\n"
            "print('after the block', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.read_text() == "whole"
    assert "after the block" not in proc.stdout
    assert proc.returncode == 128 + signal.SIGTERM
