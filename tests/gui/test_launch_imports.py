"""The studio opens without importing torch (issue item 9: launch-to-ready): torch took most of
the launch's import time and is first needed when a run frames a tensor (agents.transport)."""

from __future__ import annotations

import os
import subprocess
import sys


def test_opening_the_studio_window_and_demo_imports_no_torch_nor_the_epd_optimiser():
    code = ("import sys; import gui.main_window, gui.demo, gui.launch; "
            "print(sorted(m for m in ('torch', 'transformers', 'optuna') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
