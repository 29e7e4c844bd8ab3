"""Encode / prefill / decode disaggregation (EPD) for multimodal models: three pools of devices.

Each phase of a multimodal request gets its own pool: encode (the vision tower turns image
tiles into multimodal tokens, one request's tiles split over several encoders: IRP), prefill
(builds the KV cache and the first token) and decode (continuous batching). Parts: ``types``
(requests, workloads, phase costs, pool configurations, per-request metrics, SLOs — shared by
the simulator, the search and the real run), ``workload``, ``simulator`` (the three pools,
discrete-event), ``goodput``, ``search`` (optuna over the simulator), ``baselines``
(aggregated, PD-only; Compare's rows), ``scenarios``, ``cli``. docs/phase-disaggregation.md
explains them.
"""

from __future__ import annotations

from typing import Any

from agents.techniques.phase_disaggregation.kinds import COUPLED_KINDS, KINDS  # not agents.techniques.phase_disaggregation.phases: that imports torch
from core.models.units import ModelSpec
from core.techniques import Technique, cli_of
from core.techniques.phase_disaggregation.baselines import STRATEGIES, EpdOutcome, run_strategy
from core.techniques.phase_disaggregation.search import evaluate
from core.techniques.phase_disaggregation.simulator import EpdSimulation, simulate_pools
from core.techniques.phase_disaggregation.types import EpdProblem, PoolConfig

NAME = "phase-disaggregation"
STAGE_KINDS = tuple(KINDS.values()) + tuple(COUPLED_KINDS.values())
"""The agents' executors for the three phases (``agents.techniques.phase_disaggregation.phases``)."""


def _applies(model: ModelSpec) -> bool:
    """Image–text models with a vision tower (transformers' Llava family)."""
    return model.family == "llava"


def simulate(problem: EpdProblem, plan: PoolConfig, mode: str = "pools", **_: Any) -> EpdSimulation:
    """The problem's workload through the plan's pools, with the shared timeline and tokens."""
    problem.check_config(plan)
    return simulate_pools(problem.costs, problem.workload, plan, record=True)


TECHNIQUE = Technique(
    name=NAME,
    title="Encode/prefill/decode disaggregation (EPD)",
    paper="Efficiently serving large multimedia models using EPD Disaggregation (Huawei, 2025)",
    applies_to=_applies,
    stage_kinds=STAGE_KINDS,
    strategies=STRATEGIES,
    exact="search",
    run_strategy=run_strategy,
    cost=evaluate,
    simulate=simulate,
    register_cli=cli_of("core.techniques.phase_disaggregation.cli"),
    modes=("pools",),
    problem_type=EpdProblem,
    plan_type=PoolConfig,
)

__all__ = ["NAME", "STAGE_KINDS", "STRATEGIES", "TECHNIQUE", "EpdOutcome", "run_strategy", "simulate"]
