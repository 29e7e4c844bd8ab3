"""Figures of a run computed from its events and tokens: the one definition.

The live view, a replay, the simulator and the store's recorded figures all call these
pure functions on the same lists, so a replay shows exactly the numbers seen live and a
prediction is measured by the same yardstick as a real run.

Definitions (times in seconds on the run's clock, 0 = run start):
- TTFT: arrival of the earliest step-0 token (the prefill's output) at the source.
- per-token latency: mean gap between a micro-batch's consecutive token arrivals
  (step s-1 → s, s ≥ 1): one decode step through every stage and back.
- decode tokens/s: tokens of steps ≥ 1 arriving after the first decode arrival, over the
  time from that first decode arrival to the last (fencepost-free rate).
- median step gap: the median of those gaps (``second_half``: only the steps in the second
  half of each micro-batch's decode, the steady state of a pipeline); robust to the stalls
  other tenants of a shared machine cause, which a mean is not. ``micro_batches`` / it is
  the steady decode tokens/s of a pipeline of that many micro-batches.
- tokens/s over time: tokens arrived per window of ``window_s``.
- device utilisation: compute-busy time of a device over the run's span [0, end].
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import msgspec

from agents.protocol import TimelineEvent, TokenEvent


class RunFigures(msgspec.Struct, frozen=True, kw_only=True):
    ttft_s: float | None = None
    per_token_latency_s: float | None = None
    decode_tokens_per_s: float | None = None
    tokens_per_s: float | None = None
    """All tokens over the time to the last one."""
    tokens: int = 0
    duration_s: float = 0.0
    """End of the last event or token."""
    utilisation: dict[str, float] = {}
    """Device → fraction of [0, duration] spent computing."""


class LinkTraffic(msgspec.Struct, frozen=True, kw_only=True):
    """What a run sent over one link (src → dst)."""

    total_bytes: int = 0
    decode_bytes: int = 0
    bytes_per_token: float | None = None
    """Decode bytes per generated token of one sequence (None before a decode token): the
    measured counterpart of ``core.planning.cost.link_bytes_per_token``."""


def link_traffic(events: Sequence[TimelineEvent], tokens: Sequence[TokenEvent]) -> dict[tuple[str, str], LinkTraffic]:
    """(src, dst) → the bytes of the run's send events on that link."""
    decode_tokens = sum(len(t.sequence_ids) for t in tokens if t.step >= 1)
    total: dict[tuple[str, str], int] = {}
    decode: dict[tuple[str, str], int] = {}
    for ev in events:
        if ev.kind != "send" or not ev.peer or ev.peer == ev.device:
            continue
        link = (ev.device, ev.peer)
        total[link] = total.get(link, 0) + ev.nbytes
        if ev.phase == "decode":
            decode[link] = decode.get(link, 0) + ev.nbytes
    return {link: LinkTraffic(total_bytes=n, decode_bytes=decode.get(link, 0),
                              bytes_per_token=decode.get(link, 0) / decode_tokens if decode_tokens else None)
            for link, n in total.items()}


def token_count(tokens: Iterable[TokenEvent]) -> int:
    return sum(len(t.token_ids) for t in tokens)


def ttft_s(tokens: Sequence[TokenEvent]) -> float | None:
    firsts = [t.t_s for t in tokens if t.step == 0]
    return min(firsts) if firsts else None


def per_token_latency_s(tokens: Sequence[TokenEvent]) -> float | None:
    by_mb: dict[int, dict[int, float]] = {}
    for t in tokens:
        by_mb.setdefault(t.micro_batch, {})[t.step] = t.t_s
    gaps = [
        steps[s] - steps[s - 1]
        for steps in by_mb.values()
        for s in sorted(steps)
        if s >= 1 and s - 1 in steps
    ]
    return sum(gaps) / len(gaps) if gaps else None


def median_step_gap_s(tokens: Sequence[TokenEvent], second_half: bool = False) -> float | None:
    by_mb: dict[int, dict[int, float]] = {}
    for t in tokens:
        by_mb.setdefault(t.micro_batch, {})[t.step] = t.t_s
    gaps = []
    for steps in by_mb.values():
        lo = max(steps) // 2 if second_half else 1
        gaps += [steps[s] - steps[s - 1] for s in sorted(steps) if s >= max(1, lo) and s - 1 in steps]
    if not gaps:
        return None
    gaps.sort()
    mid = len(gaps) // 2
    return gaps[mid] if len(gaps) % 2 else (gaps[mid - 1] + gaps[mid]) / 2


def decode_tokens_per_s(tokens: Sequence[TokenEvent]) -> float | None:
    dec = sorted((t for t in tokens if t.step >= 1), key=lambda t: t.t_s)
    if len(dec) < 2 or dec[-1].t_s <= dec[0].t_s:
        return None
    return token_count(dec[1:]) / (dec[-1].t_s - dec[0].t_s)


def tokens_per_s_over_time(tokens: Sequence[TokenEvent], window_s: float = 1.0) -> list[tuple[float, float]]:
    """(window start, tokens/s in the window) for every window up to the last token. A token
    placed before the run's start (an agent's clock estimate off by more than the time to its
    first token, as under heavy load) counts in the first window."""
    if not tokens or window_s <= 0:
        return []
    end = max(t.t_s for t in tokens)
    n = max(1, int(math.floor(end / window_s)) + 1)
    counts = [0] * n
    for t in tokens:
        counts[max(0, min(n - 1, int(t.t_s // window_s)))] += len(t.token_ids)
    return [(i * window_s, c / window_s) for i, c in enumerate(counts)]


def duration_s(events: Sequence[TimelineEvent], tokens: Sequence[TokenEvent]) -> float:
    return max([e.end_s for e in events] + [t.t_s for t in tokens] + [0.0])


def utilisation(events: Sequence[TimelineEvent], until_s: float | None = None) -> dict[str, float]:
    """Device → compute-busy fraction of [0, until_s] (default: the events' end)."""
    span = until_s if until_s is not None else max((e.end_s for e in events), default=0.0)
    busy: dict[str, float] = {}
    for e in events:
        if e.kind == "compute":
            busy[e.device] = busy.get(e.device, 0.0) + max(0.0, min(e.end_s, span) - max(e.start_s, 0.0))
        else:
            busy.setdefault(e.device, 0.0)
    return {d: (b / span if span > 0 else 0.0) for d, b in sorted(busy.items())}


def bubbles(events: Sequence[TimelineEvent]) -> dict[str, float]:
    """Device -> fraction of the pipeline's span (first to last compute of any device)
    that the device spent idle: the pipeline bubbles a schedule leaves."""
    computes = [e for e in events if e.kind == "compute"]
    if not computes:
        return {}
    start = min(e.start_s for e in computes)
    span = max(e.end_s for e in computes) - start
    busy: dict[str, float] = {}
    for e in computes:
        busy[e.device] = busy.get(e.device, 0.0) + e.duration_s
    return {d: (max(0.0, 1.0 - b / span) if span > 0 else 0.0) for d, b in sorted(busy.items())}


def comparison_rows(a: RunFigures, b: RunFigures, bubbles_a: dict[str, float],
                    bubbles_b: dict[str, float]) -> list[tuple[str, str, str]]:
    """The side-by-side table of two runs: (figure, run A, run B), missing figures as '—'."""
    def ms(v):
        return "—" if v is None else f"{v * 1000:.1f} ms"

    def rate(v):
        return "—" if v is None else f"{v:.1f}"

    def pct(d, k):
        return "—" if k not in d else f"{d[k] * 100:.0f} %"

    rows = [("TTFT", ms(a.ttft_s), ms(b.ttft_s)),
            ("Latency / token", ms(a.per_token_latency_s), ms(b.per_token_latency_s)),
            ("Tokens/s (all)", rate(a.tokens_per_s), rate(b.tokens_per_s)),
            ("Decode tokens/s", rate(a.decode_tokens_per_s), rate(b.decode_tokens_per_s)),
            ("Tokens", str(a.tokens), str(b.tokens)),
            ("Duration", f"{a.duration_s:.2f} s", f"{b.duration_s:.2f} s")]
    for device in sorted(set(a.utilisation) | set(b.utilisation)):
        rows.append((f"Utilisation · {device}", pct(a.utilisation, device), pct(b.utilisation, device)))
    for device in sorted(set(bubbles_a) | set(bubbles_b)):
        rows.append((f"Bubbles · {device}", pct(bubbles_a, device), pct(bubbles_b, device)))
    return rows


def compute_figures(events: Sequence[TimelineEvent], tokens: Sequence[TokenEvent]) -> RunFigures:
    """Every figure of a run (or of the prefix of one seen so far)."""
    dur = duration_s(events, tokens)
    return _figures(tokens, dur, utilisation(events, dur))


def _figures(tokens: Sequence[TokenEvent], dur: float, util: dict[str, float]) -> RunFigures:
    """The figures from the tokens, the run's duration and per-device utilisation (one formula for live and replay)."""
    n = token_count(tokens)
    last_tok = max((t.t_s for t in tokens), default=0.0)
    return RunFigures(
        ttft_s=ttft_s(tokens),
        per_token_latency_s=per_token_latency_s(tokens),
        decode_tokens_per_s=decode_tokens_per_s(tokens),
        tokens_per_s=(n / last_tok) if n and last_tok > 0 else None,
        tokens=n,
        duration_s=dur,
        utilisation=util,
    )


class LiveMetrics:
    """Accumulates a run's events and tokens as they arrive; ``figures()`` on demand.

    Not thread-safe by itself: feed it from one thread (the GUI's queued slot, the
    replay loop). Live and replay use this same class, so they agree by construction.

    The O(events) parts of ``compute_figures`` (the run's end and each device's busy
    time) are kept up to date per event, in arrival order, so ``figures()`` costs
    O(tokens) and equals ``compute_figures(events, tokens)`` exactly: ``utilisation``
    clips each event at the run's end, which is never below an event's own end.
    """

    def __init__(self) -> None:
        self.events: list[TimelineEvent] = []
        self.tokens: list[TokenEvent] = []
        self._busy: dict[str, float] = {}
        self._events_end = 0.0
        self._tokens_end = 0.0

    def add_event(self, ev: TimelineEvent) -> None:
        self.events.append(ev)
        if ev.kind == "compute":
            self._busy[ev.device] = self._busy.get(ev.device, 0.0) + max(0.0, ev.end_s - max(ev.start_s, 0.0))
        else:
            self._busy.setdefault(ev.device, 0.0)
        self._events_end = max(self._events_end, ev.end_s)

    def add_tokens(self, tok: TokenEvent) -> None:
        self.tokens.append(tok)
        self._tokens_end = max(self._tokens_end, tok.t_s)

    def figures(self) -> RunFigures:
        tokens = self.tokens
        dur = max(self._events_end, self._tokens_end)
        return _figures(tokens, dur, {d: (b / dur if dur > 0 else 0.0) for d, b in sorted(self._busy.items())})
