"""A plugged-in technique runs for real through the shared coordinator: its plan's stage is
loaded as its own stage kind, the agent builds the technique's executor (not agents.shard),
and the tokens equal the unpartitioned model's greedy ``generate()``."""

from __future__ import annotations

import pytest
import transformers  # noqa: F401  (imported once here: agents' worker threads import it concurrently)

from agents import registry
from core.models.checkpoints import ModelRecipe, make_model
from core.planning.plan import plan_from_boundaries
from core.runs.coordinator import RunRequest
from core.runs.generation import load_tokenizer
from tests.core.hf_reference import hf_greedy_new_tokens
from tests.core.in_process_agents import in_process_cluster
from tests.techniques.whole_model_agent import AGENT_TECHNIQUE, STAGE_KIND, WholeModelExecutor

PROMPTS = ["the cat sat", "a longer prompt about the river", "hello"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    recipe = ModelRecipe(family="llama", layers=3, hidden=64, heads=4, kv_heads=2, vocab=512, seed=5)
    return str(make_model(recipe, tmp_path_factory.mktemp("whole") / "tiny-llama"))


@pytest.fixture
def whole_model_agent():
    registry.register(AGENT_TECHNIQUE)
    with in_process_cluster(["box"]) as (coordinator, (agent,)):
        yield coordinator, agent
    registry.unregister(AGENT_TECHNIQUE.name)


def test_a_plugged_in_technique_runs_on_an_agent_with_its_own_executor_and_exact_tokens(whole_model_agent, model_dir):
    coordinator, agent = whole_model_agent
    units = 3 + 2  # embedding + 3 blocks + head (core.models.units)
    plan = plan_from_boundaries("tiny-llama", units, ["box"], [])
    coordinator.load(plan, model_dir, kind=STAGE_KIND)
    assert isinstance(agent._loaded.executor, WholeModelExecutor)

    tok = load_tokenizer(model_dir)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    result = coordinator.run(plan, RunRequest(
        input_ids=tuple(map(tuple, enc["input_ids"].tolist())),
        attention_mask=tuple(map(tuple, enc["attention_mask"].tolist())),
        max_new_tokens=6, eos_token_ids=(2,), pad_token_id=0))
    assert list(result.tokens) == hf_greedy_new_tokens(model_dir, enc, 6)
    assert {e.device for e in result.events} == {"box"} and any(e.kind == "compute" for e in result.events)
