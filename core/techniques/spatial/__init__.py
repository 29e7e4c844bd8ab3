"""CNN spatial partitioning (EdgeMI): each convolution layer's map cut into vertical strips.

A CNN (VGG16, a ResNet-style net; ``agents.techniques.spatial.network``) runs on several devices at once: the
gateway scatters each device its strip with halo columns, the devices compute it through one
layer or a fused group of layers, the gateway gathers and runs the fully connected head.
Parts: ``problem`` (problem, plan, time model fit), ``cost`` (the one cost model),
``partition`` (even, BODP, CBPS, fused tiles, device count), ``strategies`` (Compare's rows),
``simulator``, ``scenarios``, ``cli``. docs/spatial.md explains them.
"""

from __future__ import annotations

from agents.techniques.spatial.network import STAGE_KIND
from core.models.units import ModelSpec
from core.techniques import Technique, cli_of
from core.techniques.spatial.cost import evaluate
from core.techniques.spatial.problem import SpatialPlan, SpatialProblem
from core.techniques.spatial.simulator import simulate
from core.techniques.spatial.strategies import STRATEGIES, SpatialOutcome, run_strategy

NAME = "spatial"


def _applies(model: ModelSpec) -> bool:
    """CNNs only: the LLM unit tables of the other techniques are never spatially partitioned."""
    return model.family == "cnn"


def _run_plan_file(args, agents) -> int:
    from core.techniques.spatial.cli import run_plan_file

    return run_plan_file(args, agents)


TECHNIQUE = Technique(
    name=NAME,
    title="Spatial CNN partitioning (EdgeMI)",
    paper="EdgeMI: CNN inference on multiple edge devices by spatial partitioning (Beijing Jiaotong University)",
    applies_to=_applies,
    stage_kinds=(STAGE_KIND,),
    strategies=STRATEGIES,
    exact="fused",
    run_strategy=run_strategy,
    cost=evaluate,
    simulate=simulate,
    register_cli=cli_of("core.techniques.spatial.cli"),
    plan_format="edgeshard.spatial-plan",
    run_plan_file=_run_plan_file,
    modes=("sequential",),
    problem_type=SpatialProblem,
    plan_type=SpatialPlan,
)

__all__ = ["NAME", "STRATEGIES", "TECHNIQUE", "SpatialOutcome", "run_strategy"]
