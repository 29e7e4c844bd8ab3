"""Spatial partitioning's wire: its control messages and its ``strip`` data frames' options,
registered with ``agents.registry`` by this room (decoded by the shared total decoder)."""

from __future__ import annotations

import math

import msgspec

from agents.envelope import (
    MAX_STAGES,
    MAX_TIMEOUT_S,
    Message,
    Options,
    PeerSpec,
    all_finite,
    finite,
    peer_problem,
    short,
)

class SpatialNet(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which CNN (agents.techniques.spatial.network.NETWORKS) and the seed of its generated weights,
    or its trained weights: a safetensors file on the agent's disk (the demo's digit CNN)."""

    network: str
    image: int
    width_div: int = 1
    classes: int = 1000
    seed: int = 0
    weights: str = ""


class ComputeStrip(Message, frozen=True, tag="compute_strip"):
    """Spatial partitioning: compute output columns [lo, hi) of layers [start, end) from an input
    strip holding columns [x_lo, x_lo + W) (float32, ``shape`` N×C×H×W, raw bytes, never
    pickled); ``head``: then run the FC head on it (the gateway, on the gathered map).
    Answered by ``StripComputed``. A strip must fit one control frame (``MAX_CONTROL_FRAME``)."""

    net: SpatialNet
    start: int
    end: int
    x_lo: int
    lo: int
    hi: int
    shape: tuple[int, ...]
    data: bytes
    head: bool = False

    def problem(self) -> str:
        return _strip_problem(self)


class StripComputed(Message, frozen=True, tag="strip_computed"):
    """The strip (or class scores) computed, with when it ran on the agent's clock."""

    shape: tuple[int, ...]
    data: bytes
    t_start: float
    t_end: float


class SpatialSetup(Message, frozen=True, tag="spatial_setup"):
    """Spatial partitioning over the data plane (``agents.techniques.spatial.session``): this device's part of a
    map-reduce run. Every device of the plan gets it, workers first; the gateway then takes
    ``ClassifyImage`` requests, scatters each tile's strips (with their halos) to the workers' data
    sockets, computes its own, gathers theirs and runs the head; a worker computes the strips it
    receives and sends them back to the gateway. Answered ``Ok`` once the network is built and
    the peers' keys are allowed; ends with ``StopRun`` (or the lease)."""

    run_id: str
    net: SpatialNet
    devices: tuple[PeerSpec, ...]
    """The plan's devices, ``stage`` = their index in each tile's widths."""
    gateway: str
    groups: tuple[tuple[int, int], ...]
    """Tiles: layer ranges [start, end), consecutive, covering every spatial layer."""
    widths: tuple[tuple[int, ...], ...]
    """Per tile, each device's output columns (left to right, summing to the tile's width)."""
    lease_s: float = 0.0
    strip_timeout_s: float = 60.0
    """How long the gateway waits for a worker's strip before the image fails naming it."""

    def problem(self) -> str:
        return _spatial_setup_problem(self)


class ClassifyImage(Message, frozen=True, tag="classify_image"):
    """To the gateway of a spatial run: one image (float32 1×3×H×W, raw bytes). Answered by
    ``ImageClassified`` (or an ``ErrorReply`` naming the worker that did not answer)."""

    run_id: str
    image: int
    shape: tuple[int, ...]
    data: bytes

    def problem(self) -> str:
        return _image_problem(self)


class StripTimes(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One strip of one image as it went: ``scattered``/``gathered`` on the gateway's clock,
    ``received``/``start``/``end`` on the computing device's clock (the coordinator maps each
    through its own offset). The head is the tile numbered ``len(groups)`` on the gateway."""

    device: str
    group: int
    scattered: float
    received: float
    start: float
    end: float
    gathered: float
    in_bytes: int = 0
    out_bytes: int = 0


class ImageClassified(Message, frozen=True, tag="image_classified"):
    image: int
    scores: tuple[float, ...]
    strips: tuple[StripTimes, ...]

    def problem(self) -> str:
        if len(self.scores) > 100_000 or len(self.strips) > 1 << 16 or not all_finite(self.scores, lo=-math.inf):
            return "scores must be at most 100000 finite numbers, strips at most 65536"
        return ""


class StripRelay(Options, frozen=True, tag="strip-relay"):
    """A ``strip`` frame's result carries the worker's (received, compute start, compute end) on its
    own clock, relayed to the gateway (step = image, micro_batch = tile)."""

    times: tuple[float, ...] = ()

    def problem(self) -> str:
        return "" if len(self.times) <= 8 else f"{len(self.times)} relayed times, at most 8"


STRIP_KIND = "strip"
"""The data frame of a strip: gateway -> worker (its input with halo) and back (its output)."""


def _net_problem(net: SpatialNet) -> str:
    if not (32 <= net.image <= 4096 and 1 <= net.width_div <= 4096 and 1 <= net.classes <= 100_000):
        return "net: image must be in [32, 4096], width_div in [1, 4096], classes in [1, 100000]"
    if len(net.weights) > 4096:
        return "net: the weights file's path is over 4096 characters"
    return ""


def _strip_problem(msg: ComputeStrip) -> str:
    if _net_problem(msg.net):
        return _net_problem(msg.net)
    if not (0 <= msg.start <= msg.end <= 256 and (msg.start < msg.end or msg.head)):
        return f"layers must be a range [start, end) within [0, 256] (empty only with head), got [{msg.start}, {msg.end})"
    if not (0 <= msg.x_lo and 0 <= msg.lo < msg.hi <= 1 << 16):
        return f"columns must satisfy 0 <= x_lo and 0 <= lo < hi, got x_lo={msg.x_lo} [{msg.lo}, {msg.hi})"
    if len(msg.shape) != 4 or any(not 1 <= d <= 1 << 16 for d in msg.shape):
        return f"shape must be 4 dims N×C×H×W in [1, 65536], got {list(msg.shape)[:8]}"
    n, c, h, w = msg.shape
    if n * c * h * w * 4 != len(msg.data):
        return f"data holds {len(msg.data)} bytes, shape {list(msg.shape)} needs {n * c * h * w * 4} (float32)"
    return ""


def _spatial_setup_problem(msg: SpatialSetup) -> str:
    """Ranges only; whether the tiles fit the network is the agent's check (it has the geometry)."""
    if _net_problem(msg.net):
        return _net_problem(msg.net)
    if not 1 <= len(msg.devices) <= MAX_STAGES:
        return f"devices must list 1..{MAX_STAGES} devices"
    if sorted(p.stage for p in msg.devices) != list(range(len(msg.devices))):
        return "devices must be stages 0..n-1 once each"
    if len({p.device for p in msg.devices}) != len(msg.devices):
        return "devices must be named once each"
    for p in msg.devices:
        problem = peer_problem(p)
        if problem:
            return problem
    if msg.gateway not in {p.device for p in msg.devices}:
        return f"gateway {short(msg.gateway)} is not one of the devices"
    if not 1 <= len(msg.groups) <= 256 or len(msg.widths) != len(msg.groups):
        return "groups must list 1..256 tiles, with one widths row each"
    at = 0
    for start, end in msg.groups:
        if start != at or not start < end <= 256:
            return f"groups must be consecutive non-empty layer ranges from 0, got [{start}, {end}) after {at}"
        at = end
    if any(len(row) != len(msg.devices) or any(not 0 <= w <= 1 << 16 for w in row) for row in msg.widths):
        return "every widths row must give each device 0..65536 columns"
    if not (finite(msg.lease_s, 0, MAX_TIMEOUT_S) and finite(msg.strip_timeout_s, 0.001, MAX_TIMEOUT_S)):
        return f"lease_s must be in [0, {MAX_TIMEOUT_S:.0f}] and strip_timeout_s in (0, {MAX_TIMEOUT_S:.0f}]"
    return ""


def _image_problem(msg: ClassifyImage) -> str:
    if not 0 <= msg.image < 1 << 31:
        return f"image must be an index >= 0, got {msg.image}"
    if len(msg.shape) != 4 or msg.shape[0] != 1 or any(not 1 <= d <= 1 << 16 for d in msg.shape):
        return f"shape must be 1×C×H×W (dims in [1, 65536]), got {list(msg.shape)[:8]}"
    if math.prod(msg.shape) * 4 != len(msg.data):
        return f"data holds {len(msg.data)} bytes, shape {list(msg.shape)} needs {math.prod(msg.shape) * 4} (float32)"
    return ""

