"""The demo's shipped models: small, of their kinds, and what the demo starts with."""

from __future__ import annotations

import json

import torch

from core.models import demo_models
from tests.agents.conftest import tiny_llama_dir, tiny_model_dirs  # noqa: F401  (the tiny checkpoints)


def test_the_shipped_models_are_a_few_megabytes_each_trained_and_of_their_kind():
    kinds = {"llama": "llama", "moe": "mixtral", "llava": "llava"}
    for kind, model_type in kinds.items():
        folder = demo_models.shipped(kind)
        assert json.loads((folder / "config.json").read_text())["model_type"] == model_type
        assert json.loads((folder / "training.json").read_text())["steps"] > 100
        assert demo_models.folder_bytes(folder) < 6_000_000, kind
    total = sum(demo_models.folder_bytes(demo_models.shipped(k)) for k in (*kinds, "cnn"))
    assert total < 12_000_000


def test_fp16_shipping_halves_the_weights_and_loads_as_float32_with_the_rounded_weights(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = demo_models.ship_fp16(tiny_llama_dir, tmp_path / "fp16")
    stored = load_file(str(next(out.glob("*.safetensors"))))
    assert {t.dtype for t in stored.values() if t.is_floating_point()} == {torch.float16}
    assert json.loads((out / "config.json").read_text()).get("dtype", "float32") == "float32"
    full = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    half = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert next(half.parameters()).dtype == torch.float32
    name, weight = next((n, p) for n, p in full.named_parameters() if p.dim() == 2)
    assert torch.equal(dict(half.named_parameters())[name], weight.half().float())
