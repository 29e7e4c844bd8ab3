"""EPD's shared types: requests and workloads, the phase-cost calibration, pool configurations,
per-request metrics and SLOs.

The simulator, the search, the real run over three pools of agents and the studio all speak
these, so a simulated and a measured request are compared field by field. Each type checks
itself at construction (``EpdInputError``, also inside ``core.formats.decode`` where msgspec
turns it into a ``FormatError`` naming the field), so nothing downstream re-validates.
"""

from __future__ import annotations

import bisect
import math
from pathlib import Path
from typing import Literal

import msgspec

from core import formats
from core.errors import EdgeShardError

WORKLOAD_FORMAT = "edgeshard.epd-workload"
COSTS_FORMAT = "edgeshard.epd-costs"
POOLS_FORMAT = "edgeshard.epd-pools"
METRICS_FORMAT = "edgeshard.epd-metrics"
PROBLEM_FORMAT = "edgeshard.epd-problem"

Disaggregation = Literal["epd", "pd", "aggregated"]
"""epd: three pools; pd: encode runs on the prefill pool (DistServe-style); aggregated: one pool
does every phase of a request on one device."""
DISAGGREGATIONS: tuple[str, ...] = ("epd", "pd", "aggregated")

Policy = Literal["fcfs", "shortest-first"]
"""Which waiting request a free worker takes: the oldest, or the one with the least work in that
phase (tiles to encode, tokens to prefill, tokens to decode)."""
POLICIES: tuple[str, ...] = ("fcfs", "shortest-first")


class EpdInputError(EdgeShardError, ValueError):
    """An EPD request, workload, calibration or pool configuration that cannot be simulated or run.

    Also a ``ValueError`` so msgspec reports it as a validation error of the decoded field."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise EpdInputError(message)


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


class Request(msgspec.Struct, frozen=True, kw_only=True):
    """One multimodal request: images (each cut into tiles), a text prompt, a number of tokens to generate."""

    id: int
    arrival_s: float
    images: int
    tiles_per_image: int
    prompt_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        _require(self.id >= 0, f"request id must be >= 0, got {self.id}")
        _require(_finite(self.arrival_s) and self.arrival_s >= 0,
                 f"request {self.id}: arrival_s must be a finite time >= 0, got {self.arrival_s}")
        _require(self.images >= 0, f"request {self.id}: images must be >= 0, got {self.images}")
        _require(self.tiles_per_image >= 1, f"request {self.id}: tiles_per_image must be >= 1, "
                                            f"got {self.tiles_per_image}")
        _require(self.prompt_tokens >= 1, f"request {self.id}: prompt_tokens must be >= 1, got {self.prompt_tokens}")
        _require(self.output_tokens >= 1, f"request {self.id}: output_tokens must be >= 1, got {self.output_tokens}")

    @property
    def tiles(self) -> int:
        return self.images * self.tiles_per_image


WorkloadSource = Literal["poisson", "trace", "explicit"]


class Workload(msgspec.Struct, frozen=True, kw_only=True):
    """Requests in arrival order, and how they were made (so a run can be reproduced)."""

    format: Literal["edgeshard.epd-workload"] = WORKLOAD_FORMAT
    version: int = 1
    source: WorkloadSource = "explicit"
    rate_rps: float | None = None
    """Poisson: mean arrivals per second."""
    seed: int | None = None
    """Poisson: the random seed."""
    trace: str = ""
    """Trace: the file the arrivals came from."""
    requests: tuple[Request, ...]

    def __post_init__(self) -> None:
        _require(len(self.requests) > 0, "a workload needs at least one request")
        ids = [r.id for r in self.requests]
        _require(len(set(ids)) == len(ids), "request ids must be unique in a workload")
        for a, b in zip(self.requests, self.requests[1:]):
            _require(b.arrival_s >= a.arrival_s,
                     f"requests must be in arrival order: request {b.id} arrives at {b.arrival_s} s, "
                     f"before request {a.id} at {a.arrival_s} s")
        if self.source == "poisson":
            _require(self.rate_rps is not None and _finite(self.rate_rps) and self.rate_rps > 0,
                     "a Poisson workload needs rate_rps > 0")
            _require(self.seed is not None, "a Poisson workload needs its seed")
        if self.source == "trace":
            _require(bool(self.trace), "a trace workload names its trace file")

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s


def _check_compute(c, owner: str) -> None:
    """The compute fields ``PhaseCosts`` and ``DevicePhaseCosts`` share, checked once for both."""
    for name in ("encode_s_per_tile", "prefill_s_per_token"):
        v = getattr(c, name)
        _require(_finite(v) and v > 0, f"{owner}{name} must be > 0 (profile the phase again), got {v}")
    for name in ("encode_overhead_s", "prefill_overhead_s", "encode_input_s_per_tile"):
        v = getattr(c, name)
        _require(_finite(v) and v >= 0, f"{owner}{name} must be >= 0, got {v}")
    _require(c.encode_input_s_per_tile <= c.encode_s_per_tile,
             f"{owner}encode_input_s_per_tile ({c.encode_input_s_per_tile}) is part of encode_s_per_tile "
             f"({c.encode_s_per_tile}): it cannot be more")
    pts = c.decode_step_s
    _require(len(pts) >= 1, f"{owner}decode_step_s needs at least one (batch size, seconds) point")
    for b, s in pts:
        _require(b >= 1 and _finite(s) and s > 0,
                 f"{owner}decode_step_s point ({b}, {s}): batch >= 1 and seconds > 0")
    _require(all(b2 > b1 for (b1, _), (b2, _) in zip(pts, pts[1:])),
             f"{owner}decode_step_s batch sizes must increase strictly")


class DevicePhaseCosts(msgspec.Struct, frozen=True, kw_only=True):
    """One device's own phase speeds (``PhaseCosts.devices``): each phase timed on that agent.

    One calibration for unequal devices priced a phase on a slower agent than the one it was timed
    on too fast (docs/gui.md: encode on the demo's edge-c took 26 ms against 7.4 predicted)."""

    device: str
    encode_s_per_tile: float
    encode_overhead_s: float = 0.0
    encode_input_s_per_tile: float = 0.0
    """Of ``encode_s_per_tile``: the tiles' trip to this encode agent (``PhaseCosts``'s field)."""
    prefill_s_per_token: float
    prefill_overhead_s: float = 0.0
    decode_step_s: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        _require(bool(self.device), "a device's phase costs name their device")
        _check_compute(self, f"{self.device}: ")


class PhaseCosts(msgspec.Struct, frozen=True, kw_only=True):
    """The calibration the simulator times phases with (profiled on agents, or a preset).

    A device listed in ``devices`` runs at its own speeds; any other at the top-level ones."""

    format: Literal["edgeshard.epd-costs"] = COSTS_FORMAT
    version: int = 1
    source: str = ""
    """Where the figures come from (``profiled on local-cluster``, ``paper-scale preset``)."""
    encode_s_per_tile: float
    encode_overhead_s: float = 0.0
    """Per encode call (one worker's share of one request), on top of the tiles."""
    encode_input_s_per_tile: float = 0.0
    """Of ``encode_s_per_tile``, the part that is a tile's pixels reaching the encode agent (the control
    hop that carries them) before its compute starts: the agent is busy for all of it, but the encode
    span it reports (and the simulator draws) starts after it. 0 in files older than the field (the
    span then included the trip: edge-a's encode was predicted 1.4–1.7× what the agent took)."""
    mm_tokens_per_tile: int
    """Multimodal tokens one tile becomes (they join the prompt at prefill)."""
    prefill_s_per_token: float
    prefill_overhead_s: float = 0.0
    """Per prefill batch."""
    decode_step_s: tuple[tuple[int, float], ...]
    """(batch size, seconds per decode step) points, increasing batch; linear between and beyond."""
    mm_token_bytes: int
    """Bytes of one multimodal token sent E→P (hidden size × dtype bytes)."""
    kv_token_bytes: int
    """Bytes of one token's KV cache sent P→D (all layers, K and V)."""
    link_bandwidth_Bps: float
    link_latency_s: float = 0.0
    dispatch_delay_s: float = 0.0
    """From a request's arrival to its first phase starting on an agent (the coordinator releasing
    it, the control hop there), paid once per request; 0 in files older than the field."""
    devices: tuple[DevicePhaseCosts, ...] = ()
    """Per-device phase speeds (``on_agents.measure_costs`` times every phase on every agent); empty:
    every device at the top-level speeds, as in files older than the field."""

    def __post_init__(self) -> None:
        _check_compute(self, "")
        for name in ("link_latency_s", "dispatch_delay_s"):
            v = getattr(self, name)
            _require(_finite(v) and v >= 0, f"{name} must be >= 0, got {v}")
        _require(self.mm_tokens_per_tile >= 1, f"mm_tokens_per_tile must be >= 1, got {self.mm_tokens_per_tile}")
        _require(self.mm_token_bytes >= 1 and self.kv_token_bytes >= 1, "mm_token_bytes and kv_token_bytes must be >= 1")
        _require(_finite(self.link_bandwidth_Bps) and self.link_bandwidth_Bps > 0,
                 f"link_bandwidth_Bps must be > 0, got {self.link_bandwidth_Bps}")
        names = [d.device for d in self.devices]
        _require(len(set(names)) == len(names), "a device's phase costs appear twice")

    def on(self, device: str) -> "PhaseCosts | DevicePhaseCosts":
        """The speeds ``device`` runs at: its own when measured, else the top-level ones."""
        for d in self.devices:
            if d.device == device:
                return d
        return self

    def encode_s(self, tiles: int, device: str = "") -> float:
        """One encode call over ``tiles`` tiles (on ``device``)."""
        c = self.on(device) if self.devices else self
        return c.encode_overhead_s + tiles * c.encode_s_per_tile if tiles > 0 else 0.0

    def encode_input_s(self, tiles: int, device: str = "") -> float:
        """Of ``encode_s``: the ``tiles``' trip to the encode agent, before its compute starts."""
        return tiles * (self.on(device) if self.devices else self).encode_input_s_per_tile

    def prefill_s(self, tokens: int, device: str = "") -> float:
        """One prefill batch holding ``tokens`` tokens in all (on ``device``)."""
        c = self.on(device) if self.devices else self
        return c.prefill_overhead_s + tokens * c.prefill_s_per_token

    def decode_step_seconds(self, batch: int, device: str = "") -> float:
        """One decode step of ``batch`` sequences (on ``device``): piecewise linear through the
        points, extended flat below the first and along the last segment's slope beyond the last."""
        pts = (self.on(device) if self.devices else self).decode_step_s
        if len(pts) == 1 or batch <= pts[0][0]:
            return pts[0][1]
        i = min(bisect.bisect_left([b for b, _ in pts], batch), len(pts) - 1)
        (b1, s1), (b2, s2) = pts[i - 1], pts[i]
        return max(s1 + (s2 - s1) * (batch - b1) / (b2 - b1), 1e-12)

    def transfer_s(self, nbytes: int) -> float:
        return self.link_latency_s + nbytes / self.link_bandwidth_Bps if nbytes > 0 else 0.0

    def mm_tokens(self, request: Request) -> int:
        return request.tiles * self.mm_tokens_per_tile

    def prefill_tokens(self, request: Request) -> int:
        """What prefill runs over: the request's multimodal tokens and its text prompt."""
        return self.mm_tokens(request) + request.prompt_tokens


class PoolConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Which device serves which phase, and how each pool batches and schedules."""

    format: Literal["edgeshard.epd-pools"] = POOLS_FORMAT
    version: int = 1
    disaggregation: Disaggregation = "epd"
    encode: tuple[str, ...]
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    encode_batch: int = 1
    """Requests one encode worker takes at once."""
    prefill_batch: int = 1
    """Requests per prefill batch."""
    decode_batch: int = 8
    """Sequences one decode worker runs in its continuous batch."""
    irp_degree: int = 1
    """Encode workers one request's tiles are split over (intra-request parallelism)."""
    policy: Policy = "fcfs"
    mm_cache_tokens: int = 1 << 20
    """Multimodal-token cache per encode worker (outgoing) and per prefill worker (incoming):
    an encode worker whose cache is full waits (back-pressure) instead of queueing more."""
    kv_cache_tokens: int = 1 << 22
    """KV-cache tokens one decode worker holds: a request waits for room before its KV moves."""

    def __post_init__(self) -> None:
        for pool in ("encode", "prefill", "decode"):
            devs = getattr(self, pool)
            _require(len(devs) >= 1, f"the {pool} pool needs at least one device")
            _require(len(set(devs)) == len(devs), f"a device appears twice in the {pool} pool")
            _require(all(d for d in devs), f"the {pool} pool has an empty device name")
        for name in ("encode_batch", "prefill_batch", "decode_batch", "irp_degree"):
            _require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        _require(self.irp_degree <= len(self.encode),
                 f"irp_degree {self.irp_degree} exceeds the {len(self.encode)} encode device(s)")
        _require(self.mm_cache_tokens >= 1 and self.kv_cache_tokens >= 1, "cache sizes must be >= 1 token")
        if self.disaggregation == "epd":
            shared = (set(self.encode) & set(self.prefill)) | (set(self.encode) & set(self.decode)) \
                | (set(self.prefill) & set(self.decode))
            _require(not shared, f"EPD pools must be disjoint; shared: {', '.join(sorted(shared))}")
        elif self.disaggregation == "pd":
            _require(self.encode == self.prefill, "PD-only couples encode to prefill: the encode pool must be "
                                                  "the prefill pool")
            _require(not set(self.prefill) & set(self.decode), "PD-only: prefill and decode pools must be disjoint")
        else:
            _require(self.encode == self.prefill == self.decode,
                     "aggregated: the encode, prefill and decode pools must be the same devices")

    @property
    def devices(self) -> tuple[str, ...]:
        """Every device once, in pool order."""
        return tuple(dict.fromkeys(self.encode + self.prefill + self.decode))


class RequestMetrics(msgspec.Struct, frozen=True, kw_only=True):
    """What happened to one request, simulated or measured (seconds from the run's start)."""

    request_id: int
    arrival_s: float
    encode_start_s: float
    encode_end_s: float
    """All of the request's tiles encoded (the last IRP worker done); = arrival without images."""
    ep_transfer_end_s: float
    """All multimodal tokens in the prefill side's cache."""
    prefill_start_s: float
    prefill_end_s: float
    """The first token exists."""
    pd_transfer_end_s: float
    """The KV cache is on the decode device."""
    decode_end_s: float
    """The last token exists."""
    output_tokens: int
    encode_devices: tuple[str, ...] = ()
    prefill_device: str = ""
    decode_device: str = ""

    def __post_init__(self) -> None:
        times = [("arrival_s", self.arrival_s), ("encode_start_s", self.encode_start_s),
                 ("encode_end_s", self.encode_end_s), ("ep_transfer_end_s", self.ep_transfer_end_s),
                 ("prefill_start_s", self.prefill_start_s), ("prefill_end_s", self.prefill_end_s),
                 ("pd_transfer_end_s", self.pd_transfer_end_s), ("decode_end_s", self.decode_end_s)]
        for name, t in times:
            _require(_finite(t) and t >= 0, f"request {self.request_id}: {name} must be a finite time >= 0, got {t}")
        for (n1, t1), (n2, t2) in zip(times, times[1:]):
            _require(t2 >= t1 - 1e-9, f"request {self.request_id}: {n2} ({t2}) is before {n1} ({t1})")
        _require(self.output_tokens >= 1, f"request {self.request_id}: output_tokens must be >= 1")

    @property
    def ttft_s(self) -> float:
        return self.prefill_end_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        """Seconds per output token after the first (0 for a one-token answer)."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.decode_end_s - self.prefill_end_s) / (self.output_tokens - 1)

    @property
    def e2e_s(self) -> float:
        return self.decode_end_s - self.arrival_s


class MetricsFile(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request metrics of one run (simulated or measured), saved for comparison."""

    format: Literal["edgeshard.epd-metrics"] = METRICS_FORMAT
    version: int = 1
    origin: Literal["simulated", "measured"]
    requests: tuple[RequestMetrics, ...]


class SLO(msgspec.Struct, frozen=True, kw_only=True):
    """The service-level objective a request must meet to count towards goodput."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        _require(_finite(self.ttft_s) and self.ttft_s > 0, f"SLO ttft_s must be > 0, got {self.ttft_s}")
        _require(_finite(self.tpot_s) and self.tpot_s > 0, f"SLO tpot_s must be > 0, got {self.tpot_s}")

    def met(self, m: RequestMetrics) -> bool:
        return m.ttft_s <= self.ttft_s and m.tpot_s <= self.tpot_s


class PhaseWeights(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Bytes of weights each kind of EPD agent holds at the run's dtype (``memory.phase_weights``
    reads them from a Llava checkpoint's headers)."""

    encode_bytes: int
    """The vision tower and the projector."""
    text_bytes: int
    """The text model with its LM head (prefill and decode agents each hold one)."""
    encode_bytes_per_tile: int = 0
    """What encoding one tile holds at once beside the weights: the vision tower's hidden states of
    every layer and its largest step's temporaries (``memory.encode_bytes_per_tile``)."""
    prefill_bytes_per_token: int = 0
    """What a prefill holds at once per token beside the weights and KV: the text model's largest
    unit's workspace, as layer sharding's memory model counts it (``core.models.units``)."""

    def __post_init__(self) -> None:
        _require(min(self.encode_bytes, self.text_bytes, self.encode_bytes_per_tile, self.prefill_bytes_per_token) >= 0,
                 "phase weights must be >= 0 bytes")


class EpdProblem(msgspec.Struct, frozen=True, kw_only=True):
    """What the search and the baselines plan for: a calibration, a workload, an SLO and a device budget."""

    format: Literal["edgeshard.epd-problem"] = PROBLEM_FORMAT
    version: int = 1
    name: str = "epd"
    costs: PhaseCosts
    workload: Workload
    slo: SLO
    devices: tuple[str, ...]
    """The devices the pools may use (the budget); all run at ``costs``' speeds."""
    mm_cache_tokens: int = 1 << 16
    """The multimodal cache each encode and prefill worker has room for (``PoolConfig.mm_cache_tokens``)."""
    kv_cache_tokens: int = 1 << 20
    """The KV cache each decode worker has room for."""
    weights: PhaseWeights | None = None
    """The model's weights per phase (None: the memory model is not checked, only timed)."""
    memory_budget_bytes: int = 0
    """Memory each device has for its phases (0: unbounded); ``memory.device_memory`` is checked
    against it with ``weights``."""

    def __post_init__(self) -> None:
        _require(len(self.devices) >= 1, "an EPD problem needs at least one device")
        _require(self.memory_budget_bytes >= 0, f"memory_budget_bytes must be >= 0, got {self.memory_budget_bytes}")
        _require(self.mm_cache_tokens >= 1 and self.kv_cache_tokens >= 1, "cache sizes must be >= 1 token")
        _require(len(set(self.devices)) == len(self.devices), "a device appears twice in the problem")
        _require(all(self.devices), "a device name is empty")

    def check_config(self, config: PoolConfig) -> None:
        """A pool configuration may only use the problem's devices."""
        unknown = [d for d in config.devices if d not in self.devices]
        _require(not unknown, f"the pools use device(s) {', '.join(unknown)} that the problem does not have "
                              f"(it has: {', '.join(self.devices)})")


def load_costs(path: str | Path) -> PhaseCosts:
    return formats.load(path, PhaseCosts)


def save_costs(path: str | Path, costs: PhaseCosts) -> None:
    formats.save(path, costs)


def load_workload(path: str | Path) -> Workload:
    return formats.load(path, Workload)


def load_pools(path: str | Path) -> PoolConfig:
    return formats.load(path, PoolConfig)


formats.register_format(WORKLOAD_FORMAT, Workload, 1)
formats.register_format(COSTS_FORMAT, PhaseCosts, 1)
formats.register_format(POOLS_FORMAT, PoolConfig, 1)
formats.register_format(METRICS_FORMAT, MetricsFile, 1)
formats.register_format(PROBLEM_FORMAT, EpdProblem, 1)

__all__ = [
    "COSTS_FORMAT", "DISAGGREGATIONS", "DevicePhaseCosts", "Disaggregation", "EpdInputError", "EpdProblem", "PROBLEM_FORMAT", "METRICS_FORMAT", "MetricsFile",
    "POLICIES", "POOLS_FORMAT", "PhaseCosts", "PhaseWeights", "Policy", "PoolConfig", "Request", "RequestMetrics", "SLO",
    "WORKLOAD_FORMAT", "Workload", "load_costs", "load_pools", "load_workload", "save_costs",
]
