"""Profiling on the wire: typed requests and results (agents/profiler.py measures,
core/devices/profiling.py consumes). A request's options and a result are each a small tagged
union (``kind``), so the coordinator decodes exactly the result it asked for and the agent
range-checks what to measure before it starts (each message's ``problem``)."""

from __future__ import annotations

import math
import re
from typing import Any, Literal, Union

import msgspec

from agents.envelope import (
    MAX_NEW_TOKENS,
    MAX_ROWS,
    MAX_STAGES,
    MAX_THREADS,
    MAX_TIMEOUT_S,
    Message,
    PeerSpec,
    all_finite,
    finite,
    ints_problem,
    peer_problem,
    short,
)



DEFAULT_HEADROOM_BYTES = 512 << 20
"""Memory a device keeps for its OS, the agent and activations (subtracted from its budget)."""


class ComputeOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                     tag_field="kind", tag="units"):
    """Time each unit of a model (``agents.profiler.profile_units``)."""

    config: dict[str, Any]
    """The model's HF config.json content (free-form by nature: transformers' ``AutoConfig``
    reads it on the agent; the protocol only checks that it names a ``model_type``)."""
    prompt_tokens: int = 32
    context_tokens: int = 0
    """KV-cache length for decode timing (0: prompt_tokens)."""
    batch_sizes: tuple[int, ...] = (1, 2, 4)
    """Decode batch sizes."""
    prefill_batch_sizes: tuple[int, ...] = (1,)
    """Prefill is timed for prompt_tokens × each of these sequences."""
    repeats: int = 5
    warmup: int = 2
    dtype: str = "float32"
    units: tuple[int, ...] = ()
    """Units to time (empty: all)."""
    threads: int = 0
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES
    seed: int = 0
    device: str = "cpu"
    """Where the agent's runtime computes ("cpu", or "cuda[:N]" on a GPU device); timing and
    the memory budget follow it, as a stage placed there computes (``LoadShard.torch_device``)."""
    weights: str = "fp"
    """The decoder blocks' weight precision (fp, int8, int4: agents.weight_precision), quantized as a
    stage at that precision holds them before they are timed."""


class ConvSweepOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                       tag_field="kind", tag="conv-sweep"):
    """Time 3×3 convolutions over map sizes (a CNN's layers; the profiler's ``conv_sweep``).
    Bounded (``message_problem``) so a request cannot keep an agent busy for hours."""

    sizes: tuple[int, ...] = (8, 16, 24, 32, 48, 64)
    """Map sizes, 1..12 of them in [4, 256]."""
    channels: tuple[int, ...] = (16, 32)
    """Channel counts, 1..6 of them in [1, 512]."""
    repeats: int = 5
    """1..20"""
    threads: int = 0


ProfileOptions = Union[ComputeOptions, ConvSweepOptions]


class LinkOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a ``MeasureLink`` does. The coordinator sends the same probe id to the receiver
    (role "receive", peer = the sender) and the sender (role "send")."""

    role: Literal["send", "receive"]
    probe_id: str = "probe"
    nbytes: int = 1 << 20
    chunk_bytes: int = 64 << 10
    latency_probes: int = 10
    latency_gap_s: float = 0.005
    timeout_s: float = 60.0
    warmup_fraction: float = 0.2
    """Bytes at the start that only open the TCP window (not counted)."""


class UnitTimes(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One unit's median times: ``decode_s`` per decode batch size, ``prefill_s`` per prefill
    token count (the profile's lists, in order); spreads are IQR / median."""

    unit: int
    decode_s: tuple[float, ...]
    decode_spread: tuple[float, ...]
    prefill_s: tuple[float, ...]
    prefill_spread: tuple[float, ...]
    param_bytes: int
    expert_decode_s: float = 0.0
    """A MoE block's one expert on one token (median), so a planner can split the block's decode
    time into its non-expert part and ``top_k`` experts; 0 for a unit without experts."""


class ComputeProfile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                     tag_field="kind", tag="units"):
    """What a device measured for ``ComputeOptions``."""

    device: str
    decode_batch_sizes: tuple[int, ...]
    prefill_token_counts: tuple[int, ...]
    units: tuple[UnitTimes, ...]
    memory_budget_bytes: int
    memory_total_bytes: int
    memory_available_bytes: int
    accelerator: str
    threads: int
    seconds: float
    arch: str = ""
    cores: int = 0
    stage_decode_overhead_s: float = 0.0
    """Once per stage and decode step (smallest decode batch): mask, positions, rotary."""
    stage_prefill_overhead_s: float = 0.0
    """Once per stage and prefill (first prefill batch): the same plus a fresh KV cache."""
    emulation: str = ""
    """The emulated limits already applied to these figures (agents/emulation.py); empty: none."""
    cache_timing: str = ""
    """"cold": the units' weights were out of the CPU's last-level cache at each timed call, as a run
    finds them; "warm: WHY": (some) were in it (agents/cold_profiling.py); empty: not recorded."""


class ConvTimings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                  tag_field="kind", tag="conv-sweep"):
    """What a device measured for ``ConvSweepOptions``: (FLOPs, seconds) per convolution and per
    FC layer (the head is bound by reading weights, so it gets its own fit), scaled by its
    emulated slowdown."""

    samples: tuple[tuple[float, float], ...]
    fc_samples: tuple[tuple[float, float], ...] = ()
    layer_samples: tuple[tuple[float, float, float, float], ...] = ()
    """(FLOPs, weight bytes, activation bytes, seconds) per timed layer slice (the CNN room's
    ``layer_timing_samples``: the swept convs, narrow column slices, small maps with many channels, pools),
    for the per-layer model y = a·FLOPs + b + weight and activation bytes terms; empty from an
    agent that does not time them."""


class LinkResult(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                 tag_field="kind", tag="link"):
    """One side of a link probe (``LinkOptions``); the receiver's carries the figures."""

    role: Literal["send", "receive"]
    probe_id: str
    bytes_received: int = 0
    bandwidth_mbit_s: float = 0.0
    one_way_s: tuple[float, ...] = ()
    """receiver clock at arrival minus sender clock at send, per latency probe."""
    seconds: float = 0.0
    error: str = ""


ProfileOutcome = Union[ComputeProfile, ConvTimings, LinkResult]

RESULT_OF: dict[type, type] = {
    ComputeOptions: ComputeProfile, ConvSweepOptions: ConvTimings, LinkOptions: LinkResult,
}
"""The result type that answers each kind of profiling options."""


class ProfileCompute(Message, frozen=True, tag="profile_compute"):
    """Measure this device's compute; answered by a ``ProfileResult`` holding ``RESULT_OF[type(options)]``."""

    options: ProfileOptions

    def problem(self) -> str:
        o = self.options
        return _compute_options_problem(o) if isinstance(o, ComputeOptions) else _conv_sweep_problem(o)


class MeasureLink(Message, frozen=True, tag="measure_link"):
    """Measure the data link to ``peer``; answered by a ``ProfileResult`` holding a ``LinkResult``."""

    peer: PeerSpec
    options: LinkOptions

    def problem(self) -> str:
        return peer_problem(self.peer) or _link_options_problem(self.options)


class ProfileResult(Message, frozen=True, tag="profile_result"):
    result: ProfileOutcome

    def problem(self) -> str:
        return _outcome_problem(self.result)



_PROFILE_DTYPES = ("float32", "fp32", "float16", "fp16", "bfloat16", "bf16")
_DEVICE = re.compile(r"^(cpu|cuda(:[0-9]{1,3})?)$")


def _compute_options_problem(o: ComputeOptions) -> str:
    """What to time, bounded: a request must not pin a device's worker for hours."""
    if not isinstance(o.config.get("model_type"), str):
        return "compute options: config must be a model's config.json naming its model_type"
    return (
        ("" if 1 <= o.prompt_tokens <= MAX_NEW_TOKENS and 0 <= o.context_tokens <= MAX_NEW_TOKENS
         else f"compute options: prompt_tokens must be in [1, {MAX_NEW_TOKENS}], "
              f"context_tokens in [0, {MAX_NEW_TOKENS}]")
        or ints_problem("compute options: batch_sizes", o.batch_sizes, 1, MAX_ROWS, 16)
        or ints_problem("compute options: prefill_batch_sizes", o.prefill_batch_sizes, 1, MAX_ROWS, 16)
        or ints_problem("compute options: units", o.units, 0, MAX_STAGES, MAX_STAGES, least=0)
        or ("" if 1 <= o.repeats <= 1000 and 0 <= o.warmup <= 1000
            else "compute options: repeats must be in [1, 1000] and warmup in [0, 1000]")
        or ("" if o.dtype in _PROFILE_DTYPES
            else f"compute options: dtype must be one of {', '.join(_PROFILE_DTYPES)}")
        or ("" if 0 <= o.threads <= MAX_THREADS else f"compute options: threads must be in [0, {MAX_THREADS}]")
        or ("" if 0 <= o.headroom_bytes < 1 << 50 and 0 <= o.seed < 1 << 63
            else "compute options: headroom_bytes must be in [0, 2**50) and seed in [0, 2**63)")
        or ("" if _DEVICE.match(o.device)
            else f"compute options: device must be cpu or cuda[:N], got {short(o.device)}")
    )


def _conv_sweep_problem(o: ConvSweepOptions) -> str:
    if (ints_problem("", o.sizes, 4, 256, 12) or ints_problem("", o.channels, 1, 512, 6)
            or not 1 <= o.repeats <= 20 or not 0 <= o.threads <= MAX_THREADS):
        return ("conv-sweep options: sizes = 1..12 ints in [4, 256], channels = 1..6 ints in [1, 512], "
                f"repeats in [1, 20], threads in [0, {MAX_THREADS}]; got sizes={list(o.sizes)[:13]}, "
                f"channels={list(o.channels)[:7]}, repeats={o.repeats}, threads={o.threads}")
    return ""


def _link_options_problem(o: LinkOptions) -> str:
    """A NaN or 1e9 timeout, or terabytes to send, would pin both agents' workers."""
    if not (finite(o.timeout_s, 0.001, MAX_TIMEOUT_S) and finite(o.latency_gap_s, 0, 10)
            and finite(o.warmup_fraction, 0, 0.99)):
        return (f"link options: timeout_s must be in (0, {MAX_TIMEOUT_S:.0f}], latency_gap_s in [0, 10] and "
                f"warmup_fraction in [0, 0.99], got {o.timeout_s!r}, {o.latency_gap_s!r}, {o.warmup_fraction!r}")
    if not (1 <= o.nbytes <= 1 << 32 and 1 <= o.chunk_bytes <= 64 << 20 and 0 <= o.latency_probes <= 10_000):
        return ("link options: nbytes must be in [1, 2**32], chunk_bytes in [1, 64 MiB] and latency_probes in "
                f"[0, 10000], got {o.nbytes}, {o.chunk_bytes}, {o.latency_probes}")
    if not 1 <= len(o.probe_id) <= 64:
        return "link options: probe_id must be 1..64 characters"
    return ""


def _allfinite(values, lo: float = 0.0) -> bool:
    return all(math.isfinite(x) and x >= lo for x in values)


def _outcome_problem(r: ProfileOutcome) -> str:
    """A result the coordinator can build a profile from: shapes agree, times finite and >= 0."""
    if isinstance(r, ComputeProfile):
        for u in r.units:
            if not (len(u.decode_s) == len(u.decode_spread) == len(r.decode_batch_sizes)
                    and len(u.prefill_s) == len(u.prefill_spread) == len(r.prefill_token_counts)):
                return f"unit {u.unit}: one time per decode batch size and per prefill token count"
            if not (_allfinite(u.decode_s) and _allfinite(u.prefill_s) and _allfinite(u.decode_spread)
                    and _allfinite(u.prefill_spread) and u.unit >= 0 and u.param_bytes >= 0):
                return f"unit {u.unit}: times, spreads and sizes must be finite and >= 0"
        if not (_allfinite((r.seconds, r.stage_decode_overhead_s, r.stage_prefill_overhead_s))
                and min(r.memory_budget_bytes, r.memory_total_bytes, r.memory_available_bytes, r.cores) >= 0):
            return "compute profile: seconds, overheads, memory and cores must be finite and >= 0"
    elif isinstance(r, ConvTimings):
        if not r.samples or not all(_allfinite(pair) for pair in (*r.samples, *r.fc_samples)):
            return "conv timings: at least one (FLOPs, seconds) pair, every one finite and >= 0"
    elif not (_allfinite((r.bandwidth_mbit_s, r.seconds)) and r.bytes_received >= 0
              and _allfinite(r.one_way_s, lo=-math.inf)):
        return "link result: bandwidth, seconds and bytes must be finite and >= 0, one-way times finite"
    return ""


