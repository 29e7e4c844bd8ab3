"""A shard plan: which device runs which contiguous range of units.

Rules (checked by ``core.planning.cost.validate``): stages cover units [0, N) in order without
gaps, stage 0 runs on the problem's source device, each device appears at most once,
and each device's memory (weights + KV cache + workspace) fits its budget.
Ranges are half-open [start, end).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from agents.accelerators import device_name_problem
from core.formats import register_format

PLAN_FORMAT = "edgeshard.plan"
PLAN_VERSION = 4
"""2: ``Stage.weights`` (a version-1 plan loads with every stage at ``fp``); 3: ``Stage.options``;
4: ``Stage.torch_device`` (an older plan loads with every stage on ``cpu``)."""

StageKind = str
"""The stage's kind: which technique's agent-side executor runs it (``agents.executors``):
``layers`` (layer sharding), ``expert-offload`` (EdgeMoE), ... A plan whose stages name a
kind runs like any plan (``edgeshard run``, the Run screen): each stage is loaded as its kind."""
STAGE_KIND_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")

WEIGHT_PRECISIONS = ("fp", "int8", "int4")
"""A stage's weight precision: ``fp`` (the run's dtype) or weight-only ``int8`` / ``int4`` of its
blocks' Linear weights, quantized by its agent at load (agents/weight_precision.py says which)."""


class Stage(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    device: str
    start: int
    end: int
    kind: StageKind = "layers"
    """Which executor the stage's agent builds (``layers``, ``expert-offload``, ...)."""
    weights: str = "fp"
    """The precision of its blocks' weights (``WEIGHT_PRECISIONS``)."""
    torch_device: str = "cpu"
    """Where its agent computes it: ``cpu``, ``cuda`` (= ``cuda:0``) or ``cuda:N`` (``LoadShard.torch_device``);
    a run refuses a CUDA device the agent does not report before loading anything."""
    options: dict[str, Any] | None = None
    """Its kind's own settings, sent as its ``LoadShard.options`` (a technique's agent ``Options`` as a
    JSON object, ``kind`` its tag; e.g. expert offloading's buffer and the hashes of the files it
    reads, named in ``files``); None: the kind needs none."""

    @property
    def num_units(self) -> int:
        return self.end - self.start


class ShardPlan(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    format: Literal["edgeshard.plan"] = PLAN_FORMAT
    version: int = PLAN_VERSION
    model: str
    """ModelSpec.name the plan was made for."""
    num_units: int
    stages: tuple[Stage, ...]
    strategy: str = "manual"
    objective: Literal["latency", "throughput", "none"] = "none"
    micro_batch_size: int = 1
    micro_batches: int = 1

    def devices(self) -> tuple[str, ...]:
        return tuple(s.device for s in self.stages)

    def stage_of_unit(self, unit: int) -> int:
        for i, s in enumerate(self.stages):
            if s.start <= unit < s.end:
                return i
        raise IndexError(unit)


def layout_problems(plan: ShardPlan, num_units: int | None = None) -> list[str]:
    """What makes ``plan`` unrunnable whatever the devices (empty when nothing): stages must be
    non-empty and cover [0, N) in order without gaps or overlaps, each device once, and N
    must be the model's unit count when it is known. A run checks this before any work."""
    problems = []
    if num_units is not None and plan.num_units != num_units:
        problems.append(f"plan is for a model of {plan.num_units} units, this checkpoint has {num_units}")
    if not plan.stages:
        return problems + ["plan has no stages"]
    at = 0
    for i, s in enumerate(plan.stages):
        if s.end <= s.start:
            problems.append(f"stage {i} ({s.device}) is empty: [{s.start}, {s.end})")
        elif s.start != at:
            kind = "overlaps the previous stage" if s.start < at else f"leaves units [{at}, {s.start}) unassigned"
            problems.append(f"stage {i} ({s.device}) starts at unit {s.start}: it {kind}")
        at = max(at, s.end)
    if at != plan.num_units:
        problems.append(f"stages end at unit {at}, the model has {plan.num_units}")
    seen = set()
    for i, s in enumerate(plan.stages):
        if not s.kind or len(s.kind) > 64 or not set(s.kind) <= STAGE_KIND_CHARS:
            problems.append(f"stage {i} ({s.device}) has kind {s.kind!r}: a stage kind is a short lower-case name "
                            "such as 'layers' or 'expert-offload'")
        if s.weights not in WEIGHT_PRECISIONS:
            problems.append(f"stage {i} ({s.device}) has weights {s.weights!r}: one of {', '.join(WEIGHT_PRECISIONS)}")
        elif s.weights != "fp" and s.kind != "layers":
            problems.append(f"stage {i} ({s.device}) is a {s.kind} stage: only layers stages take {s.weights} weights")
        if device_name_problem(s.torch_device):
            problems.append(f"stage {i} ({s.device}): {device_name_problem(s.torch_device)}")
        if s.device in seen:
            problems.append(f"device {s.device} appears in more than one stage")
        seen.add(s.device)
    return problems


def plan_from_boundaries(
    model: str, num_units: int, devices: list[str], boundaries: list[int], **kw
) -> ShardPlan:
    """Build a plan from the devices in order and the first unit of stages 1..k-1."""
    edges = [0, *boundaries, num_units]
    stages = tuple(Stage(device=d, start=a, end=b) for d, a, b in zip(devices, edges, edges[1:]))
    return ShardPlan(model=model, num_units=num_units, stages=stages, **kw)


register_format(PLAN_FORMAT, ShardPlan, PLAN_VERSION)


def with_weights(plan: ShardPlan, weights: str | None) -> ShardPlan:
    """``plan`` with every stage's weights at ``weights`` (``--weights`` on run/serve); None: as planned."""
    if weights is None:
        return plan
    return msgspec.structs.replace(plan, stages=tuple(msgspec.structs.replace(s, weights=weights)
                                                      for s in plan.stages))


def with_torch_devices(plan: ShardPlan, torch_devices: dict[str, str] | None) -> ShardPlan:
    """``plan`` with the named devices' stages computed on ``torch_devices[device]`` (``--torch-device``
    on run/serve); a device not named keeps its plan stage's own."""
    if not torch_devices:
        return plan
    return msgspec.structs.replace(plan, stages=tuple(
        msgspec.structs.replace(s, torch_device=torch_devices.get(s.device, s.torch_device)) for s in plan.stages))


def offline_problems(plan: ShardPlan, offline) -> list[str]:
    """One line per stage of ``plan`` on a device that is offline (its agent stopped answering
    or it left the network), naming it: such a plan cannot run until the device is back or the
    plan is solved again without it. Empty when the plan avoids every offline device."""
    down = set(offline)
    return [f"stage {j} runs on {s.device!r}, which is offline: bring it back, or auto-solve again "
            f"(offline devices are left out)" for j, s in enumerate(plan.stages) if s.device in down]
