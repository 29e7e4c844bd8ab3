"""Spatial partitioning's problem from the cluster you have: the connected agents' CNN fits.

The paper-shaped scenario (``scenarios.paper_shaped``) is a what-if; a plan for the devices on
the desk needs their own figures. *Profile CNN* fits each agent's convolution and head times
(``profiling.SpatialFits``); a layer-sharding profile of the same agents adds what the fits
lack: the measured links (a strip crosses the gateway's link to each worker) and each device's
memory budget. ``problem_from_fits`` puts them together for the chosen network; pure, so the
view re-plans whenever the fits, the profile or the agents change.
"""

from __future__ import annotations

from collections.abc import Sequence

from core.techniques.spatial.problem import CnnRef, SpatialDevice, SpatialInputError, SpatialProblem
from core.techniques.spatial.profiling import SpatialFits

DEFAULT_LINK_MBIT = 1000.0
"""A gateway–worker link the profile did not measure (no layer-sharding profile yet): a LAN's figure."""
DEFAULT_MEMORY = 1 << 30


def problem_from_fits(model: CnnRef, fits: SpatialFits, *, profile=None, agents: Sequence[str] = (),
                      gateway: str = "") -> SpatialProblem:
    """The fitted agents (those in ``agents`` when given) as a spatial problem for ``model``:
    their conv and head time models, and from ``profile`` (a measured ``core.devices.profile.Profile``
    of the same agents, optional) the link of each to the gateway and its memory budget. The gateway
    is ``gateway`` (the source that holds the images) or the first fitted agent by name.
    ``SpatialInputError`` says what to profile when no fitted agent is connected."""
    fitted = sorted((f for f in fits.devices if not agents or f.device in agents), key=lambda f: f.device)
    if not fitted:
        have = ", ".join(f.device for f in fits.devices) or "none"
        raise SpatialInputError(f"no connected agent has CNN time models (fits of: {have}): press Profile CNN on "
                                "the Profile screen with the agents connected")
    names = [f.device for f in fitted]
    gw = gateway if gateway in names else names[0]
    links = {} if profile is None else {(link.src, link.dst): link for link in profile.cluster.links}
    budgets = {} if profile is None else {d.id: d.memory_bytes for d in profile.cluster.devices}
    devices = []
    for f in fitted:
        link = links.get((gw, f.device)) or links.get((f.device, gw))
        mbit, latency_ms = (link.bandwidth_mbit_s, link.latency_ms) if link is not None else (DEFAULT_LINK_MBIT, 0.0)
        devices.append(SpatialDevice(id=f.device, time=f.conv, fc_time=f.fc, bandwidth_Bps=mbit * 1e6 / 8,
                                     latency_s=latency_ms / 1e3, memory_bytes=budgets.get(f.device) or DEFAULT_MEMORY))
    devices.sort(key=lambda d: d.id != gw)  # the gateway first: strips are cut left to right from it
    linked = "measured links" if links else f"links assumed {DEFAULT_LINK_MBIT:g} Mbit/s (no profile)"
    return SpatialProblem(name=f"measured cluster ({', '.join(names)}; {linked})", model=model,
                          devices=tuple(devices), gateway=gw)


__all__ = ["problem_from_fits"]
