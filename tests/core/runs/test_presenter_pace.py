"""Presenter pace (``GenerationSettings.ignore_eos``): a run generates every one of max_new_tokens past
the model's end-of-text token, the same tokens as transformers' generate with no EOS."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agents.agent import Agent
from agents.transport import CurveKeys
from core.models.checkpoints import ModelRecipe, make_model
from core.planning.plan import plan_from_boundaries
from core.runs.coordinator import AgentEndpoint, Coordinator
from core.runs.generation import GenerationSettings, generate, load_tokenizer

PROMPTS = ["the cat sat", "hello there"]
TOKENS = 10


@pytest.fixture(scope="module")
def run_setup(tmp_path_factory):
    """(coordinator, plan, model dir, transformers' tokens with no EOS): the checkpoint's EOS is made the
    third token greedy decoding gives the first prompt, so a plain run stops early."""
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = make_model(ModelRecipe(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3),
                           tmp_path_factory.mktemp("pace") / "tiny-llama")
    enc = load_tokenizer(str(model_dir))(PROMPTS, return_tensors="pt", padding=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=TOKENS, do_sample=False, pad_token_id=0)
    reference = [tuple(r) for r in out[:, enc["input_ids"].shape[1]:].tolist()]
    config = Path(model_dir) / "generation_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "eos_token_id": reference[0][2]}))
    keys = CurveKeys.generate()
    agents = [Agent(d, keys.public).start() for d in ("a", "b")]
    coordinator = Coordinator([AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents], keys)
    coordinator.open()
    plan = plan_from_boundaries("tiny-llama", 4, ["a", "b"], [2])
    coordinator.load(plan, str(model_dir))
    yield coordinator, plan, str(model_dir), reference
    coordinator.close()
    for a in agents:
        a.close()


def test_presenter_pace_generates_transformers_tokens_past_eos(run_setup):
    coordinator, plan, model_dir, reference = run_setup
    plain = generate(coordinator, plan, model_dir, PROMPTS, GenerationSettings(max_new_tokens=TOKENS), load=False)
    assert len(plain.result.tokens[0]) == 3  # the first prompt's run ends at its EOS without the pace
    paced = generate(coordinator, plan, model_dir, PROMPTS, GenerationSettings(max_new_tokens=TOKENS, ignore_eos=True),
                     load=False)
    assert [tuple(t) for t in paced.result.tokens] == reference and len(reference[0]) == TOKENS


def test_presenter_pace_leaves_the_eos_token_out_of_the_text(run_setup):
    coordinator, plan, model_dir, reference = run_setup
    paced = generate(coordinator, plan, model_dir, PROMPTS[:1],
                     GenerationSettings(max_new_tokens=TOKENS, ignore_eos=True), load=False)
    tok = load_tokenizer(model_dir)
    assert paced.texts[0] == tok.decode([t for t in reference[0] if t != reference[0][2]], skip_special_tokens=True)
