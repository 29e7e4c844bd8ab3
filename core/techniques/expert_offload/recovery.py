"""A lost device of an expert-offloading run is re-planned with expert offloading's memory model.

Layer sharding's exact solver counts every expert of a block resident; an ``expert-offload`` stage
holds a block's other tensors and a buffer of ``slots`` experts, reading the rest from storage
(``core.techniques.expert_offload.cost``: ``resident_bytes + slots · expert_bytes``). So the survivors
are planned on a problem whose MoE blocks weigh their resident tensors only and whose devices keep room
for the plan's buffer: a survivor that holds the resident model and the buffer gets the run, where the
layer-sharding re-plan found no plan. The re-planned stages keep the kind and options of the stages they
replace (``core.runs.recovery.keep_stage_settings``), slots and policy included, unless the survivors
cannot hold the plan's buffer: then the largest buffer that fits.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from core.planning.plan import ShardPlan
from core.planning.problem import PlanningProblem
from core.runs.recovery import ExactReplanner, RecoveryImpossible, keep_stage_settings

STAGE_KIND = "expert-offload"


def offloaded_problem(problem: PlanningProblem, model_dir: str | Path, slots: int) -> PlanningProblem:
    """``problem`` as expert offloading places it: each decoder block without its experts' bytes (they stay
    on storage), each device's budget less a buffer of ``slots`` experts (every stage has its own)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    model = problem.profile.model
    per_param = model.units[0].param_bytes / max(model.units[0].params, 1)  # the table's bytes per weight
    expert = int(3 * int(config["hidden_size"]) * int(config["intermediate_size"]) * per_param)
    experts = int(config.get("num_local_experts") or 0)
    units = tuple(msgspec.structs.replace(u, param_bytes=max(0, u.param_bytes - experts * expert))
                  if 0 < u.index < len(model.units) - 1 else u for u in model.units)
    devices = tuple(msgspec.structs.replace(d, memory_bytes=max(1, d.memory_bytes - slots * expert))
                    for d in problem.profile.cluster.devices)
    profile = msgspec.structs.replace(
        problem.profile, model=msgspec.structs.replace(model, units=units),
        cluster=msgspec.structs.replace(problem.profile.cluster, devices=devices))
    return msgspec.structs.replace(problem, profile=profile)


def plan_slots(plan: ShardPlan) -> int:
    """The buffer a plan's expert-offload stages keep (the largest of their ``slots``; 0: none)."""
    return max((int((s.options or {}).get("slots", 0)) for s in plan.stages if s.kind == STAGE_KIND), default=0)


class OffloadReplanner(ExactReplanner):
    """``ExactReplanner`` over ``offloaded_problem``: the interrupted plan's expert-offload buffer (the
    largest of its stages' ``slots``) kept free on every survivor. Where the survivors' memory cannot hold
    that buffer, the largest buffer that fits (down to 1 slot) is planned and the new stages are given it:
    the slots change the reads from storage, not the tokens."""

    def __init__(self, problem: PlanningProblem, model_dir: str | Path, time_limit_s: float = 5.0) -> None:
        super().__init__(problem, time_limit_s)
        self.model_dir = Path(model_dir)
        self._slots: int | None = None
        """The buffer the next solve plans for (None: the plan's own)."""

    def planning_problem(self, plan: ShardPlan) -> PlanningProblem:
        return offloaded_problem(self.problem, self.model_dir, plan_slots(plan) if self._slots is None else self._slots)

    def solve(self, plan: ShardPlan, failed: str, usable: tuple[str, ...]) -> ShardPlan:
        wanted = plan_slots(plan)
        try:
            return super().solve(plan, failed, usable)
        except RecoveryImpossible as err:
            if wanted <= 1 or not err.missing_bytes:
                raise
            first = err
        fits, low, high = None, 1, wanted - 1  # fewer slots leave more memory: bisect the largest that fits
        while low <= high:
            self._slots = (low + high) // 2
            try:
                fits = (self._slots, super().solve(plan, failed, usable))
                low = self._slots + 1
            except RecoveryImpossible as err:
                high, first = self._slots - 1, err if self._slots == 1 else first
            finally:
                self._slots = None
        if fits is None:
            raise RecoveryImpossible(f"{first.reason} (with an expert buffer of 1 slot; the plan's was {wanted})",
                                     failed, first.missing_bytes) from None
        slots, replanned = fits
        kept = keep_stage_settings(plan, replanned)
        return msgspec.structs.replace(kept, stages=tuple(
            msgspec.structs.replace(s, options={**s.options, "slots": slots}) if s.kind == STAGE_KIND else s
            for s in kept.stages))
