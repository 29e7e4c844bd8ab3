"""Export a run's timeline: Chrome trace event JSON (Perfetto, chrome://tracing) and CSV.

Trace Event Format (the "JSON Object Format"): ``{"traceEvents": [...],
"displayTimeUnit": "ms", "otherData": {...}}``. One process per device (``pid``, named
by a ``process_name`` metadata event, ordered by stage with ``process_sort_index``),
one thread per lane (``tid``: compute, send, recv_wait, and tokens on the source;
``thread_name`` metadata). Each TimelineEvent is a complete event (``ph: "X"``) with
``ts`` and ``dur`` in microseconds; each token arrival an instant event (``ph: "i"``,
``s: "t"``). The plan and profile are written with core.formats (versioned JSON).
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from agents.protocol import TimelineEvent, TokenEvent
from core.errors import FormatError, StoreError

LANES: tuple[str, ...] = ("compute", "send", "recv_wait", "io", "tokens", "failure", "replan", "reload", "draft",
                          "rollback")

CSV_COLUMNS: tuple[str, ...] = ("device", "stage", "kind", "phase", "step", "micro_batch", "start_s", "end_s",
                                "duration_s", "nbytes", "peer", "clock_uncertainty_s")


def _us(t_s: float) -> float:
    return round(t_s * 1e6, 3)


def chrome_trace(events: Sequence[TimelineEvent], tokens: Sequence[TokenEvent] = (), *,
                 source_device: str | None = None, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """The trace as a JSON-ready dict (see the module docstring for the layout)."""
    stage_of: dict[str, int] = {}
    for e in events:
        stage_of[e.device] = min(stage_of.get(e.device, e.stage), e.stage)
    if source_device is None and stage_of:
        source_device = min(stage_of, key=lambda d: (stage_of[d], d))
    if source_device is not None and tokens:
        stage_of.setdefault(source_device, 0)
    devices = sorted(stage_of, key=lambda d: (stage_of[d], d))
    pid = {d: i + 1 for i, d in enumerate(devices)}
    tid = {lane: i + 1 for i, lane in enumerate(LANES)}
    out: list[dict[str, Any]] = []
    for d in devices:
        out.append({"name": "process_name", "ph": "M", "pid": pid[d], "tid": 0, "args": {"name": d}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": pid[d], "tid": 0,
                    "args": {"sort_index": pid[d]}})
        lanes = [e.kind for e in events if e.device == d]
        if d == source_device and tokens:
            lanes.append("tokens")
        for lane in LANES:
            if lane in lanes:
                out.append({"name": "thread_name", "ph": "M", "pid": pid[d], "tid": tid[lane],
                            "args": {"name": lane}})
                out.append({"name": "thread_sort_index", "ph": "M", "pid": pid[d], "tid": tid[lane],
                            "args": {"sort_index": tid[lane]}})
    for e in sorted(events, key=lambda e: (e.start_s, pid[e.device], tid[e.kind])):
        label = "prefill" if e.phase == "prefill" else f"decode {e.step}"
        args: dict[str, Any] = {"stage": e.stage, "phase": e.phase, "step": e.step, "micro_batch": e.micro_batch}
        if e.kind in ("send", "io"):
            args.update(nbytes=e.nbytes, peer=e.peer)
        if e.clock_uncertainty_s:
            args["clock_uncertainty_us"] = _us(e.clock_uncertainty_s)
        out.append({"name": f"{label} mb{e.micro_batch}", "cat": f"{e.kind},{e.phase}", "ph": "X",
                    "ts": _us(e.start_s), "dur": max(0.0, _us(e.end_s) - _us(e.start_s)),
                    "pid": pid[e.device], "tid": tid[e.kind], "args": args})
    for t in tokens:
        args = {"step": t.step, "micro_batch": t.micro_batch, "sequence_ids": list(t.sequence_ids),
                "token_ids": list(t.token_ids)}
        if t.text:
            args["text"] = list(t.text)
        out.append({"name": f"token step {t.step} mb{t.micro_batch}", "cat": "tokens", "ph": "i", "s": "t",
                    "ts": _us(t.t_s), "pid": pid[source_device], "tid": tid["tokens"], "args": args})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": dict(metadata or {})}


def _write_atomic(path: str | os.PathLike, data: bytes) -> Path:
    p = Path(path).expanduser()
    tmp = p.with_name(f".{p.name}.partial")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, p)
    except OSError as err:
        if tmp.exists():
            tmp.unlink()
        raise StoreError(f"{p}: cannot write ({err.strerror or err})") from None
    return p


def write_chrome_trace(path: str | os.PathLike, events: Sequence[TimelineEvent], tokens: Sequence[TokenEvent] = (),
                       **kw) -> Path:
    return _write_atomic(path, msgspec.json.encode(chrome_trace(events, tokens, **kw)))


def events_csv(events: Sequence[TimelineEvent]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for e in events:
        w.writerow([e.device, e.stage, e.kind, e.phase, e.step, e.micro_batch, repr(e.start_s), repr(e.end_s),
                    repr(e.duration_s), e.nbytes, e.peer, repr(e.clock_uncertainty_s)])
    return buf.getvalue()


def write_events_csv(path: str | os.PathLike, events: Sequence[TimelineEvent]) -> Path:
    return _write_atomic(path, events_csv(events).encode())


EVENTS_FORMAT = "edgeshard.events"
EVENTS_VERSION = 1


def write_events_jsonl(path: str | os.PathLike, events: Sequence[TimelineEvent]) -> Path:
    """A header line ``{"format": "edgeshard.events", "version": 1}``, then one
    TimelineEvent per line (the `simulate --events` output)."""
    header = msgspec.json.encode({"format": EVENTS_FORMAT, "version": EVENTS_VERSION}) + b"\n"
    return _write_atomic(path, header + b"".join(msgspec.json.encode(e) + b"\n" for e in events))


def read_events_jsonl(path: str | os.PathLike) -> list[TimelineEvent]:
    """Read a file written by ``write_events_jsonl``; a bad line is a FormatError naming it."""
    p = Path(path).expanduser()
    try:
        lines = p.read_bytes().splitlines()
    except OSError as err:
        raise FormatError(str(p), f"cannot read file ({err.strerror or err})") from None
    try:
        header = msgspec.json.decode(lines[0]) if lines else None
    except msgspec.DecodeError:
        header = None
    if not isinstance(header, dict) or header.get("format") != EVENTS_FORMAT:
        raise FormatError(str(p), f"expected a first line with format {EVENTS_FORMAT!r}", "line 1")
    if not isinstance(header.get("version"), int) or header["version"] > EVENTS_VERSION:
        raise FormatError(str(p), f"unsupported version {header.get('version')!r} (this program reads "
                                  f"up to {EVENTS_VERSION})", "line 1")
    out = []
    for n, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            out.append(msgspec.json.decode(line, type=TimelineEvent, strict=True))
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            raise FormatError(str(p), str(err), f"line {n}") from None
    return out
