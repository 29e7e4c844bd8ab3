"""What the zygote imports before forking leaves no model code for each forked agent to import again."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_warm_imports_include_the_model_base_an_agent_would_otherwise_import_at_its_first_profile():
    code = ("import sys\n"
            "from agents.model_code import warm_imports\n"
            "warm_imports()\n"
            "print('transformers.modeling_utils' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
