"""Stages on a device's GPU: the problem as it looks with some devices computing on their GPU.

A device with a GPU in its profile (``Profile.accelerator_times``) can run its stage there: its units
take the GPU's measured times and its stage must fit the GPU's memory. ``placed_problem`` is that
problem (a pure function); the exact solver plans every CPU/GPU choice of those devices
(``core.planning.solvers.solve_placed``), and ``evaluate`` reads a plan's GPU stages through it.
"""

from __future__ import annotations

import msgspec

from core.planning.problem import PlanningProblem


def placed_problem(problem: PlanningProblem, on_gpu: frozenset[str] | set[str]) -> PlanningProblem:
    """``problem`` with each device in ``on_gpu`` computing on its GPU: its times and memory are the
    GPU's (``AcceleratorTimes``); the other devices as they were. No device named: ``problem`` itself."""
    accelerators = {a.device: a for a in problem.profile.accelerator_times if a.device in on_gpu}
    if not accelerators:
        return problem
    profile = problem.profile
    times = tuple(msgspec.structs.replace(accelerators[t.device].times, device=t.device)
                  if t.device in accelerators else t for t in profile.times)
    devices = tuple(msgspec.structs.replace(d, memory_bytes=accelerators[d.id].memory_bytes)
                    if d.id in accelerators else d for d in profile.cluster.devices)
    cluster = msgspec.structs.replace(profile.cluster, devices=devices)
    return msgspec.structs.replace(problem, profile=msgspec.structs.replace(profile, times=times, cluster=cluster))


def gpu_devices(plan) -> frozenset[str]:
    """The devices whose stage ``plan`` places on a GPU."""
    return frozenset(s.device for s in plan.stages if s.torch_device != "cpu")


def every_gpu(problem: PlanningProblem) -> dict[str, str]:
    """Device -> ``torch_device`` of each device not excluded whose GPU the profile has."""
    return {a.device: a.torch_device for a in problem.profile.accelerator_times
            if a.device not in problem.excluded_devices}


def on_gpus(plan, gpus: dict[str, str]):
    """``plan`` with the stage of each device in ``gpus`` computing on that GPU."""
    return msgspec.structs.replace(plan, stages=tuple(
        msgspec.structs.replace(s, torch_device=gpus[s.device]) if s.device in gpus else s for s in plan.stages))


def on_the_same_gpus(old, new):
    """``new`` (re-planned after a lost device) with each surviving device's stage on the GPU ``old``
    had it on: the run placed it there (its weights at that precision and its speed were planned so)."""
    return on_gpus(new, {s.device: s.torch_device for s in old.stages if s.torch_device != "cpu"})
