"""Attention offloading's problem from the cluster you have: the connected agents' measured profile.

The scenarios (``scenarios``: H100 + H20, Orin + mini-PCs) are datasheet what-ifs; a plan for
the devices on the desk needs their own figures. A layer-sharding ``Profile`` measured on the
agents holds most of them: each device's memory budget (what a compute replica's dense part and a
memory agent's KV must fit), the measured links (bandwidth, latency) and the decoder blocks' times.
The cost model's dense time is a roofline, the larger of a bandwidth term (weights read) and a FLOP
term (2·params per row); each is read off its own measured point (``device_speeds``): the decode at
the smallest batch gives the bandwidth term, the prefill of the most tokens the FLOP term. Both
from the decode alone (as before) made a 16-token prefill cost 16 decode steps, where the demo's
emulated devices measured ~1.2–1.5 (a small model's block time is mostly per-call work); the Run
screen predicted the demo's compute lane at 1.5–2× what it measured. The per-step work beyond the
blocks (embedding, the head beyond its roofline, the stage's mask and positions) is the profile's
too (``step_overhead_s``). What a layer-sharding profile never times is a memory agent's attend:
``probe`` measures it on the agents. Pure: the view calls it whenever the profile or the model changes.
"""

from __future__ import annotations

from core.devices.profile import Profile
from core.errors import PlanInvalid
from core.techniques.attention_offload.problem import OffloadDevice, OffloadModel, OffloadProblem, OffloadWorkload

DEFAULT_LINK_MBIT = 1000.0
"""A device pair the profile did not measure (a one-agent profile): a LAN's figure, said in the name."""


def device_speeds(profile: Profile, device: str) -> tuple[float, float]:
    """(FLOP/s, bytes/s) of ``device``'s decoder blocks: the bytes/s from their decode at the smallest
    profiled batch (weights read once per step), the FLOP/s from their prefill of the most profiled
    tokens (2·params per token; never slower than the decode's: the roofline's larger term rules)."""
    times = profile.times_of(device)
    blocks = [u for u in profile.model.units if u.kind == "decoder_block"]
    batch_index = min(range(len(times.decode_batch_sizes)), key=lambda i: times.decode_batch_sizes[i])
    batch = times.decode_batch_sizes[batch_index]
    seconds = sum(times.decode_s[u.index][batch_index] for u in blocks)
    if not blocks or seconds <= 0:
        raise PlanInvalid([f"{device}: the profile has no decode time of a decoder block: profile the cluster"])
    # a unit table without FLOPs (an older or synthetic one): 2 FLOPs per parameter per token
    flops = sum(u.flops_per_token or 2.0 * (u.params or u.param_bytes / 4) for u in blocks)
    decode_flops = flops * batch / seconds
    if times.prefill_token_counts:
        most = max(range(len(times.prefill_token_counts)), key=lambda i: times.prefill_token_counts[i])
        prefill_s = sum(times.prefill_s[u.index][most] for u in blocks)
        if prefill_s > 0:
            decode_flops = max(decode_flops, flops * times.prefill_token_counts[most] / prefill_s)
    return decode_flops, sum(u.param_bytes for u in blocks) / seconds


def step_overhead(profile: Profile, device: str, model: OffloadModel) -> float:
    """Seconds a decode step of a batch costs ``device`` beyond its layers and the head's roofline
    (``cost.head_seconds`` adds it): the embedding, the head's measured decode beyond the roofline the
    blocks' speeds give it, and the stage's once-per-step work (mask, positions), at the smallest
    profiled batch."""
    from core.techniques.attention_offload.cost import head_seconds

    times = profile.times_of(device)
    flops, bandwidth = device_speeds(profile, device)
    i = min(range(len(times.decode_batch_sizes)), key=lambda k: times.decode_batch_sizes[k])
    batch = times.decode_batch_sizes[i]
    units = {u.kind: u.index for u in profile.model.units if u.kind in ("embedding", "head")}
    measured = sum(times.decode_s[j][i] for j in units.values())
    probe = OffloadProblem(devices=(OffloadDevice(id=device, flops=flops, memory_bandwidth=bandwidth, memory_bytes=1,
                                                  link_bandwidth=1.0),), model=model,
                           workload=OffloadWorkload(prompt_tokens=1, generated_tokens=1))
    roofline = head_seconds(probe, probe.devices[0], batch)
    return max(0.0, measured - roofline) + times.stage_decode_overhead_s


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
                                 link_bandwidth=link_bandwidth, link_latency_s=latency,
                                 step_overhead_s=step_overhead(profile, device, model)))
    if not out:
        raise PlanInvalid(["the profile has none of the connected agents: profile the cluster"])
    return OffloadProblem(name=f"measured cluster ({', '.join(wanted)}; {model.name.rsplit('/', 1)[-1]})",
                          devices=tuple(out), model=model, workload=workload)


__all__ = ["device_link", "device_speeds", "problem_from_profile", "step_overhead"]
