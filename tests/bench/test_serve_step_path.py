"""bench.serve_step_path: a served level's span in its own steady cycles (``level_in_cycles``), the warm-up before
it left out; a bad argument refused while the command line is parsed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.serve_step_path import level_in_cycles

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


@pytest.mark.parametrize(("argv", "option"), [(["--clients", "0"], "--clients"), (["--threads", "1,x"], "--threads"),
                                              (["--tree", "/nonexistent-checkout"], "--tree")])
def test_a_bad_argument_is_one_line_and_exit_2(argv, option):
    got = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=60)
    last = got.stderr.strip().splitlines()[-1]
    assert got.returncode == 2 and "Traceback" not in got.stderr and option in last, got.stderr
