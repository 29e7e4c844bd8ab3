"""Time models from the agents: each device times convolutions over map sizes, core fits y = a·x + b.

Asks through the agent link (``core.devices.agent_link.AgentLink.profile_compute``, or
anything with that method), so it adds no socket code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from msgspec import structs

from core.reporting import Reporter
from core.techniques.spatial.problem import SpatialInputError, SpatialProblem, TimeModel, fit_time_model


def profile_time_models(agents, devices: Sequence[str], *, sizes: Sequence[int] = (8, 16, 24, 32, 48, 64),
                        channels: Sequence[int] = (16, 32), repeats: int = 5, threads: int = 0,
                        reporter: Reporter | None = None, timeout_s: float = 300.0) -> dict[str, TimeModel]:
    """Each device's fitted time model (with its median fit error), one device after another so
    their timings do not disturb each other on shared hardware."""
    options = {"kind": "conv-sweep", "sizes": list(sizes), "channels": list(channels), "repeats": repeats,
               "threads": threads}
    out = {}
    for i, device in enumerate(devices):
        if reporter is not None:
            if reporter.cancel_requested():
                break
            reporter.status(f"timing convolutions on {device}")
            reporter.progress(i, len(devices))
        samples = agents.profile_compute(device, options, timeout_s=timeout_s).get("samples")
        if not isinstance(samples, list):
            raise SpatialInputError(f"{device} sent no convolution timings: upgrade its agent to the studio's version")
        out[device] = fit_time_model([(float(x), float(y)) for x, y in samples])
    if reporter is not None:
        reporter.progress(len(out), len(devices))
    return out


def with_time_models(problem: SpatialProblem, models: Mapping[str, TimeModel]) -> SpatialProblem:
    """The problem with its devices' time models replaced by measured ones."""
    return structs.replace(problem, devices=tuple(
        structs.replace(d, time=models[d.id]) if d.id in models else d for d in problem.devices))
