"""A re-plan after a lost device keeps the run's weight precision (the tokens after it stay those of
the same quantized model); a plan mixing precisions is refused by name instead of re-split."""

from __future__ import annotations

import msgspec
import pytest

from core.planning.plan import with_weights
from core.planning.scenarios import random_problem
from core.planning.solvers import edgeshard_optimal
from core.runs.recovery import ExactReplanner, RecoveryImpossible


def _plan_and_problem():
    problem = random_problem(3, devices=4, units=8, tightness=3.0)
    return edgeshard_optimal(problem), problem


def test_a_replanned_int4_run_keeps_every_stage_at_int4():
    plan, problem = _plan_and_problem()
    failed = plan.stages[-1].device
    usable = tuple(problem.profile.cluster.device_ids())
    replanned = ExactReplanner(problem)(with_weights(plan, "int4"), failed, usable)
    assert failed not in replanned.devices() and {s.weights for s in replanned.stages} == {"int4"}


def test_a_plan_mixing_precisions_is_not_replanned():
    plan, problem = _plan_and_problem()
    plan = with_weights(plan, "int8")
    mixed = msgspec.structs.replace(plan, stages=(msgspec.structs.replace(plan.stages[0], weights="fp"),
                                                  *plan.stages[1:]))
    if len(mixed.stages) < 2:
        pytest.skip("the solver put the model on one device")
    with pytest.raises(RecoveryImpossible, match="mixes weight precisions"):
        ExactReplanner(problem)(mixed, mixed.stages[-1].device, tuple(problem.profile.cluster.device_ids()))
