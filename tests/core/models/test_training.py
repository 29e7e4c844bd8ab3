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
    train_in_subprocess,
    train_model,
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
    out = train_model(TINY, lines, tmp_path / "m", rep, TrainingSettings(steps=60, batch=8, seq_len=32, threads=1))
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
    threading.Timer(3.0, rep.cancel).start()
    t0 = time.monotonic()
    with pytest.raises(Cancelled):
        train_in_subprocess(rep, TINY, tmp_path / "m", TrainingSettings(steps=100_000, threads=1))
    assert time.monotonic() - t0 < 3.0 + 2.0
    assert not (tmp_path / "m").exists()
