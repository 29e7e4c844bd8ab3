"""EPD request workloads: Poisson arrivals from a seed, or a trace file; and the same requests at another rate.

Goodput bisects over the request rate; scaling one workload's arrival times (rather than
drawing a new one per rate) keeps the requests identical across rates, so attainment moves
only because of load (for a Poisson process the scaled arrivals are again Poisson).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import msgspec
import numpy as np

from core.errors import FormatError
from core.techniques.phase_disaggregation.types import EpdInputError, Request, Workload

IntRange = tuple[int, int]
"""An inclusive range drawn uniformly per request (lo == hi: a fixed value)."""

TRACE_COLUMNS = ("arrival_s", "images", "tiles_per_image", "prompt_tokens", "output_tokens")
"""A trace file is CSV with this header (extra columns are ignored), one request per row."""


def _check_range(name: str, r: IntRange, lo_min: int) -> None:
    if len(r) != 2 or r[0] < lo_min or r[1] < r[0]:
        raise EpdInputError(f"{name} must be a range lo..hi with {lo_min} <= lo <= hi, got {r[0]}..{r[1]}")


def poisson_workload(*, rate_rps: float, requests: int, seed: int, images: IntRange = (1, 1),
                     tiles_per_image: IntRange = (4, 4), prompt_tokens: IntRange = (32, 32),
                     output_tokens: IntRange = (32, 32)) -> Workload:
    """``requests`` requests with exponential inter-arrival times of mean 1/rate (the first at 0)."""
    if not (math.isfinite(rate_rps) and rate_rps > 0):
        raise EpdInputError(f"rate must be > 0 requests per second, got {rate_rps}")
    if requests < 1:
        raise EpdInputError(f"a workload needs at least one request, got {requests}")
    _check_range("images", images, 0)
    _check_range("tiles_per_image", tiles_per_image, 1)
    _check_range("prompt_tokens", prompt_tokens, 1)
    _check_range("output_tokens", output_tokens, 1)
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate_rps, size=requests)
    gaps[0] = 0.0
    arrivals = np.cumsum(gaps)

    def draw(r: IntRange) -> np.ndarray:
        return rng.integers(r[0], r[1] + 1, size=requests)

    imgs, tiles, prompts, outs = draw(images), draw(tiles_per_image), draw(prompt_tokens), draw(output_tokens)
    reqs = tuple(Request(id=i, arrival_s=float(arrivals[i]), images=int(imgs[i]), tiles_per_image=int(tiles[i]),
                         prompt_tokens=int(prompts[i]), output_tokens=int(outs[i])) for i in range(requests))
    return Workload(source="poisson", rate_rps=rate_rps, seed=seed, requests=reqs)


def load_trace(path: str | Path) -> Workload:
    """A CSV trace (``TRACE_COLUMNS``), arrivals in seconds from its start; every bad cell names its line."""
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise FormatError(str(p), f"cannot read the trace ({getattr(err, 'strerror', None) or err})") from None
    rows = csv.DictReader(text.splitlines())
    missing = [c for c in TRACE_COLUMNS if c not in (rows.fieldnames or ())]
    if missing:
        raise FormatError(str(p), f"the header lacks column(s) {', '.join(missing)}; a trace's header is "
                                  f"{','.join(TRACE_COLUMNS)}", "line 1")
    reqs = []
    for i, row in enumerate(rows):
        line = f"line {i + 2}"
        try:
            arrival = float(row["arrival_s"])
            ints = {c: int(row[c]) for c in TRACE_COLUMNS[1:]}
        except (TypeError, ValueError):
            raise FormatError(str(p), "arrival_s must be a number and the other columns integers", line) from None
        try:
            reqs.append(Request(id=i, arrival_s=arrival, **ints))
        except EpdInputError as err:
            raise FormatError(str(p), str(err), line) from None
    if not reqs:
        raise FormatError(str(p), "the trace has no requests")
    reqs.sort(key=lambda r: (r.arrival_s, r.id))
    t0 = reqs[0].arrival_s
    reqs = [msgspec.structs.replace(r, id=k, arrival_s=r.arrival_s - t0) for k, r in enumerate(reqs)]
    return Workload(source="trace", trace=str(p), requests=tuple(reqs))


def mean_rate_rps(workload: Workload) -> float:
    """Requests per second: the Poisson rate it was drawn at, else its count over its span."""
    if workload.rate_rps is not None:
        return workload.rate_rps
    n = len(workload.requests)
    span = workload.requests[-1].arrival_s - workload.requests[0].arrival_s
    if n < 2 or span <= 0:
        raise EpdInputError("this workload has no arrival rate (one request, or all at once): it cannot be "
                            "replayed at another rate")
    return (n - 1) / span


def at_rate(workload: Workload, rate_rps: float) -> Workload:
    """The same requests, arrival times scaled so they come at ``rate_rps`` on average."""
    if not (math.isfinite(rate_rps) and rate_rps > 0):
        raise EpdInputError(f"rate must be > 0 requests per second, got {rate_rps}")
    k = mean_rate_rps(workload) / rate_rps
    reqs = tuple(msgspec.structs.replace(r, arrival_s=r.arrival_s * k) for r in workload.requests)
    return msgspec.structs.replace(workload, requests=reqs, rate_rps=rate_rps)


__all__ = ["TRACE_COLUMNS", "at_rate", "load_trace", "mean_rate_rps", "poisson_workload"]
