"""Which models the demo starts with: the shipped ones, one for every technique it tours."""

from __future__ import annotations

from core.models import demo_models
from core.reporting import NullReporter


def test_the_demo_starts_with_the_shipped_llama_and_names_a_model_for_every_technique():
    from gui import demo_model

    assert demo_model.ensure_demo_model(NullReporter()) == demo_models.shipped("llama")
    assert not demo_model.needs_more_training()
    models = demo_model.demo_checkpoints()
    assert set(models) == set(demo_model.DEMO_TECHNIQUE_MODELS)
    assert models["expert-offload"] == str(demo_models.shipped("moe"))
    assert models["phase-disaggregation"] == str(demo_models.shipped("llava"))
