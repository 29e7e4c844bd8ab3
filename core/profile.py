"""Measured (or synthetic) costs: per device and per unit compute times, plus the cluster.

A ``Profile`` is what profiling produces and what a planning problem is built from.
Compute times are sampled at a few batch sizes (decode) and prompt token counts
(prefill) and read back by one documented rule, ``interpolate``, so measured,
synthetic and shipped profiles share one format and one cost model.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Literal

import msgspec

from core.cluster import Cluster
from core.model_units import ModelSpec

PROFILE_FORMAT = "edgeshard.profile"
PROFILE_VERSION = 1


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

    def decode_time(self, unit: int, batch: int) -> float:
        return interpolate(self.decode_batch_sizes, self.decode_s[unit], batch)

    def prefill_time(self, unit: int, tokens: int) -> float:
        return interpolate(self.prefill_token_counts, self.prefill_s[unit], tokens)


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


class ProfiledWorkload(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The workload the compute times were measured for (context length matters to attention)."""

    prompt_tokens: int
    batch_size: int = 1


class Profile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    format: Literal["edgeshard.profile"] = PROFILE_FORMAT
    version: int = PROFILE_VERSION
    model: ModelSpec
    cluster: Cluster
    times: tuple[DeviceTimes, ...]
    profiled_workload: ProfiledWorkload | None = None
    source: Literal["measured", "synthetic", "scenario"] = "measured"
    notes: str = ""

    def times_of(self, device_id: str) -> DeviceTimes:
        for t in self.times:
            if t.device == device_id:
                return t
        raise KeyError(device_id)
