"""Spatial partitioning's one cost model: per image, each group is scatter → compute → gather.

For a group of layers and a device's output strip [lo, hi): it receives its input strip with
halo (agents.techniques.spatial.network.group_input_ranges, the agent's own geometry) from the gateway, runs each
layer over the columns the next one reads (a·FLOPs + b per layer), and sends its strip back;
the gateway's own strip moves nothing. Links to the gateway are parallel (the paper's D/B per
send and receive), so a group takes its slowest device's time plus the gateway's own per-tile
work (``tile_overhead_s``, calibrated); the FC head then runs on the gateway. Partitioners, the simulator and Compare all use these functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from agents.techniques.spatial.network import CnnSpec, Layer, group_input_ranges, strip_bounds
from core.techniques.spatial.problem import SpatialDevice, SpatialPlan, SpatialProblem, check


class StripTime(msgspec.Struct, frozen=True, kw_only=True):
    scatter_s: float = 0.0
    compute_s: float = 0.0
    gather_s: float = 0.0
    in_bytes: int = 0
    out_bytes: int = 0

    @property
    def total_s(self) -> float:
        return self.scatter_s + self.compute_s + self.gather_s


def strip_time(layers: Sequence[Layer], device: SpatialDevice, lo: int, hi: int, *, gateway: bool,
               sharing: float = 1.0) -> StripTime:
    """One device's time for output columns [lo, hi) of a group (zero for an empty strip);
    ``sharing`` scales its compute and per-message latency (devices of one host computing at once
    share its cores, also for framing and encryption; the wire time is the link's)."""
    if hi <= lo:
        return StripTime()
    ranges = group_input_ranges(layers, lo, hi)
    compute = sharing * sum(device.time.strip_seconds(layer, i1 - i0, o1 - o0)
                            for layer, (i0, i1), (o0, o1) in zip(layers, ranges, ranges[1:]))
    in_bytes = layers[0].in_bytes(ranges[0][1] - ranges[0][0])
    out_bytes = layers[-1].out_bytes(hi - lo)
    if gateway:
        return StripTime(compute_s=compute)
    link = lambda n: sharing * device.latency_s + n / device.bandwidth_Bps  # noqa: E731
    return StripTime(scatter_s=link(in_bytes), compute_s=compute, gather_s=link(out_bytes),
                     in_bytes=in_bytes, out_bytes=out_bytes)


def group_times(problem: SpatialProblem, spec: CnnSpec, start: int, end: int,
                devices: Sequence[str], widths: Sequence[int]) -> list[StripTime]:
    layers = spec.layers[start:end]
    sharing = sharing_factor(problem, sum(1 for w in widths if w))
    return [strip_time(layers, problem.device(d), lo, hi, gateway=d == problem.gateway, sharing=sharing)
            for d, (lo, hi) in zip(devices, strip_bounds(widths))]


def tile_seconds(problem: SpatialProblem, devices: Sequence[str], widths: Sequence[int],
                 times: Sequence[StripTime]) -> float:
    """A tile's time: its slowest strip (links in parallel) plus the gateway's own work for the
    tile and for each worker it scatters to and gathers from."""
    workers = sum(1 for d, w in zip(devices, widths) if w and d != problem.gateway)
    return max(t.total_s for t in times) + problem.tile_overhead_s + workers * problem.worker_overhead_s


def sharing_factor(problem: SpatialProblem, computing: int) -> float:
    """The problem's compute factor when ``computing`` devices compute a tile at once."""
    scale = problem.concurrency_scale
    return scale[min(computing, len(scale)) - 1] if scale and computing > 0 else 1.0


class SpatialCost(msgspec.Struct, frozen=True, kw_only=True):
    latency_s: float
    """One image, end to end (scatter of the first group to the head's result)."""
    group_s: tuple[float, ...]
    head_s: float
    busy_s: dict[str, float]
    """Per device: compute seconds per image."""
    moved_bytes: int
    fits: bool
    memory_need: dict[str, int]

    @property
    def images_per_s(self) -> float:
        return 1.0 / self.latency_s if self.latency_s > 0 else 0.0


def head_seconds(problem: SpatialProblem, spec: CnnSpec, device: str | None = None) -> float:
    dev = problem.device(device or problem.gateway)
    return (dev.fc_time or dev.time).seconds(spec.head_flops())


def evaluate(problem: SpatialProblem, plan: SpatialPlan) -> SpatialCost:
    """The plan's predicted time per image and each device's memory need: the whole network's
    weights (every agent generates all of them from the seed, ``network_for``: a worker counted
    with only its groups' weights grew 4.0× its prediction, bench/memory_fidelity.py), its largest
    in+out strip; the gateway also the whole maps."""
    check(problem, plan)
    spec = problem.model.spec()
    group_s, busy, moved = [], {d: 0.0 for d in plan.devices}, 0
    need = {d: 0 for d in plan.devices}
    act = {d: 0 for d in plan.devices}
    for (start, end), ws in zip(plan.groups, plan.widths):
        times = group_times(problem, spec, start, end, plan.devices, ws)
        group_s.append(tile_seconds(problem, plan.devices, ws, times))
        for d, t, w in zip(plan.devices, times, ws):
            busy[d] += t.compute_s
            moved += t.in_bytes + t.out_bytes
            if w:
                act[d] = max(act[d], t.in_bytes + t.out_bytes)
    gw = problem.gateway
    if gw not in need:
        need[gw] = act[gw] = 0
    weights = sum(layer.param_bytes() for layer in spec.layers) + spec.head_param_bytes()
    need = {d: weights for d in need}
    act[gw] = max(act[gw], max(layer.in_bytes() + layer.out_bytes() for layer in spec.layers))
    total = {d: need[d] + act[d] for d in need}
    fits = all(total[d] <= problem.device(d).memory_bytes for d in total)
    head = head_seconds(problem, spec)
    busy[gw] = busy.get(gw, 0.0) + head
    return SpatialCost(latency_s=sum(group_s) + head, group_s=tuple(group_s), head_s=head, busy_s=busy,
                       moved_bytes=moved, fits=fits, memory_need=total)


def single_device_seconds(problem: SpatialProblem, device: str | None = None) -> float:
    """The whole network on one device (the gateway by default): the speedup's denominator."""
    spec = problem.model.spec()
    dev = problem.device(device or problem.gateway)
    alone = sharing_factor(problem, 1)
    return (alone * sum(dev.time.strip_seconds(layer, layer.w_in, layer.w_out) for layer in spec.layers)
            + problem.tile_overhead_s
            * len(spec.layers) + head_seconds(problem, spec, dev.id))
