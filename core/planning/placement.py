"""Stages on a device's GPU: the problem as it looks with some devices computing on their GPU.

A device with a GPU in its profile (``Profile.accelerator_times``) can run its stage there: its units
take the GPU's measured times and its stage must fit the GPU's memory. ``placed_problem`` is that
problem (a pure function); the exact solver plans every CPU/GPU choice of those devices
(``core.planning.solvers.solve_placed``), and ``evaluate`` reads a plan's GPU stages through it. A
device may report several GPUs (``cuda:N``), each profiled: its stage goes on any one of them.
"""

from __future__ import annotations

import msgspec

from agents.accelerators import canonical
from core.planning.problem import PlanningProblem


def placed_problem(problem: PlanningProblem, on_gpu) -> PlanningProblem:
    """``problem`` with each device of ``on_gpu`` computing on a GPU of its own: its times, memory and
    quantized block ratios are that GPU's (``AcceleratorTimes``); the other devices as they were.
    ``on_gpu``: device -> its GPU (``cuda:N``), or a set of devices (each on its first profiled GPU).
    No device named: ``problem`` itself."""
    accelerators = _chosen(problem.profile, on_gpu)
    if not accelerators:
        return problem
    profile = problem.profile
    times = tuple(msgspec.structs.replace(accelerators[t.device].times, device=t.device)
                  if t.device in accelerators else t for t in profile.times)
    devices = tuple(msgspec.structs.replace(d, memory_bytes=accelerators[d.id].memory_bytes)
                    if d.id in accelerators else d for d in profile.cluster.devices)
    cluster = msgspec.structs.replace(profile.cluster, devices=devices)
    own = tuple(t for a in accelerators.values() for t in a.precision_times)  # measured on that GPU
    measured = {(t.device, t.weights) for t in own}
    ratios = own + tuple(t for t in profile.precision_times if (t.device, t.weights) not in measured)
    return msgspec.structs.replace(problem, profile=msgspec.structs.replace(
        profile, times=times, cluster=cluster, precision_times=ratios))


def _chosen(profile, on_gpu) -> dict:
    """Device -> the ``AcceleratorTimes`` of the GPU ``on_gpu`` puts it on (devices without it left out)."""
    if not isinstance(on_gpu, dict):
        on_gpu = {d: None for d in on_gpu}
    out = {}
    for a in profile.accelerator_times:
        if a.device in on_gpu and a.device not in out and on_gpu[a.device] in (None, canonical(a.torch_device)):
            out[a.device] = a
    return out


def gpu_placement(plan) -> dict[str, str]:
    """Device -> the GPU (``cuda:N``) ``plan`` computes its stage on, for each stage not on the CPU."""
    return {s.device: canonical(s.torch_device) for s in plan.stages if s.torch_device != "cpu"}


def gpu_choices(problem: PlanningProblem) -> dict[str, tuple[str, ...]]:
    """Device -> every GPU (``cuda:N``) the profile has for it, of each device not excluded."""
    out: dict[str, tuple[str, ...]] = {}
    for a in problem.profile.accelerator_times:
        if a.device not in problem.excluded_devices and canonical(a.torch_device) not in out.get(a.device, ()):
            out[a.device] = (*out.get(a.device, ()), canonical(a.torch_device))
    return out


def every_gpu(problem: PlanningProblem) -> dict[str, str]:
    """Device -> its fastest profiled GPU (least decode time over the model's units), of each device not
    excluded: where a peer's rule (the accelerator wherever there is one) puts its stage."""
    best: dict[str, tuple[float, str]] = {}
    for a in problem.profile.accelerator_times:
        if a.device in problem.excluded_devices:
            continue
        total = sum(u[0] if u else 0.0 for u in a.times.decode_s)
        if a.device not in best or total < best[a.device][0]:
            best[a.device] = (total, canonical(a.torch_device))
    return {d: g for d, (_, g) in best.items()}


def on_gpus(plan, gpus: dict[str, str]):
    """``plan`` with the stage of each device in ``gpus`` computing on that GPU."""
    return msgspec.structs.replace(plan, stages=tuple(
        msgspec.structs.replace(s, torch_device=gpus[s.device]) if s.device in gpus else s for s in plan.stages))


def on_the_same_gpus(old, new):
    """``new`` (re-planned after a lost device) with each surviving device's stage on the GPU ``old``
    had it on: the run placed it there (its weights at that precision and its speed were planned so)."""
    return on_gpus(new, {s.device: s.torch_device for s in old.stages if s.torch_device != "cpu"})


def profiled_gpus(problem: PlanningProblem, device: str) -> tuple[str, ...]:
    """The GPUs (``cuda:N``) the profile has for ``device``: where a stage of it may be placed besides its CPU."""
    return tuple(dict.fromkeys(canonical(a.torch_device) for a in problem.profile.accelerator_times
                               if a.device == device))


def unprofiled_gpus(problem: PlanningProblem, plan) -> list[str]:
    """One line per stage placed on a GPU its device's profile does not have (its cost would be its CPU's)."""
    out = []
    for j, s in enumerate(plan.stages):
        have = profiled_gpus(problem, s.device)
        if s.torch_device != "cpu" and canonical(s.torch_device) not in have:
            out.append(f"stage {j} ({s.device}) computes on {s.torch_device}, which its profile does not have "
                       f"({', '.join(have) or 'no GPU'}): pick cpu{''.join(', ' + g for g in have)}")
    return out
