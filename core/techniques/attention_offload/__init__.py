"""Attention offloading (Lamina): dense parts on compute devices, attention and KV on memory devices.

Parts: ``problem`` (devices with a price, model geometry, plan), ``cost`` (the one cost model),
``planner`` (exact search, Lamina's rule, homogeneous and layer-sharding baselines),
``simulator`` (fixed and rotational staggered pipelining into TimelineEvents), ``scenarios``,
``measured`` (the problem from a layer-sharding profile) and ``probe`` (its memory agents' attention
measured by a short run of the technique).
The agent side is agents/techniques/attention_offload/. docs/attention-offload.md explains them.
"""

from __future__ import annotations

from core.models.units import ModelSpec
from core.techniques import Technique, cli_of
from core.techniques.attention_offload.planner import STRATEGIES, OffloadOutcome, cost_of, run_strategy
from core.techniques.attention_offload.problem import OffloadPlan, OffloadProblem
from core.techniques.attention_offload.simulator import simulate

NAME = "attention-offload"
DENSE_KIND = "attention-offload-dense"
MEMORY_KIND = "attention-offload-memory"
"""The stage kinds of agents.techniques.attention_offload (agents never import core, so they are spelled twice;
a test holds them equal)."""


def _applies(model: ModelSpec) -> bool:
    """Decoder LLMs whose blocks call transformers' attention registry (tested families)."""
    return model.family in ("llama", "mistral", "qwen2", "gpt2")


def _run_plan(plan, model_dir):
    from core.techniques.attention_offload.run import run_plan

    return run_plan(plan, model_dir)


def _run_generation(coordinator, plan, model_dir, prompts, settings, *, sink=None, reporter=None, options=None, **_):
    from core.techniques.attention_offload.run import OffloadRunOptions, generate_offload

    return generate_offload(coordinator, plan, model_dir, prompts, settings, sink=sink, reporter=reporter,
                            options=OffloadRunOptions.of(options or {}))


TECHNIQUE = Technique(
    name=NAME,
    title="Attention offloading (Lamina)",
    paper="Efficient and Economic Large Language Model Inference with Attention Offloading (Tsinghua, 2024)",
    applies_to=_applies,
    stage_kinds=(DENSE_KIND, MEMORY_KIND),
    strategies=STRATEGIES,
    exact="exact",
    run_strategy=run_strategy,
    cost=cost_of,
    simulate=simulate,
    modes=("rotational", "fixed"),
    register_cli=cli_of("core.techniques.attention_offload.cli"),
    run_plan=_run_plan,
    run_generation=_run_generation,
    problem_type=OffloadProblem,
    plan_type=OffloadPlan,
)

__all__ = ["NAME", "STRATEGIES", "TECHNIQUE", "OffloadOutcome", "run_strategy"]
