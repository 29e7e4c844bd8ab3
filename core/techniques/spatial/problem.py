"""Spatial partitioning's problem and plan: a CNN, devices with a FLOPs time model, a gateway.

The problem says what each device can do (convolution time y = a·x + b over FLOPs x, fitted
by least squares from timings; its link to the gateway); the plan says, for each group of
consecutive spatial layers (a fused tile; one layer per group when not fused), how many
output columns each device computes. Both are versioned JSON formats.
"""

from __future__ import annotations

import math

from collections.abc import Sequence
from typing import Literal

import msgspec

from agents.techniques.spatial.network import NETWORKS, CnnSpec, Layer, layer_features
from core.errors import EdgeShardError
from core.formats import register_format

PROBLEM_FORMAT = "edgeshard.spatial-problem"
PLAN_FORMAT = "edgeshard.spatial-plan"


class SpatialInputError(EdgeShardError):
    """A spatial problem or plan that cannot be planned or run; says what to change."""


class TimeModel(msgspec.Struct, frozen=True, kw_only=True):
    """Time on one device: ``a`` seconds per FLOP plus ``b`` seconds per layer call, and for a
    spatial layer's strip (``strip_seconds``) seconds per byte of the layer's weights (read on
    every call) and per byte of activations read and written (what bounds a max pool and a narrow
    strip); both 0 in a FLOPs-only model (a scenario's, or one fitted by ``fit_time_model``)."""

    a: float
    b: float = 0.0
    median_rel_error: float = 0.0
    """Median |predicted − measured| / measured over the samples it was fitted to."""
    per_weight_byte: float = 0.0
    per_activation_byte: float = 0.0

    def seconds(self, flops: float) -> float:
        return self.a * flops + self.b

    def scaled(self, factor: float) -> "TimeModel":
        """Every time term × ``factor`` (a device that factor times slower; the fit error kept)."""
        return msgspec.structs.replace(self, a=self.a * factor, b=self.b * factor,
                                       per_weight_byte=self.per_weight_byte * factor,
                                       per_activation_byte=self.per_activation_byte * factor)

    def strip_seconds(self, layer: Layer, in_cols: int, out_cols: int) -> float:
        """Output columns ``out_cols`` of ``layer`` from ``in_cols`` input columns (with halo)."""
        flops, weights, activations = layer_features(layer, in_cols, out_cols)
        return self.a * flops + self.b + self.per_weight_byte * weights + self.per_activation_byte * activations


def fit_time_model(samples: Sequence[tuple[float, float]]) -> TimeModel:
    """Least-squares fit of y = a·x + b to (FLOPs, seconds) samples, with its median relative error.

    A negative intercept (noise at small maps) is clamped to 0 and ``a`` refitted through the
    origin, so a tiny strip never gets a negative time."""
    pts = [(float(x), float(y)) for x, y in samples if y > 0]
    if len(pts) < 2 or len({x for x, _ in pts}) < 2:
        raise SpatialInputError("fitting the time model needs timings at two or more map sizes; profile again")
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    a = sum((x - mx) * (y - my) for x, y in pts) / sxx
    b = my - a * mx
    if b < 0 or a <= 0:
        a, b = sum(x * y for x, y in pts) / sum(x * x for x, _ in pts), 0.0
    errs = sorted(abs(a * x + b - y) / y for x, y in pts)
    med = errs[n // 2] if n % 2 else (errs[n // 2 - 1] + errs[n // 2]) / 2
    return TimeModel(a=a, b=b, median_rel_error=med)


def fit_layer_time_model(samples: Sequence[tuple[float, float, float, float]]) -> TimeModel:
    """Fit y = a·FLOPs + b + per_weight_byte·weights + per_activation_byte·activations to
    (FLOPs, weight bytes, activation bytes, seconds) layer-strip samples, by least squares on the
    relative error (the samples span 10 µs to milliseconds); a term that comes out negative is
    dropped and the rest refitted, so no strip gets a negative time. Its median relative error
    is reported like ``fit_time_model``'s."""
    import numpy as np

    pts = [(float(f), float(w), float(m), float(y)) for f, w, m, y in samples if y > 0]
    if len(pts) < 4 or len({f for f, _, _, _ in pts}) < 2:
        raise SpatialInputError("fitting the per-layer time model needs four or more timed layer strips at "
                                "two or more sizes; profile again")
    y = np.array([p[3] for p in pts])
    x = np.array([[p[0], 1.0, p[1], p[2]] for p in pts])
    keep = [0, 1, 2, 3]
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep] / y[:, None], np.ones(len(y)), rcond=None)
        if coef[0] <= 0:
            return fit_time_model([(p[0], p[3]) for p in pts])
        negative = [k for k, c in zip(keep, coef) if c < 0]
        if not negative:
            break
        keep.remove(negative[0])
    full = dict.fromkeys(range(4), 0.0) | dict(zip(keep, (float(c) for c in coef)))
    pred = x @ np.array([full[k] for k in range(4)])
    errs = np.sort(np.abs(pred - y) / y)
    return TimeModel(a=full[0], b=full[1], per_weight_byte=full[2], per_activation_byte=full[3],
                     median_rel_error=float(np.median(errs)))


class SpatialDevice(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    time: TimeModel
    """Spatial layers (conv, pool, residual blocks): seconds from FLOPs."""
    fc_time: TimeModel | None = None
    """The fully connected head (memory-bound, so its own fit); ``time`` when not measured."""
    bandwidth_Bps: float
    """Its link to the gateway, bytes per second each way (unused for the gateway itself)."""
    latency_s: float = 0.0
    """One-way latency per message on that link."""
    memory_bytes: int = 1 << 40


class CnnRef(msgspec.Struct, frozen=True, kw_only=True):
    """Which network: one of ``agents.techniques.spatial.network.NETWORKS``, its input size and channel divisor."""

    network: Literal["vgg16", "resnet-style"] = "vgg16"
    image: int = 224
    width_div: int = 1
    classes: int = 1000
    weights: str = ""
    """A safetensors file of trained weights (the demo's digit CNN), read by the agents from their
    own disk; empty: weights generated from the run's seed."""
    labels: tuple[str, ...] = ()
    """The classes' names, shown beside each image's class (empty: class numbers)."""

    def spec(self) -> CnnSpec:
        return NETWORKS[self.network](self.image, self.width_div, self.classes)

    def build(self, seed: int = 0):
        """The network itself (the agents build the same one): the single-device reference."""
        from agents.techniques.spatial.network import network_for

        return network_for(self.network, self.image, self.width_div, self.classes, seed, self.weights)

    def label(self, index: int) -> str:
        return self.labels[index] if 0 <= index < len(self.labels) else f"class {index}"


class SpatialProblem(msgspec.Struct, frozen=True, kw_only=True):
    format: Literal["edgeshard.spatial-problem"] = PROBLEM_FORMAT
    version: int = 1
    name: str = "spatial"
    model: CnnRef
    devices: tuple[SpatialDevice, ...]
    gateway: str
    """The device that holds the image, scatters and gathers strips and runs the FC head."""
    images: int = 1
    """Images streamed through per run (one after another)."""
    tile_overhead_s: float = 0.0
    """The gateway's own work per tile besides strips (cutting, framing, concatenating): 0 unless
    calibrated from a real run (``core.techniques.spatial.calibration``)."""
    worker_overhead_s: float = 0.0
    """The gateway's work per tile and per worker it scatters to and gathers from (cutting that
    strip, framing and handing it to the link, taking its result in), on top of ``tile_overhead_s``:
    0 unless calibrated from probes with different worker counts."""
    concurrency_scale: tuple[float, ...] = ()
    """Compute-time (and per-message latency) factor when k devices compute a tile at once (index
    k − 1; beyond the end: the last): devices that share a host's cores (an emulated local
    cluster) slow each other.
    Empty: 1 (devices on their own hardware). Calibrated, never guessed."""

    def device(self, name: str) -> SpatialDevice:
        for d in self.devices:
            if d.id == name:
                return d
        raise SpatialInputError(f"no device {name!r} in problem {self.name!r} (it has: "
                                f"{', '.join(d.id for d in self.devices)})")


class SpatialPlan(msgspec.Struct, frozen=True, kw_only=True):
    format: Literal["edgeshard.spatial-plan"] = PLAN_FORMAT
    version: int = 1
    strategy: str = ""
    devices: tuple[str, ...]
    """Left to right: device i computes the i-th strip of every group."""
    groups: tuple[tuple[int, int], ...]
    """Spatial layers [start, end) computed as one tile between a scatter and a gather."""
    widths: tuple[tuple[int, ...], ...]
    """Per group, each device's output columns of the group's last layer (0: idle in that group)."""


def problem_violations(problem: SpatialProblem) -> list[str]:
    out = []
    ids = [d.id for d in problem.devices]
    if not ids:
        out.append("the problem has no devices")
    if len(set(ids)) != len(ids):
        out.append("a device id appears twice")
    if problem.gateway not in ids:
        out.append(f"gateway {problem.gateway!r} is not one of the devices")
    for d in problem.devices:
        if not (d.time.a > 0 and d.time.b >= 0 and d.time.per_weight_byte >= 0 and d.time.per_activation_byte >= 0):
            out.append(f"device {d.id}: time model needs a > 0 and b, per_weight_byte, per_activation_byte >= 0 "
                       "(profile it again)")
        if d.id != problem.gateway and not d.bandwidth_Bps > 0:
            out.append(f"device {d.id}: bandwidth to the gateway must be > 0")
    if not (math.isfinite(problem.tile_overhead_s) and problem.tile_overhead_s >= 0):
        out.append("tile_overhead_s must be a finite number >= 0")
    if not (math.isfinite(problem.worker_overhead_s) and problem.worker_overhead_s >= 0):
        out.append("worker_overhead_s must be a finite number >= 0")
    if not all(math.isfinite(f) and f > 0 for f in problem.concurrency_scale):
        out.append("concurrency_scale factors must be finite numbers > 0")
    if problem.model.image < 32 or problem.model.width_div < 1 or problem.images < 1:
        out.append("model image must be >= 32, width_div >= 1 and images >= 1")
    return out


def plan_violations(problem: SpatialProblem, plan: SpatialPlan) -> list[str]:
    """Every rule the plan breaks: groups must tile the spatial layers, widths their maps."""
    spec = problem.model.spec()
    out = []
    known = {d.id for d in problem.devices}
    out += [f"device {d!r} is not in the problem" for d in plan.devices if d not in known]
    if len(set(plan.devices)) != len(plan.devices):
        out.append("a device appears twice")
    at = 0
    for start, end in plan.groups:
        if start != at or end <= start:
            out.append(f"group [{start}, {end}) does not continue at layer {at}")
        at = end
    if at != len(spec.layers):
        out.append(f"groups end at layer {at}, the network has {len(spec.layers)} spatial layers")
    if len(plan.widths) != len(plan.groups):
        out.append(f"{len(plan.widths)} width lists for {len(plan.groups)} groups")
    for (start, end), ws in zip(plan.groups, plan.widths):
        if not 0 < end <= len(spec.layers):
            continue
        w = spec.layers[end - 1].w_out
        if len(ws) != len(plan.devices) or sum(ws) != w or min(ws, default=0) < 0:
            out.append(f"group [{start}, {end}): widths {list(ws)} must be {len(plan.devices)} "
                       f"non-negative numbers summing to its width {w}")
    return out


def check(problem: SpatialProblem, plan: SpatialPlan | None = None) -> None:
    bad = problem_violations(problem) + (plan_violations(problem, plan) if plan is not None else [])
    if bad:
        raise SpatialInputError("spatial plan/problem is invalid: " + "; ".join(bad))


register_format(PROBLEM_FORMAT, SpatialProblem, 1)
register_format(PLAN_FORMAT, SpatialPlan, 1)
