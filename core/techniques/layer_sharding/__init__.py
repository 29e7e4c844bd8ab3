"""Layer sharding (EdgeShard): contiguous ranges of a decoder's units on a chain of devices.

The first technique, re-expressed through the seam. Its parts predate the seam and live in
the wings they grew in (``core.planning`` holds its problem, plan, cost model and solvers;
``core.runs.simulator`` its simulated schedule, the one ``agents.schedule`` the agents run;
``agents.shard`` its executor). This module is the one place that names them as a technique.
"""

from __future__ import annotations

from agents.protocol import RUN_MODES
from core.models.units import SUPPORTED_FAMILIES, ModelSpec
from core.planning.cost import evaluate
from core.planning.plan import ShardPlan
from core.planning.problem import PlanningProblem
from core.planning.solvers import STRATEGIES
from core.planning.solvers.comparison import compare_names, run_strategy
from core.runs.simulator import simulate
from core.techniques import Technique

STAGE_KIND = "layers"
"""A stage holds units [start, end) of the model: embedding, decoder blocks, norm + head."""


def _decoder_llm(model: ModelSpec) -> bool:
    return model.family in SUPPORTED_FAMILIES


TECHNIQUE = Technique(
    name="layer-sharding",
    title="Layer sharding (EdgeShard)",
    paper="Zhang et al., EdgeShard: efficient LLM inference via collaborative edge computing, 2024",
    applies_to=_decoder_llm,
    stage_kinds=(STAGE_KIND,),
    strategies=STRATEGIES,
    exact="edgeshard",
    run_strategy=run_strategy,
    cost=evaluate,
    simulate=simulate,
    modes=tuple(RUN_MODES),
    compare_names=compare_names,
    problem_type=PlanningProblem,
    plan_type=ShardPlan,
)
