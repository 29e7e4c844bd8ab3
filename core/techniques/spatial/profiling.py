"""Time models from the agents: each device times convolutions over map sizes, core fits y = a·x + b.

Asks through the agent link (``core.devices.agent_link.AgentLink.profile_compute`` with
``ConvSweepOptions``, or anything with that method), so it adds no socket code; the link
checks the reply holds ``ConvTimings`` (an agent of another version gets a version error).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import msgspec
from msgspec import structs

from agents.protocol import ConvSweepOptions
from core.formats import register_format
from core.reporting import Reporter
from core.techniques.spatial.problem import (
    SpatialInputError, SpatialProblem, TimeModel, fit_layer_time_model, fit_time_model,
)

FITS_FORMAT = "edgeshard.spatial-fits"


def profile_time_models(agents, devices: Sequence[str], *, sizes: Sequence[int] = (8, 16, 24, 32, 48, 64),
                        channels: Sequence[int] = (16, 32), repeats: int = 5, threads: int = 0,
                        reporter: Reporter | None = None, timeout_s: float = 300.0) -> dict[str, TimeModel]:
    """Each device's fitted conv time model (with its median fit error), one device after another
    so their timings do not disturb each other on shared hardware. ``profile_device_models``
    also gives the head's."""
    return {d: conv for d, (conv, _fc) in profile_device_models(
        agents, devices, sizes=sizes, channels=channels, repeats=repeats, threads=threads, reporter=reporter,
        timeout_s=timeout_s).items()}


def profile_device_models(agents, devices: Sequence[str], *, sizes: Sequence[int] = (8, 16, 24, 32, 48, 64),
                          channels: Sequence[int] = (16, 32), repeats: int = 5, threads: int = 0,
                          reporter: Reporter | None = None,
                          timeout_s: float = 300.0) -> dict[str, tuple[TimeModel, TimeModel | None]]:
    """Per device, (conv model, FC head model or None from an agent that does not time FC)."""
    options = ConvSweepOptions(sizes=tuple(sizes), channels=tuple(channels), repeats=repeats, threads=threads)
    out = {}
    for i, device in enumerate(devices):
        if reporter is not None:
            if reporter.cancel_requested():
                break
            reporter.status(f"timing convolutions on {device}")
            reporter.progress(i, len(devices))
        timings = agents.profile_compute(device, options, timeout_s=timeout_s)
        conv = (fit_layer_time_model(list(timings.layer_samples)) if timings.layer_samples
                else fit_time_model(list(timings.samples)))
        out[device] = (conv,
                       fit_time_model(list(timings.fc_samples)) if timings.fc_samples else None)
    if reporter is not None:
        reporter.progress(len(out), len(devices))
    return out


class DeviceFit(msgspec.Struct, frozen=True, kw_only=True):
    """One device's time models: convolutions (spatial layers) and, when timed, the FC head."""

    device: str
    conv: TimeModel
    fc: TimeModel | None = None


class SpatialFits(msgspec.Struct, frozen=True, kw_only=True):
    """Every profiled device's fitted time models and where they came from (what the Profile
    screen shows: a, b and each fit's median |predicted − measured| / measured). A JSON format
    (``edgeshard.spatial-fits``): the studio keeps the last one for its next launch."""

    format: Literal["edgeshard.spatial-fits"] = FITS_FORMAT
    version: int = 1
    source: str
    devices: tuple[DeviceFit, ...]


register_format(FITS_FORMAT, SpatialFits, 1)


def measure_fits(agents, devices: Sequence[str], *, reporter: Reporter | None = None, **sweep) -> SpatialFits:
    """``profile_device_models`` on the agents, as ``SpatialFits`` (``sweep``: its sizes, channels, repeats)."""
    models = profile_device_models(agents, devices, reporter=reporter, **sweep)
    return SpatialFits(source=f"measured on {len(models)} agent(s)",
                       devices=tuple(DeviceFit(device=d, conv=c, fc=f) for d, (c, f) in models.items()))


def fits_of_problem(problem: SpatialProblem, source: str) -> SpatialFits:
    """The time models a spatial problem holds (measured by ``edgeshard spatial profile --out``, or
    written by hand / a scenario: then their fit error is 0, nothing was fitted)."""
    return SpatialFits(source=source, devices=tuple(DeviceFit(device=d.id, conv=d.time, fc=d.fc_time)
                                                    for d in problem.devices))


def problem_with_fits(problem: SpatialProblem, fits: SpatialFits) -> SpatialProblem:
    """The problem with the fitted time models (convolutions and, when timed, the FC head) of the
    profiled agents; each device keeps its link and memory. When the fits name every device of the
    problem, by name; when they name none, the problem's devices become the agents — the gateway the
    first agent by name, the others the next ones in the problem's order (as ``run.on_agents`` names
    a plan's devices), so a plan made on it runs on the agents that were timed. ``SpatialInputError``
    says what to do when the fits name only some devices or fewer agents were profiled."""
    measured = {f.device: f for f in fits.devices}
    ids = [d.id for d in problem.devices]
    if set(ids) <= set(measured):
        names = {i: i for i in ids}
    else:
        named = [i for i in ids if i in measured]
        agents = ", ".join(sorted(measured)) or "none"
        if named:
            missing = ", ".join(i for i in ids if i not in measured)
            raise SpatialInputError(f"the fits ({fits.source}) name devices {', '.join(named)} of the problem but "
                                    f"not {missing}: profile those agents (Profile CNN), or use a problem whose "
                                    f"devices are all named like the agents ({agents})")
        if len(measured) < len(ids):
            raise SpatialInputError(f"the problem has {len(ids)} devices but there are fits of {len(measured)} "
                                    f"({agents}; {fits.source}): profile more agents, or use a problem with "
                                    f"{len(measured)} node(s)")
        order = [problem.gateway] + [i for i in ids if i != problem.gateway]
        names = dict(zip(order, sorted(measured)))
    devices = tuple(structs.replace(d, id=names[d.id], time=measured[names[d.id]].conv,
                                    fc_time=measured[names[d.id]].fc or d.fc_time) for d in problem.devices)
    renamed = "" if all(k == v for k, v in names.items()) else " on " + ", ".join(names[i] for i in ids)
    return structs.replace(problem, devices=devices, gateway=names[problem.gateway],
                           name=f"{problem.name}, measured{renamed}")


def with_time_models(problem: SpatialProblem, models: Mapping[str, TimeModel],
                     fc_models: Mapping[str, TimeModel | None] | None = None) -> SpatialProblem:
    """The problem with its devices' time models (and head models, when given) replaced by measured ones."""
    fc_models = fc_models or {}
    return structs.replace(problem, devices=tuple(
        structs.replace(d, time=models[d.id], fc_time=fc_models.get(d.id, d.fc_time)) if d.id in models else d
        for d in problem.devices))


def measure_strip_links(link, devices: Sequence[str], *, repeats: int = 5,
                        timeout_s: float = 60.0) -> dict[str, tuple[float, float]]:
    """Per device, (bandwidth_Bps, latency_s) of the path a strip really takes (coordinator ⇄
    agent, encrypted control channel, encode/decode on both ends), from ``ComputeStrip`` round
    trips of a 2×2 pool (negligible compute, its agent time subtracted) over four strip sizes:
    round trip − compute = 2·latency + bytes / bandwidth, fitted by least squares."""
    import time

    import numpy as np

    from agents.techniques.spatial.messages import ComputeStrip, SpatialNet, StripComputed

    net = SpatialNet(network="vgg16", image=64, width_div=4, classes=10)  # layer 2: pool of 16 ch × 64²
    out = {}
    for device in devices:
        samples = []
        for cols in (4, 16, 32, 64):
            data = np.zeros((1, 16, 64, cols), dtype="<f4").tobytes()
            msg = ComputeStrip(net=net, start=2, end=3, x_lo=0, lo=0, hi=cols // 2, shape=(1, 16, 64, cols), data=data)
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                reply = link.request(device, msg, timeout_s)
                rtt = time.perf_counter() - t0
                if isinstance(reply, StripComputed):
                    best = min(best, rtt - (reply.t_end - reply.t_start))
            samples.append((len(data) + len(data) // 4, best))
        fit = fit_time_model(samples)
        out[device] = (1.0 / fit.a, fit.b / 2)
    return out
