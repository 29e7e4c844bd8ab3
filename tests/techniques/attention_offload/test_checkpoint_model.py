"""The attention-offloading cost model's view of a checkpoint is read from its config.json without
importing transformers or torch (the studio's Plan screen builds it in its GUI thread), and equals
what transformers' own AutoConfig gives for every supported family."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from core.techniques.attention_offload.run import checkpoint_model

DEMO_LLAMA = Path(__file__).resolve().parents[3] / "resources" / "demo_models" / "demo-llama"


def test_reading_a_llama_checkpoints_geometry_imports_neither_transformers_nor_torch():
    code = ("import sys; from core.techniques.attention_offload.run import checkpoint_model; "
            f"m = checkpoint_model({str(DEMO_LLAMA)!r}); "
            "print(m.layers, sorted(x for x in ('torch', 'transformers') if x in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "6 []"


def test_each_families_geometry_equals_transformers_autoconfigs(tiny_model_dirs):
    from transformers import AutoConfig

    for family, model_dir in {**tiny_model_dirs, "demo-llama": str(DEMO_LLAMA)}.items():
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        heads, hidden = config.num_attention_heads, config.hidden_size
        model = checkpoint_model(model_dir)
        assert (model.layers, model.hidden, model.q_heads, model.kv_heads, model.head_dim, model.vocab) == (
            config.num_hidden_layers, hidden, heads, getattr(config, "num_key_value_heads", None) or heads,
            getattr(config, "head_dim", None) or hidden // heads, config.vocab_size), family
        assert model.intermediate == (getattr(config, "intermediate_size", None) or 4 * hidden), family
