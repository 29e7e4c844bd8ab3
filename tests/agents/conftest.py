"""Tiny real checkpoints of every supported family, generated once per test session."""

from __future__ import annotations

import pytest

from core.models.checkpoints import FAMILIES, ModelRecipe, make_model

TINY_LAYERS = 4
"""4 blocks → 6 units, enough for 4 uneven stages."""


def tiny_recipe(family: str, **overrides) -> ModelRecipe:
    values = dict(family=family, layers=TINY_LAYERS, hidden=64, heads=4, vocab=512, seed=7)
    if family != "gpt2":
        values["kv_heads"] = 2
    values.update(overrides)
    return ModelRecipe(**values)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    """family → directory of a 4-block, hidden-64 generated checkpoint (real tokenizer)."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {family: str(make_model(tiny_recipe(family), root / family)) for family in FAMILIES}


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dirs) -> str:
    return tiny_model_dirs["llama"]
