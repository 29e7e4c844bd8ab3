"""MoE expert offloading (EdgeMoE): experts on storage, a bounded expert buffer, preloading.

Parts: ``problem`` (model sizes/times, memory budget, storage bandwidth, bit options),
``cost`` (the one cost model), ``strategies`` (EdgeMoE's planner and the paper's baselines
IO-FREE, IO-EXP, IO-QEXP, STI), ``simulator`` (the shared TimelineEvents, expert reads on a
storage lane), ``scenarios``. The agent side is ``agents.techniques.expert_offload`` (stage kind
``expert-offload``). docs/expert-offload.md explains them.
"""

from __future__ import annotations

from core.models.units import ModelSpec
from core.techniques import Technique, cli_of
from core.techniques.expert_offload.cost import evaluate
from core.techniques.expert_offload.problem import OffloadPlan, OffloadProblem
from core.techniques.expert_offload.simulator import simulate
from core.techniques.expert_offload.strategies import STRATEGIES, OffloadOutcome, run_strategy

NAME = "expert-offload"
STAGE_KIND = "expert-offload"


def _applies(model: ModelSpec) -> bool:
    """Mixture-of-Experts models only."""
    return model.family == "mixtral"


def _replanner(problem, model_dir):
    from core.techniques.expert_offload.recovery import OffloadReplanner

    return OffloadReplanner(problem, model_dir)


def _run_plan(plan, model_dir, bandwidth_bps=None):
    from core.techniques.expert_offload.running import run_plan

    return run_plan(plan, model_dir, bandwidth_bps)


TECHNIQUE = Technique(
    name=NAME,
    title="MoE expert offloading (EdgeMoE)",
    paper="EdgeMoE: Fast On-Device Inference of MoE-based Large Language Models (2023)",
    applies_to=_applies,
    stage_kinds=(STAGE_KIND,),
    strategies=STRATEGIES,
    exact="edgemoe",
    run_strategy=run_strategy,
    cost=evaluate,
    simulate=simulate,
    register_cli=cli_of("core.techniques.expert_offload.cli"),
    run_plan=_run_plan,
    replanner=_replanner,
    modes=("sequential",),
    problem_type=OffloadProblem,
    plan_type=OffloadPlan,
)

__all__ = ["NAME", "STRATEGIES", "TECHNIQUE", "OffloadOutcome", "run_strategy"]
