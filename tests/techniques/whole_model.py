"""A small technique that lives only in the tests: the whole model on the one best device.

It proves the seam on every floor: it plugs in with ``core.techniques.register`` and, on the
agents, ``agents.registry.register`` (its room ``whole_model_agent``: a stage kind, a control
message and a data-frame kind of its own) alone — no shared module names it — and then shows
up in the registry, the CLI and Compare, simulates into the shared TimelineEvents that
recording, replay and export take as they are, and runs for real on agents.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from core.devices.profile import Profile
from core.errors import EdgeShardError
from core.models.units import ModelSpec
from core.planning.problem import PlanningProblem
from core.runs.metrics import RunFigures, compute_figures
from core.techniques import Technique
from core.techniques.outcomes import PerTokenOutcome
from agents.protocol import TimelineEvent, TokenEvent
from tests.techniques.whole_model_agent import STAGE_KIND, WholeModelExecutor  # noqa: F401  (its agent side)



class WholeModelPlan(msgspec.Struct, frozen=True, kw_only=True):
    format: Literal["test.whole-model-plan"] = "test.whole-model-plan"
    version: int = 1
    device: str
    units: int


class WholeModelCost(msgspec.Struct, frozen=True, kw_only=True):
    latency_per_token_s: float
    prefill_s: float
    fits: bool


class WholeModelOutcome(PerTokenOutcome, frozen=True, kw_only=True):
    plan: WholeModelPlan | None = None
    cost: WholeModelCost | None = None


def cost(problem: PlanningProblem, plan: WholeModelPlan) -> WholeModelCost:
    """Its own cost model: every unit on one device, no transfers."""
    profile: Profile = problem.profile
    times = profile.times_of(plan.device)
    decode = sum(unit[0] for unit in times.decode_s)
    prefill = sum(unit[-1] for unit in times.prefill_s)
    need = profile.model.param_bytes
    budget = next(d.memory_bytes for d in profile.cluster.devices if d.id == plan.device)
    return WholeModelCost(latency_per_token_s=decode, prefill_s=prefill, fits=need <= budget)


def _fastest(problem: PlanningProblem, objective: str) -> WholeModelPlan:
    """Exact for this technique: try every device, keep the fastest that fits."""
    units = problem.profile.model.num_units
    plans = [WholeModelPlan(device=d.id, units=units) for d in problem.profile.cluster.devices]
    fitting = [p for p in plans if cost(problem, p).fits]
    if not fitting:
        raise EdgeShardError("the model fits on no single device")
    return min(fitting, key=lambda p: cost(problem, p).latency_per_token_s)


def _source(problem: PlanningProblem, objective: str) -> WholeModelPlan:
    return WholeModelPlan(device=problem.source, units=problem.profile.model.num_units)


STRATEGIES = {"fastest-device": _fastest, "source-only": _source}


def run_strategy(problem, name, objective, time_limit_s=30.0, *, reporter=None) -> WholeModelOutcome:
    try:
        plan = STRATEGIES[name](problem, objective)
    except EdgeShardError as err:
        return WholeModelOutcome.failed(name, objective, str(err))
    c = cost(problem, plan)
    status = ("optimal" if name == "fastest-device" else "ok") if c.fits else "oom"
    return WholeModelOutcome(strategy=name, objective=objective, status=status, plan=plan, cost=c)


class WholeModelSimulation(msgspec.Struct, frozen=True, kw_only=True):
    events: tuple[TimelineEvent, ...]
    tokens: tuple[TokenEvent, ...]
    figures: RunFigures


def simulate(problem: PlanningProblem, plan: WholeModelPlan, mode: str = "sequential", *,
             generated_tokens: int | None = None, **_) -> WholeModelSimulation:
    """Its own schedule: prefill then one decode step per token, all on one device."""
    c = cost(problem, plan)
    g = generated_tokens or problem.workload.generated_tokens
    batch = problem.workload.batch_size
    events, tokens, t = [], [], 0.0
    for step in range(g):
        dur = c.prefill_s if step == 0 else c.latency_per_token_s
        phase = "prefill" if step == 0 else "decode"
        events.append(TimelineEvent(device=plan.device, stage=0, kind="compute", phase=phase, step=step,
                                    micro_batch=0, start_s=t, end_s=t + dur))
        t += dur
        tokens.append(TokenEvent(micro_batch=0, step=step, sequence_ids=tuple(range(batch)),
                                 token_ids=(0,) * batch, t_s=t))
    return WholeModelSimulation(events=tuple(events), tokens=tuple(tokens),
                                figures=compute_figures(events, tokens))


def _applies(model: ModelSpec) -> bool:
    return model.family in ("llama", "mistral", "qwen2")


TECHNIQUE = Technique(
    name="whole-model", title="Whole model on one device (test technique)", applies_to=_applies,
    stage_kinds=(STAGE_KIND,), strategies=STRATEGIES, exact="fastest-device", run_strategy=run_strategy,
    cost=cost, simulate=simulate, modes=("sequential",),
)
