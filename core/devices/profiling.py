"""Profiling a cluster from the coordinator: drive each agent's on-device profiler
(agents/profiler.py), measure every ordered pair's link over the agents' data plane, and
assemble a ``Profile`` that ``edgeshard plan`` reads directly.

Compute is profiled one device at a time by default: emulated devices (namespaces, a
local cluster) share the same CPU cores, so profiling them together would measure the
contention, not the device. Links are measured one ordered pair at a time for the same
reason (pairs would share the bridge and the CPU). A pair's bandwidth is measured in two
rounds: a short probe to estimate the rate, then one sized to last ``link_target_s`` so
slow and fast links are measured with similar accuracy.

One-way latency is read from probe timestamps on the two agents' clocks, corrected with
the offsets the coordinator estimated from pings; the round trip of a pair is the sum of
both directions. It is the one-way time of a small message on an idle link (what the cost
model adds to bytes / bandwidth for every message): the second round's probes are spaced at
least twice their own sending time at the first round's rate (``latency_probe_gap_s``), and
the first probe of a round, which waits for the connection's handshake, is not counted.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlparse

import msgspec

from agents.protocol import (
    AgentStatus,
    ComputeOptions,
    ComputeProfile,
    ErrorReply,
    GetStatus,
    LinkOptions,
    LinkResult,
    MeasureLink,
    PeerSpec,
    ProfileCompute,
)
from core.devices.agent_link import unexpected_profile_reply
from core.devices.cluster import Cluster, Device, Link
from core.errors import EdgeShardError
from core.models.weight_quality import DevicePrecisionTimes
from core.models.units import model_spec_from_config
from core.devices.profile import AcceleratorTimes, DeviceTimes, DraftTime, Profile, ProfiledWorkload
from core.reporting import Cancelled, NullReporter, PhaseReporter, Reporter, wait_unless_cancelled

_PROFILER_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


class ProfilingFailed(EdgeShardError):
    """An agent could not profile (names the device and its error)."""


class LinkMeasurement(msgspec.Struct, frozen=True, kw_only=True):
    src: str
    dst: str
    bandwidth_mbit_s: float
    one_way_ms: float
    bytes: int
    seconds: float


class ClusterProfileResult(msgspec.Struct, frozen=True, kw_only=True):
    profile: Profile
    links: tuple[LinkMeasurement, ...]
    compute: tuple[ComputeProfile, ...]

    def rtt_ms(self, a: str, b: str) -> float:
        """Round trip between ``a`` and ``b``: both one-way latencies."""
        by = {(m.src, m.dst): m for m in self.links}
        return by[(a, b)].one_way_ms + by[(b, a)].one_way_ms


def _check_cancel(rep: Reporter) -> None:
    if rep.cancel_requested():
        raise Cancelled()


def _reply(device: str, fut, timeout_s: float, what: str, expected: type):
    """The ``expected`` result in ``fut``'s reply, or ``ProfilingFailed`` saying what went wrong."""
    try:
        reply = fut.result(timeout=timeout_s)
    except TimeoutError:
        raise ProfilingFailed(f"{device}: no answer while {what} within {timeout_s:.0f} s") from None
    except EdgeShardError:
        raise
    except Exception as err:
        raise ProfilingFailed(f"{device}: {what} failed: {err}") from None
    if isinstance(reply, ErrorReply):
        raise ProfilingFailed(f"{device}: {what} failed: {reply.message}")
    problem = unexpected_profile_reply(reply, expected)
    if problem:
        raise ProfilingFailed(f"{device}: {problem} while {what}")
    return reply.result


def profile_compute(coord, devices: Sequence[str], options: ComputeOptions, reporter: Reporter | None = None,
                    timeout_s: float = 1800, together: bool = False) -> dict[str, ComputeProfile]:
    """Run the on-device compute profiler on each device, one after the other (agents on one
    host would disturb each other's timing). While one profiles, its status is polled so the
    operator sees which agent is at which unit. ``together``: all at once (``profile_together``)."""
    rep = reporter or NullReporter()
    if together and len(devices) > 1:
        return profile_together(coord, devices, options, rep, timeout_s)
    out = {}
    for i, dev in enumerate(devices):
        _check_cancel(rep)
        rep.status(f"{dev}: profiling compute ({i + 1}/{len(devices)})")
        fut = coord.request_async(dev, ProfileCompute(options=options))
        _follow_progress(coord, dev, fut, rep, i, len(devices), timeout_s)
        out[dev] = _reply(dev, fut, timeout_s, "profiling compute", ComputeProfile)
        rep.progress(i + 1, len(devices))
        rep.partial_result(out[dev])
    return out


def _follow_progress(coord, dev: str, fut, rep: Reporter, index: int, count: int, timeout_s: float,
                     poll_s: float = 0.3) -> None:
    """Until ``fut`` is done: the agent's own activity (``profiling compute: unit 3/8``) as
    status and progress; a cancel stops waiting (the agent finishes its unit and stays up)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    poll = None
    while not fut.done() and time.monotonic() < deadline:
        _check_cancel(rep)
        if poll is not None and poll.done() and poll.exception() is None:
            st = poll.result()
            if isinstance(st, AgentStatus) and st.activity.startswith("profiling") and st.activity != last:
                last = st.activity
                rep.status(f"{dev}: {st.activity} (device {index + 1}/{count})")
                rep.progress(index + st.progress, count)
        if poll is None or poll.done():
            poll = coord.request_async(dev, GetStatus())
        wait_unless_cancelled(fut, rep, poll_s)  # a cancel (the studio quitting) ends the wait at once
    _check_cancel(rep)


def profile_together(coord, devices: Sequence[str], options: ComputeOptions, rep: Reporter,
                     timeout_s: float = 1800, poll_s: float = 0.3) -> dict[str, ComputeProfile]:
    """Every device's compute profiled at once: for emulated devices sharing one host that time
    their units by their own thread's CPU time (``agents.emulation.DeviceEmulation.profile_clock``
    on a shared host), so a neighbour computing meanwhile does not lengthen their figures, and the
    demo's profile takes the longest agent's time instead of the sum. One bar: the agents' mean
    progress; the status names each agent's unit."""
    futures = {d: coord.request_async(d, ProfileCompute(options=options)) for d in devices}
    rep.status(f"profiling compute on {len(devices)} devices at once")
    polls: dict = {}
    done_at: dict[str, float] = {}
    activity = {d: "" for d in devices}
    deadline = time.monotonic() + timeout_s
    while not all(f.done() for f in futures.values()) and time.monotonic() < deadline:
        _check_cancel(rep)
        for d in devices:
            poll = polls.get(d)
            if poll is not None and poll.done() and poll.exception() is None:
                st = poll.result()
                if isinstance(st, AgentStatus) and st.activity.startswith("profiling"):
                    activity[d] = st.activity.removeprefix("profiling compute: ")
                    done_at[d] = max(done_at.get(d, 0.0), st.progress)
            if futures[d].done():
                done_at[d], activity[d] = 1.0, "done"
            elif poll is None or poll.done():
                polls[d] = coord.request_async(d, GetStatus())
        rep.status("profiling compute: " + ", ".join(f"{d} {activity[d] or 'starting'}" for d in devices))
        rep.progress(sum(done_at.values()), len(devices))
        pending = next((f for f in futures.values() if not f.done()), None)
        if pending is not None:
            wait_unless_cancelled(pending, rep, poll_s)
    _check_cancel(rep)
    out = {d: _reply(d, futures[d], max(1.0, deadline - time.monotonic()), "profiling compute", ComputeProfile)
           for d in devices}
    for d in devices:
        rep.partial_result(out[d])
    rep.progress(len(devices), len(devices))
    return out


PROBE_WIRE_BYTES = 1024
"""A generous bound on one latency probe on the wire: its data header (~130 B), 8 payload
bytes, ZMQ/CURVE framing and TCP/IP headers."""


def latency_probe_gap_s(bandwidth_mbit_s: float) -> float:
    """Seconds between latency probes on a link of this rate: at least twice a probe's own
    sending time, so each probe finds the link idle instead of queueing behind the one before
    (at 0.5 Mbit/s a probe takes milliseconds to send; 5 ms apart they queued and the
    "latency" became their own sending and queueing time, which the cost model then paid on
    top of bytes / bandwidth)."""
    default = LinkOptions(role="send").latency_gap_s
    if bandwidth_mbit_s <= 0:
        return default
    return min(1.0, max(default, 2 * PROBE_WIRE_BYTES * 8 / (bandwidth_mbit_s * 1e6)))


def measure_pair(coord, src: PeerSpec, dst: PeerSpec, nbytes: int, timeout_s: float = 120,
                 latency_gap_s: float | None = None) -> LinkResult:
    """One probe from ``src`` to ``dst``: the receiver is armed first, then the sender starts."""
    probe = uuid.uuid4().hex[:12]
    recv = coord.request_async(dst.device, MeasureLink(peer=src, options=LinkOptions(
        role="receive", probe_id=probe, timeout_s=timeout_s)))
    time.sleep(0.05)  # the receiver's worker is polling before the first probe leaves
    gap = {} if latency_gap_s is None else {"latency_gap_s": latency_gap_s}
    send = coord.request_async(src.device, MeasureLink(peer=dst, options=LinkOptions(
        role="send", probe_id=probe, nbytes=int(nbytes), timeout_s=timeout_s, **gap)))
    _reply(src.device, send, timeout_s + 10, f"sending probes to {dst.device}", LinkResult)
    res = _reply(dst.device, recv, timeout_s + 10, f"receiving probes from {src.device}", LinkResult)
    if res.error:
        raise ProfilingFailed(f"{dst.device}: {res.error}")
    return res


def measure_links(coord, peers: dict[str, PeerSpec], reporter: Reporter | None = None, *,
                  link_target_s: float = 1.0, first_probe_bytes: int = 256 << 10, max_bytes: int = 64 << 20,
                  offsets: dict[str, float] | None = None) -> list[LinkMeasurement]:
    """Bandwidth and one-way latency of every ordered pair, one pair at a time."""
    rep = reporter or NullReporter()
    names = sorted(peers)
    pairs = [(a, b) for a in names for b in names if a != b]
    offsets = offsets or {}
    out = []
    for i, (a, b) in enumerate(pairs):
        _check_cancel(rep)
        rep.status(f"link {a} -> {b} ({i + 1}/{len(pairs)})")
        rep.progress(i, len(pairs))
        first = measure_pair(coord, peers[a], peers[b], first_probe_bytes)
        est = first.bandwidth_mbit_s or 1.0
        nbytes = int(min(max_bytes, max(first_probe_bytes, est * 1e6 / 8 * link_target_s)))
        # the second round's latency probes are spaced for the rate the first one found; its
        # first probe waits for the new connection's handshake and is not counted
        res = measure_pair(coord, peers[a], peers[b], nbytes, latency_gap_s=latency_probe_gap_s(est))
        samples = list(res.one_way_s[1:]) or list(first.one_way_s[1:]) or list(first.one_way_s)
        # agent clocks → coordinator clock: t_coord = t_agent - offset(agent)
        corr = offsets.get(b, 0.0) - offsets.get(a, 0.0)
        one_way = max(0.0, statistics.median(samples) - corr) if samples else 0.0
        m = LinkMeasurement(src=a, dst=b, bandwidth_mbit_s=res.bandwidth_mbit_s, one_way_ms=one_way * 1e3,
                            bytes=res.bytes_received, seconds=res.seconds)
        rep.partial_result(m)
        out.append(m)
    rep.progress(len(pairs), len(pairs))
    return out


def cache_timing_fields(wire: str) -> dict[str, str]:
    """``DeviceTimes``' ``cache_timing`` and ``warm_reason`` from an agent's ``ComputeProfile.cache_timing``
    ("cold", "warm: WHY" or "")."""
    mode, _, why = wire.partition(":")
    if mode not in ("cold", "warm"):
        return {}
    return {"cache_timing": mode, "warm_reason": why.strip() if mode == "warm" else ""}


def _device_times(dev: str, c: ComputeProfile, num_units: int) -> DeviceTimes:
    """One device's times table from its agent's figures (units must cover the whole model)."""
    by_unit = {u.unit: u for u in c.units}
    missing = [u for u in range(num_units) if u not in by_unit]
    if missing:
        raise ProfilingFailed(f"{dev}: no compute figures for units {missing}")
    units = [by_unit[u] for u in range(num_units)]
    return DeviceTimes(
        device=dev,
        decode_batch_sizes=c.decode_batch_sizes,
        decode_s=tuple(tuple(u.decode_s) for u in units),
        prefill_token_counts=c.prefill_token_counts,
        prefill_s=tuple(tuple(u.prefill_s) for u in units),
        decode_spread=tuple(u.decode_spread[0] for u in units),
        stage_decode_overhead_s=c.stage_decode_overhead_s,
        stage_prefill_overhead_s=c.stage_prefill_overhead_s,
        expert_decode_s=(tuple(u.expert_decode_s for u in units)
                         if any(u.expert_decode_s for u in units) else ()),
        **cache_timing_fields(c.cache_timing),
    )


def build_profile(model_config: dict, compute: dict[str, ComputeProfile], links: Sequence[LinkMeasurement], *,
                  dtype: str, model_name: str, prompt_tokens: int, addresses: dict[str, str] | None = None,
                  notes: str = "", on_gpu: dict[tuple[str, str], ComputeProfile] | None = None,
                  precision_times: tuple[DevicePrecisionTimes, ...] = (),
                  gpu_precision_times: dict[tuple[str, str], list[DevicePrecisionTimes]] | None = None) -> Profile:
    """The planner's Profile from measured figures (units must cover the whole model); ``on_gpu``: per
    (device, GPU ``cuda:N``) the units timed on that GPU, its budget that GPU's free memory, and
    ``gpu_precision_times`` its quantized blocks' ratios there (``Profile.accelerator_times``: where the
    planner may place the device's stage, every GPU of it)."""
    spec = model_spec_from_config(model_config, dtype=dtype, name=model_name)
    addresses = addresses or {}
    devices, times = [], []
    for dev in sorted(compute):
        c = compute[dev]
        devices.append(Device(id=dev, name=dev, memory_bytes=c.memory_budget_bytes, address=addresses.get(dev, ""),
                              arch=c.arch, cores=c.cores, accelerator=c.accelerator))
        times.append(_device_times(dev, c, spec.num_units))
    gpus = tuple(AcceleratorTimes(device=dev, torch_device=name, memory_bytes=c.memory_budget_bytes,
                                  times=_device_times(dev, c, spec.num_units),
                                  precision_times=tuple((gpu_precision_times or {}).get((dev, name), ())))
                 for (dev, name), c in sorted((on_gpu or {}).items()) if dev in compute)
    cluster = Cluster(devices=tuple(devices), links=tuple(
        Link(src=m.src, dst=m.dst, bandwidth_mbit_s=max(m.bandwidth_mbit_s, 1e-3), latency_ms=m.one_way_ms)
        for m in links))
    return Profile(model=spec, cluster=cluster, times=tuple(times),
                   profiled_workload=ProfiledWorkload(prompt_tokens=prompt_tokens, batch_size=1),
                   source="measured", notes=notes, accelerator_times=gpus, precision_times=precision_times)


def check_weight_times(model_config: dict, weight_times: Sequence[str]) -> None:
    """``EdgeShardError`` unless each of ``weight_times`` is int8/int4 and the model's blocks quantize to it
    (before any agent is asked)."""
    from agents.weight_precision import UnquantizableWeights, check_quantizable

    bad = [w for w in weight_times if w not in ("int8", "int4")]
    if bad:
        raise EdgeShardError(f"weight times are profiled at int8 and/or int4, not {', '.join(bad)}")
    try:
        for w in weight_times:
            check_quantizable(str(model_config.get("model_type")), w)
    except UnquantizableWeights as err:
        raise EdgeShardError(f"weight times: {err}") from None


def block_time_ratios(coord, device: str, options: ComputeOptions, precisions: Sequence[str],
                      reporter: Reporter, torch_device: str = "cpu") -> list[DevicePrecisionTimes]:
    """``device``'s first decoder block timed at fp and then at each of ``precisions`` back to back (on
    ``torch_device``: its CPU or one of its GPUs, where a quantized stage of it computes), as ratios over
    fp: one device's int8 may be faster than its fp and another's slower, and a GPU's than its CPU's
    (docs/model-shards.md), which one ratio for every device cannot say. A GPU is not timed at int4: its
    weights are packed for the CPU's kernel, and a GPU stage refuses them."""
    if torch_device != "cpu":
        precisions = [w for w in precisions if w != "int4"]
    if not precisions:
        return []
    block = msgspec.structs.replace(options, units=(1,), device=torch_device)
    fp = profile_compute(coord, [device], block, reporter)[device].units[0]
    out = []
    for w in precisions:
        q = profile_compute(coord, [device], msgspec.structs.replace(block, weights=w), reporter)[device].units[0]
        out.append(DevicePrecisionTimes(device=device, weights=w, decode_time_ratio=q.decode_s[0] / fp.decode_s[0],
                                        prefill_time_ratio=q.prefill_s[0] / fp.prefill_s[0]))
    return out


COMPUTE_SHARE = 0.6
"""The part of profiling's one progress bar that timing compute fills (links fill the rest):
about their share of a demo profile's time."""


def time_draft(coord, device: str, draft_dir: str | Path, *, threads: int = 0, context: int = 8,
               timeout_s: float = 120) -> DraftTime:
    """The draft at ``draft_dir`` (the same path on the device's disk) timed by ``device``'s agent
    (``TimeDraft``): one proposed token, at the device's speed."""
    from agents.techniques.speculative.messages import DraftTimed, TimeDraft

    try:
        reply = coord.request(device, TimeDraft(draft_dir=str(draft_dir), threads=threads, context=max(1, context)),
                              timeout_s)
    except EdgeShardError as err:
        raise ProfilingFailed(f"{device}: timing the draft failed: {err}") from None
    if not isinstance(reply, DraftTimed):
        raise ProfilingFailed(f"{device}: unexpected reply {type(reply).__name__} while timing the draft")
    return DraftTime(device=device, draft=Path(draft_dir).name, token_s=reply.token_s)


def profile_cluster(
    coord,
    model_config: dict,
    *,
    model_name: str = "",
    dtype: str = "fp32",
    prompt_tokens: int = 32,
    batch_sizes: Sequence[int] = (1, 2, 4),
    repeats: int = 5,
    headroom_bytes: int = 512 << 20,
    threads: int = 0,
    network: bool = True,
    link_target_s: float = 1.0,
    link_first_probe_bytes: int = 256 << 10,
    reporter: Reporter | None = None,
    out_path: str | Path | None = None,
    gpus: bool = True,
    compute_together: bool = False,
    weight_times: Sequence[str] = (),
    draft_dir: str | Path | None = None,
) -> ClusterProfileResult:
    """Profile every agent of ``coord`` (a connected ``core.devices.agent_link.AgentLink``) for the
    model of ``model_config`` and, if ``out_path`` is given, save the Profile there. ``gpus``: an agent
    whose status reports GPUs has its units timed on each of them too, after its CPU (the profile's
    ``accelerator_times``: every GPU a stage of it may compute on). ``compute_together``: the
    agents' CPU compute at once (``profile_together``: emulated devices of one host, each timed by its
    CPU time), not one after the other. ``weight_times`` (int8, int4): each
    device's own decoder-block time at those precisions over fp (``precision_times``), and each GPU's
    (``AcceleratorTimes.precision_times``). ``draft_dir``: a speculative draft's token timed on each
    device, as a run's source drafts (``draft_times``)."""
    rep = reporter or NullReporter()
    if dtype not in _PROFILER_DTYPES:
        raise EdgeShardError(f"dtype must be one of {', '.join(_PROFILER_DTYPES)}, got {dtype!r}")
    model_spec_from_config(model_config, dtype=dtype)  # unsupported families fail before any work
    rep.status("asking agents for their status")
    statuses = coord.status()
    names = sorted(statuses)
    peers = {d: PeerSpec(device=d, stage=0, data_address=s.data_address, public_key=s.public_key)
             for d, s in statuses.items()}
    addresses = {d: urlparse(s.data_address).hostname or "" for d, s in statuses.items()}
    options = ComputeOptions(config=model_config, prompt_tokens=prompt_tokens, batch_sizes=tuple(batch_sizes),
                             repeats=repeats, dtype=_PROFILER_DTYPES[dtype], headroom_bytes=headroom_bytes,
                             threads=threads)
    check_weight_times(model_config, weight_times)
    measure_network = network and len(names) > 1
    compute_share = COMPUTE_SHARE if measure_network else 1.0  # one bar: compute, then links
    with_gpu = sorted((d, a.name) for d, s in statuses.items() if gpus for a in s.accelerators)  # every GPU
    cpu_share = compute_share * len(names) / (len(names) + len(with_gpu))
    compute = profile_compute(coord, names, options, PhaseReporter(rep, 0.0, cpu_share), together=compute_together)
    on_gpu, gpu_share = {}, (compute_share - cpu_share) / max(1, len(with_gpu))
    for i, (d, gpu) in enumerate(with_gpu):  # one at a time, after the CPUs: as they are
        phase = PhaseReporter(rep, cpu_share + i * gpu_share, gpu_share)
        on_gpu[(d, gpu)] = profile_compute(coord, [d], msgspec.structs.replace(options, device=gpu), phase)[d]
    blocks_rep = PhaseReporter(rep, compute_share, 0.0)  # a few blocks: the bar waits at the end of compute
    precision_times = tuple(t for d in names for t in block_time_ratios(coord, d, options, weight_times, blocks_rep))
    gpu_precision_times = {(d, gpu): block_time_ratios(coord, d, options, weight_times, blocks_rep, gpu)
                           for d, gpu in with_gpu}
    links: list[LinkMeasurement] = []
    if measure_network:
        rep.status("estimating clock offsets")
        clocks = coord.sync_clocks()
        offsets = {d: c.offset_s for d, c in clocks.items()}
        links = measure_links(coord, peers, PhaseReporter(rep, compute_share, 1.0 - compute_share),
                              link_target_s=link_target_s, first_probe_bytes=link_first_probe_bytes, offsets=offsets)
    profile = build_profile(model_config, compute, links, dtype=dtype,
                            model_name=model_name or str(model_config.get("_name_or_path") or
                                                         model_config.get("model_type")),
                            prompt_tokens=prompt_tokens, addresses=addresses, on_gpu=on_gpu,
                            precision_times=precision_times, gpu_precision_times=gpu_precision_times,
                            notes=f"measured by edgeshard profile: {repeats} repeats, median; "
                                  f"links over the agents' data plane")
    if draft_dir is not None:
        rep.status("timing the draft on every device")
        profile = msgspec.structs.replace(profile, draft_times=tuple(
            time_draft(coord, d, draft_dir, threads=threads, context=prompt_tokens) for d in names))
    if out_path is not None:
        from core.formats import save

        save(out_path, profile)
        rep.status(f"profile saved to {out_path}")
    return ClusterProfileResult(profile=profile, links=tuple(links), compute=tuple(compute[d] for d in names))
