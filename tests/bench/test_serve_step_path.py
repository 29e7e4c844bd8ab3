"""bench.serve_step_path: a served level's span in its own steady cycles (``level_in_cycles``), the warm-up before
it left out; the plan's stages hot in one process (``HotStages``: its tokens are transformers' ``generate``'s) and
the served forwards over them; a bad argument refused while the command line is parsed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.serve import PROMPTS
from bench.serve_step_path import HotStages, hot_figures, level_in_cycles, stage_units

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "serve_step_path.py"


def test_a_level_is_its_span_over_its_median_cycle_after_the_warm_up():
    warm_up = [(9.0, 9.002), (9.004, 9.006)]
    starts = [10.0 + 0.005 * i + (0.005 if i >= 5 else 0.0) for i in range(10)]  # one cycle of 10 ms, nine of 5
    level = [(t, t + 0.002) for t in starts]
    got = level_in_cycles(warm_up + level)
    assert got["level_steps"] == 10
    assert got["level_cycles"] == round((starts[-1] + 0.002 - 10.0) / 0.005, 1)  # 10.4: the median gap is 5 ms


def test_a_level_of_one_step_has_no_cycle():
    assert level_in_cycles([(1.0, 1.1)]) == {"level_steps": 1, "level_cycles": None}
    assert level_in_cycles([]) == {"level_steps": 0, "level_cycles": None}


def test_the_hot_stages_decode_what_transformers_generate_does(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core.models.checkpoints import ModelRecipe, make_model

    model = make_model(ModelRecipe(family="llama", layers=6, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3),
                       tmp_path / "m")
    got = HotStages(model, stage_units(3)).steps(5, evict_mib=1)
    tok = AutoTokenizer.from_pretrained(model)
    tok.padding_side = "left"
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    ref = AutoModelForCausalLM.from_pretrained(model).eval().generate(
        **enc, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=2)
    assert got["tokens"].tolist() == ref[:, enc["input_ids"].shape[1]:].tolist()
    assert len(got["stage_s"]) == 3 and all(s > 0 for s in got["stage_s"])


def test_served_forwards_are_read_over_the_hot_ones_per_stage_and_summed():
    served = {0: {"compute": 1500.0}, 1: {"compute": 2000.0}}
    got = hot_figures(served, {"stage_s": [0.001, 0.0016]}, {"stage_s": [0.0012, 0.0018]})
    assert got == {"hot_stage_us": [1000.0, 1600.0], "compute_over_hot": [1.5, 1.25, 1.35],
                   "evicted_stage_us": [1200.0, 1800.0]}
    assert "compute_over_hot" not in hot_figures({0: {}}, {"stage_s": [0.001]}, None)


@pytest.mark.parametrize(("argv", "option"), [(["--clients", "0"], "--clients"), (["--threads", "1,x"], "--threads"),
                                              (["--tree", "/nonexistent-checkout"], "--tree"),
                                              (["--evict-mib", "48"], "--evict-mib")])
def test_a_bad_argument_is_one_line_and_exit_2(argv, option):
    got = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=60)
    last = got.stderr.strip().splitlines()[-1]
    assert got.returncode == 2 and "Traceback" not in got.stderr and option in last, got.stderr
