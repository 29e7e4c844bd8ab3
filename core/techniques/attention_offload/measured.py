"""Attention offloading's problem from the cluster you have: the connected agents' measured profile.

The scenarios (``scenarios``: H100 + H20, Orin + mini-PCs) are datasheet what-ifs; a plan for
the devices on the desk needs their own figures. A layer-sharding ``Profile`` measured on the
agents holds all of them: each device's memory budget (what a compute replica's dense part and a
memory agent's KV must fit), the measured links (bandwidth, latency) and the decode time of every
decoder block at the smallest batch. A block's decode at batch 1 reads all its weights and does
2·params FLOPs per token, so its time gives the device's sustained FLOP/s (``flops_per_token`` /
time) and the bandwidth decode is bound by (``param_bytes`` / time): the two speeds the cost
model divides by. Pure: the view calls it whenever the profile or the model changes.
"""

from __future__ import annotations

from core.devices.profile import Profile
from core.errors import PlanInvalid
from core.techniques.attention_offload.problem import OffloadDevice, OffloadModel, OffloadProblem, OffloadWorkload

DEFAULT_LINK_MBIT = 1000.0
"""A device pair the profile did not measure (a one-agent profile): a LAN's figure, said in the name."""


def device_speeds(profile: Profile, device: str) -> tuple[float, float]:
    """(FLOP/s, bytes/s) of ``device`` from its decoder blocks' decode at the smallest profiled batch."""
    times = profile.times_of(device)
    batch_index = min(range(len(times.decode_batch_sizes)), key=lambda i: times.decode_batch_sizes[i])
    batch = times.decode_batch_sizes[batch_index]
    blocks = [u for u in profile.model.units if u.kind == "decoder_block"]
    seconds = sum(times.decode_s[u.index][batch_index] for u in blocks)
    if not blocks or seconds <= 0:
        raise PlanInvalid([f"{device}: the profile has no decode time of a decoder block: profile the cluster"])
    # a unit table without FLOPs (an older or synthetic one): 2 FLOPs per parameter per token
    flops = sum(u.flops_per_token or 2.0 * (u.params or u.param_bytes / 4) for u in blocks)
    return flops * batch / seconds, sum(u.param_bytes for u in blocks) / seconds


def device_link(profile: Profile, device: str) -> tuple[float, float]:
    """(bytes/s, one-way latency s) of ``device``'s slowest measured link: every byte a compute
    device sends to a memory device crosses one of its links."""
    links = [link for link in profile.cluster.links if device in (link.src, link.dst) and link.src != link.dst]
    if not links:
        return DEFAULT_LINK_MBIT * 1e6 / 8, 0.0
    slowest = min(links, key=lambda link: link.bandwidth_mbit_s)
    return slowest.bandwidth_mbit_s * 1e6 / 8, max(link.latency_ms for link in links) / 1e3


def problem_from_profile(profile: Profile, model: OffloadModel, workload: OffloadWorkload,
                         devices: tuple[str, ...] | None = None) -> OffloadProblem:
    """The measured cluster as an attention-offloading problem for ``model`` (``run.checkpoint_model``
    of the checkpoint that will run): one device per profiled agent in ``devices`` (default: all),
    budgets and links as measured, speeds from the blocks' decode times, no prices (the objective is
    throughput). ``PlanInvalid`` names a device without decode times."""
    wanted = [d.id for d in profile.cluster.devices if devices is None or d.id in devices]
    out = []
    for device in wanted:
        flops, bandwidth = device_speeds(profile, device)
        link_bandwidth, latency = device_link(profile, device)
        out.append(OffloadDevice(id=device, flops=flops, memory_bandwidth=bandwidth,
                                 memory_bytes=profile.cluster.device(device).memory_bytes,
                                 link_bandwidth=link_bandwidth, link_latency_s=latency))
    if not out:
        raise PlanInvalid(["the profile has none of the connected agents: profile the cluster"])
    return OffloadProblem(name=f"measured cluster ({', '.join(wanted)}; {model.name.rsplit('/', 1)[-1]})",
                          devices=tuple(out), model=model, workload=workload)


__all__ = ["device_link", "device_speeds", "problem_from_profile"]
