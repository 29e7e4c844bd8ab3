"""Hand edits of a shard plan, as pure functions (the plan editor's undoable commands).

Each edit returns a new plan and keeps the stages contiguous and non-empty; whether
the result is a *good* plan (source device, memory, links) is for ``core.planning.cost.evaluate``
to say, so the editor can show a violation instead of refusing the edit.
An edit the shape cannot take (an empty stage, an unknown stage) raises ``PlanEditError``.
"""

from __future__ import annotations

import msgspec

from core.errors import EdgeShardError
from core.planning.plan import ShardPlan, Stage


class PlanEditError(EdgeShardError):
    """An edit that would break the plan's shape (e.g. leave a stage without units)."""


def _with_stages(plan: ShardPlan, stages: list[Stage]) -> ShardPlan:
    return msgspec.structs.replace(plan, stages=tuple(stages), strategy="manual")


def move_boundary(plan: ShardPlan, stage: int, new_start: int) -> ShardPlan:
    """Move the first unit of ``stage`` (≥ 1): units move between it and the stage before."""
    if not 1 <= stage < len(plan.stages):
        raise PlanEditError(f"stage {stage} has no movable left boundary")
    prev, cur = plan.stages[stage - 1], plan.stages[stage]
    if not prev.start < new_start < cur.end:
        raise PlanEditError(
            f"stage {stage} can start at units {prev.start + 1}..{cur.end - 1}; {new_start} would leave a stage empty"
        )
    stages = list(plan.stages)
    stages[stage - 1] = msgspec.structs.replace(prev, end=new_start)
    stages[stage] = msgspec.structs.replace(cur, start=new_start)
    return _with_stages(plan, stages)


def set_stage_device(plan: ShardPlan, stage: int, device: str) -> ShardPlan:
    """Run ``stage`` on ``device``; if another stage used it, the two swap devices."""
    if not 0 <= stage < len(plan.stages):
        raise PlanEditError(f"there is no stage {stage}")
    stages = list(plan.stages)
    old = stages[stage].device
    for j, st in enumerate(stages):
        if j != stage and st.device == device:
            stages[j] = msgspec.structs.replace(st, device=old)
    stages[stage] = msgspec.structs.replace(stages[stage], device=device)
    return _with_stages(plan, stages)


def set_stage_torch_device(plan: ShardPlan, stage: int, torch_device: str) -> ShardPlan:
    """Compute ``stage`` on its device's ``torch_device`` (``cpu``, ``cuda``, ``cuda:N``); whether that
    device has the GPU is the profile's to say (``core.planning.placement.unprofiled_gpus``)."""
    from agents.accelerators import canonical, device_name_problem

    if not 0 <= stage < len(plan.stages):
        raise PlanEditError(f"there is no stage {stage}")
    if device_name_problem(torch_device):
        raise PlanEditError(f"stage {stage}: {device_name_problem(torch_device)}")
    stages = list(plan.stages)
    stages[stage] = msgspec.structs.replace(stages[stage], torch_device=canonical(torch_device))
    return _with_stages(plan, stages)


def add_stage(plan: ShardPlan, device: str) -> ShardPlan:
    """Split the stage with the most units in two; the second half runs on ``device``."""
    if not plan.stages:
        return _with_stages(plan, [Stage(device=device, start=0, end=plan.num_units)])
    j = max(range(len(plan.stages)), key=lambda i: (plan.stages[i].num_units, -i))
    st = plan.stages[j]
    if st.num_units < 2:
        raise PlanEditError("every stage has a single unit: there is nothing left to split")
    mid = st.start + st.num_units // 2
    stages = list(plan.stages)
    stages[j : j + 1] = [msgspec.structs.replace(st, end=mid), Stage(device=device, start=mid, end=st.end)]
    return _with_stages(plan, stages)


def remove_stage(plan: ShardPlan, stage: int) -> ShardPlan:
    """Remove ``stage``; its units join the stage before it (stage 0's join the next)."""
    if len(plan.stages) < 2:
        raise PlanEditError("a plan needs at least one stage")
    if not 0 <= stage < len(plan.stages):
        raise PlanEditError(f"there is no stage {stage}")
    stages = list(plan.stages)
    gone = stages.pop(stage)
    if stage == 0:
        stages[0] = msgspec.structs.replace(stages[0], start=gone.start)
    else:
        stages[stage - 1] = msgspec.structs.replace(stages[stage - 1], end=gone.end)
    return _with_stages(plan, stages)


def single_device_plan(model: str, num_units: int, device: str) -> ShardPlan:
    """The starting point of a hand-made plan: every unit on one device."""
    return ShardPlan(model=model, num_units=num_units, stages=(Stage(device=device, start=0, end=num_units),))
