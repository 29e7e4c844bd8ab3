"""A draft distilled from its target (``core.models.draft_distillation``): it starts as the target's
ends, ships its held-out acceptance rate, and the shipped demo draft is small and agrees often."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from core.models import demo_models
from core.models.draft_distillation import SPECULATION_FILE, distill_draft, draft_of, stored_acceptance
from core.models.training import TrainingSettings
from tests.agents.conftest import tiny_llama_dir, tiny_model_dirs  # noqa: F401  (the tiny checkpoints)

LINES = [f"The {w} of the day is a {v} thing to see." for w in ("end", "start", "light", "sound", "rest")
         for v in ("fine", "rare", "good", "small")]


def test_a_draft_starts_as_the_targets_embedding_first_and_last_blocks_and_head(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    draft = draft_of(target, 2)
    n = target.config.num_hidden_layers
    assert draft.config.num_hidden_layers == 2
    t, d = target.state_dict(), draft.state_dict()
    assert torch.equal(d["model.embed_tokens.weight"], t["model.embed_tokens.weight"])
    assert torch.equal(d["lm_head.weight"], t["lm_head.weight"])
    assert torch.equal(d["model.layers.0.mlp.up_proj.weight"], t["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(d["model.layers.1.mlp.up_proj.weight"], t[f"model.layers.{n - 1}.mlp.up_proj.weight"])


def test_a_distilled_draft_is_a_checkpoint_with_the_targets_tokenizer_and_its_measured_acceptance(tiny_llama_dir,
                                                                                                 tmp_path):
    out = distill_draft(tiny_llama_dir, LINES, tmp_path / "draft", layers=1,
                        settings=TrainingSettings(steps=3, batch=4, seq_len=12, threads=1), continuation_tokens=6)
    stored = json.loads((out / SPECULATION_FILE).read_text())
    assert 0.0 <= stored["acceptance_rate"] <= 1.0 and stored["sequences"] > 0
    assert stored_acceptance(out) == stored["acceptance_rate"]
    assert json.loads((out / "tokenizer.json").read_text()) == json.loads(
        (Path(tiny_llama_dir) / "tokenizer.json").read_text())


def test_the_shipped_demo_draft_is_small_of_one_or_two_blocks_and_stores_its_acceptance_rate():
    folder = demo_models.shipped("llama-draft")
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] in (1, 2) and config["vocab_size"] == 4096
    assert demo_models.folder_bytes(folder) < 4_000_000
    assert stored_acceptance(folder) > 0.5
