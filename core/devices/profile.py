"""Measured (or synthetic) costs: per device and per unit compute times, plus the cluster.

A ``Profile`` is what profiling produces and what a planning problem is built from.
Compute times are sampled at a few batch sizes (decode) and prompt token counts
(prefill) and read back by one documented rule, ``interpolate``, so measured,
synthetic and shipped profiles share one format and one cost model.
"""

from __future__ import annotations

import collections
import math
import threading
from bisect import bisect_left
from typing import Literal

import msgspec

from core.formats import register_format

from core.devices.cluster import Cluster
from core.models.units import ModelSpec
from core.models.weight_quality import DevicePrecisionTimes, PrecisionQuality, device_times_errors, quality_errors

PROFILE_FORMAT = "edgeshard.profile"
PROFILE_VERSION = 7
"""2: ``DeviceTimes.cache_timing`` / ``warm_reason``. 3: ``ModelUnit.linear_params`` / ``linear_rows``
(a version-2 profile's int8/int4 stages are counted at their fp bytes). 4: ``Profile.accelerator_times``
(an older profile has none: every stage is planned on the CPU). 5: ``Profile.precision_times`` (none:
every device's quantized blocks are costed by ``weight_quality``'s ratios). 6: ``Profile.draft_times``
(none: a speculative draft's token is costed by proxy). 7: every GPU of a device (``accelerator_times``
one per device and GPU) and ``AcceleratorTimes.precision_times`` (none: a GPU stage's quantized blocks
take its device's CPU ratio, as before). Older files load: the fields
they lack are not recorded (their defaults), and the value is migrated to this version
(``Profile.__post_init__``)."""


class DeviceTimes(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Compute times of every unit on one device.

    ``decode_s[u][i]``: seconds for one decode step of unit ``u`` over
    ``decode_batch_sizes[i]`` sequences (one new token each) with the workload's context.
    ``prefill_s[u][i]``: seconds for unit ``u`` to process ``prefill_token_counts[i]``
    prompt tokens in one pass (batch × prompt length).
    """

    device: str
    decode_batch_sizes: tuple[int, ...]
    decode_s: tuple[tuple[float, ...], ...]
    prefill_token_counts: tuple[int, ...]
    prefill_s: tuple[tuple[float, ...], ...]
    decode_spread: tuple[float, ...] = ()
    """Optional relative spread (IQR / median) per unit of the decode measurement."""
    stage_decode_overhead_s: float = 0.0
    """Seconds a stage holding decoder blocks spends once per decode step outside the
    units' forwards: the attention mask grown by one column, positions, the causal mask
    and the rotary embedding, which the runtime builds once per stage and passes to
    every block. Measured at the smallest decode batch (it hardly depends on it); 0 in
    profiles that predate it, whose block times included it once per block instead."""
    stage_prefill_overhead_s: float = 0.0
    """The same once-per-stage work for a prefill (plus a fresh KV cache)."""
    expert_decode_s: tuple[float, ...] = ()
    """Per unit, a MoE block's one expert on one token (0 for units without experts; empty in
    profiles of dense models or that predate it): expert offloading's planner splits a block's
    decode time into its non-expert part and ``top_k`` of these."""
    cache_timing: Literal["", "cold", "warm"] = ""
    """How the units met the CPU's last-level cache when timed: "cold" (their weights evicted at
    each call, as a run of a model larger than the cache finds them), "warm" (in it:
    ``warm_reason`` says why); "" not recorded (synthetic profiles, profiles that predate it)."""
    warm_reason: str = ""
    """Why a device was profiled warm: the model fits in its cache (as its runs find it), or
    overwriting the cache would take more memory than the agent may use (its times are then low
    for a model larger than the cache)."""

    def decode_time(self, unit: int, batch: int) -> float:
        return interpolate(self.decode_batch_sizes, self.decode_s[unit], batch)

    def prefill_time(self, unit: int, tokens: int) -> float:
        return interpolate(self.prefill_token_counts, self.prefill_s[unit], tokens)

    def stage_overhead_time(self, phase: str, start: int, end: int) -> float:
        """Once-per-stage overhead of a stage running units [start, end): charged when the
        stage holds at least one decoder block (units 1..L; L = rows of the table − 2)."""
        if not (start < len(self.decode_s) - 1 and end > 1):
            return 0.0
        return self.stage_decode_overhead_s if phase == "decode" else self.stage_prefill_overhead_s


def interpolate(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    """The one rule for reading a sampled time curve.

    Inside the sampled range: piecewise linear between neighbouring samples. Outside
    it: proportional to x from the nearest sample, t(x) = t(x_edge) · x / x_edge
    (compute grows linearly with the tokens processed; pessimistic for memory-bound
    decode above the largest sampled batch). With one sample this is plain
    proportional scaling.
    """
    if not xs:
        raise ValueError("no samples")
    if x <= xs[0]:
        return ys[0] * x / xs[0]
    if x >= xs[-1]:
        return ys[-1] * x / xs[-1]
    i = bisect_left(xs, x)
    if xs[i] == x:
        return ys[i]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class AcceleratorTimes(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A device's GPU as a place for its stage: the units' times measured there and the GPU's memory,
    which bounds a stage placed on it (its weights and KV cache live there, not in host memory)."""

    device: str
    torch_device: str = "cuda:0"
    """Where the times were measured and the stage computes (``Stage.torch_device``)."""
    memory_bytes: int
    times: DeviceTimes
    """Its units' times on that GPU (``times.device`` is ``device``)."""
    precision_times: tuple[DevicePrecisionTimes, ...] = ()
    """Its decoder blocks' time ratios per weight precision on that GPU (``profile --weight-times``): a GPU
    stage's int8 is its own, not its device's CPU ratio. Empty: not measured there."""


class ProfiledWorkload(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The workload the compute times were measured for (context length matters to attention)."""

    prompt_tokens: int
    batch_size: int = 1


class DraftTime(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One proposed token of draft ``draft`` (its checkpoint folder's name) on ``device``, timed there
    as a speculative run's source drafts (the median over a few trips, at the device's speed)."""

    device: str
    draft: str
    token_s: float


class Profile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    format: Literal["edgeshard.profile"] = PROFILE_FORMAT
    version: int = PROFILE_VERSION
    model: ModelSpec
    cluster: Cluster
    times: tuple[DeviceTimes, ...]
    profiled_workload: ProfiledWorkload | None = None
    source: Literal["measured", "synthetic", "scenario"] = "measured"
    notes: str = ""
    weight_quality: tuple[PrecisionQuality, ...] = ()
    """Perplexity and block time ratios per weight precision, measured once (core.models.weight_quality):
    what lets a plan give a device int8/int4 weights under a quality bound. Empty: not measured."""
    accelerator_times: tuple[AcceleratorTimes, ...] = ()
    """The GPUs a planner may place a device's stage on (core.planning.placement); empty: CPUs only."""
    precision_times: tuple[DevicePrecisionTimes, ...] = ()
    """Each device's own block time ratio per weight precision, where profiled (core.planning.precision)."""
    draft_times: tuple[DraftTime, ...] = ()
    """A speculative draft's proposed token timed on each device (``edgeshard profile --draft``), what
    the cost model's draft costs where one is (core.planning.speculation); none: by proxy."""

    def __post_init__(self) -> None:
        if self.version < PROFILE_VERSION:  # migrate: what older versions lack has its default
            msgspec.structs.force_setattr(self, "version", PROFILE_VERSION)

    def times_of(self, device_id: str) -> DeviceTimes:
        for t in self.times:
            if t.device == device_id:
                return t
        raise KeyError(device_id)


_CLEAN_PROFILES: collections.OrderedDict[int, Profile] = collections.OrderedDict()
_CLEAN_LOCK = threading.Lock()
_CLEAN_KEPT = 8


def profile_errors(profile: Profile) -> list[str]:
    """Every inconsistency msgspec's type check cannot see, as (JSON path, problem) text.

    Types alone allow a times table shorter than the model or a link to an unknown
    device; the planner would fail deep inside with an IndexError. Checked on load by
    the CLI and by the solvers, so bad input is a clear error, never a traceback.
    The last few profile objects found clean are remembered (they are frozen): a re-plan
    after a failure solves the same profile again and skips the ~10 ms check at 64 devices.
    """
    with _CLEAN_LOCK:
        if _CLEAN_PROFILES.get(id(profile)) is profile:
            _CLEAN_PROFILES.move_to_end(id(profile))
            return []
    out = _profile_errors(profile)
    if not out:
        with _CLEAN_LOCK:
            _CLEAN_PROFILES[id(profile)] = profile  # held, so its id is not reused while remembered
            while len(_CLEAN_PROFILES) > _CLEAN_KEPT:
                _CLEAN_PROFILES.popitem(last=False)
    return out


def _profile_errors(profile: Profile) -> list[str]:
    out: list[str] = quality_errors(profile.weight_quality)
    n = len(profile.model.units)
    if n == 0:
        out.append("$.model.units: the model has no units")
    for i, u in enumerate(profile.model.units):
        if u.index != i:
            out.append(f"$.model.units[{i}].index: is {u.index}, expected {i}")
        for name in ("param_bytes", "activation_bytes_per_token", "kv_bytes_per_token", "workspace_bytes_per_token"):
            if getattr(u, name) < 0:
                out.append(f"$.model.units[{i}].{name}: must not be negative")
    ids = [d.id for d in profile.cluster.devices]
    if len(set(ids)) != len(ids):
        out.append("$.cluster.devices: device ids must be unique")
    for i, d in enumerate(profile.cluster.devices):
        if d.memory_bytes < 0:
            out.append(f"$.cluster.devices[{i}].memory_bytes: must not be negative")
    known = set(ids)
    for i, link in enumerate(profile.cluster.links):
        for end in ("src", "dst"):
            if getattr(link, end) not in known:
                out.append(f"$.cluster.links[{i}].{end}: unknown device {getattr(link, end)!r}")
        if not link.bandwidth_mbit_s > 0:
            out.append(f"$.cluster.links[{i}].bandwidth_mbit_s: must be positive")
        if link.latency_ms < 0:
            out.append(f"$.cluster.links[{i}].latency_ms: must not be negative")
    for i, t in enumerate(profile.times):
        out.extend(_times_errors(f"$.times[{i}]", t, n, known))
    for i, a in enumerate(profile.accelerator_times):
        where = f"$.accelerator_times[{i}]"
        if a.device not in known or a.times.device != a.device:
            out.append(f"{where}.device: {a.device!r} must be a device of the cluster, its times' device too")
        if not (a.torch_device == "cuda" or (a.torch_device.startswith("cuda:") and a.torch_device[5:].isdigit())):
            out.append(f"{where}.torch_device: must be cuda or cuda:N, got {a.torch_device[:40]!r}")
        if a.memory_bytes < 0:
            out.append(f"{where}.memory_bytes: must not be negative")
        out.extend(_times_errors(f"{where}.times", a.times, n, known))
        out.extend(device_times_errors(a.precision_times, {a.device}, f"{where}.precision_times"))
    gpus = [(a.device, "cuda:0" if a.torch_device == "cuda" else a.torch_device) for a in profile.accelerator_times]
    if len(set(gpus)) != len(gpus):
        out.append("$.accelerator_times: one entry per device and GPU")
    out.extend(device_times_errors(profile.precision_times, known))
    for i, d in enumerate(profile.draft_times):
        if d.device not in known or not d.draft or not (math.isfinite(d.token_s) and d.token_s > 0):
            out.append(f"$.draft_times[{i}]: a device of the cluster, a draft's name and a time > 0")
    return out


def _times_errors(where: str, t: DeviceTimes, n: int, known: set[str]) -> list[str]:
    """What is wrong with one device's times table (at JSON path ``where``) for a model of ``n`` units."""
    out = []
    if t.device not in known:
        out.append(f"{where}.device: unknown device {t.device!r}")
    if t.warm_reason and t.cache_timing != "warm":
        out.append(f"{where}.warm_reason: only a device profiled warm has one")
    for name in ("stage_decode_overhead_s", "stage_prefill_overhead_s"):
        v = getattr(t, name)
        if not (v >= 0) or v == float("inf"):
            out.append(f"{where}.{name}: must be finite and not negative")
    if t.expert_decode_s and (len(t.expert_decode_s) != n
                              or any(not (v >= 0) or v == float("inf") for v in t.expert_decode_s)):
        out.append(f"{where}.expert_decode_s: needs one finite, non-negative time per unit ({n})")
    for xs_name, ys_name in (("decode_batch_sizes", "decode_s"), ("prefill_token_counts", "prefill_s")):
        xs, ys = getattr(t, xs_name), getattr(t, ys_name)
        if not xs or any(x < 1 for x in xs) or list(xs) != sorted(set(xs)):
            out.append(f"{where}.{xs_name}: needs increasing positive sample points")
        if len(ys) != n:
            out.append(f"{where}.{ys_name}: has {len(ys)} rows, the model has {n} units")
            continue
        for u, row in enumerate(ys):
            if len(row) != len(xs):
                out.append(f"{where}.{ys_name}[{u}]: has {len(row)} values for {len(xs)} sample points")
                break
            if any(not (v >= 0) or v == float("inf") for v in row):
                out.append(f"{where}.{ys_name}[{u}]: times must be finite and not negative")
                break
    return out


register_format(PROFILE_FORMAT, Profile, PROFILE_VERSION)
