"""Benchmark the SessionStore's event path; prints one JSON line.

Figures (one process, the machine's own disk, WAL + synchronous=NORMAL):
- ``append_events_per_s``: how fast ``RunRecorder.on_event`` accepts events (queueing);
- ``committed_events_per_s``: events committed per second end to end (append + writer,
  until ``flush()`` returns) — the rate the store sustains;
- ``threads4_committed_events_per_s``: the same with four threads emitting at once;
- ``read_events_per_s``: ``SessionStore.timeline`` decoding a run back;
- ``bytes_per_event``: workspace file size (incl. WAL) over events stored.

Usage: python bench/store.py [--events 200000]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

from agents.protocol import TimelineEvent
from core.sessions.recording import RunRecorder
from core.sessions.store import SessionStore


def _events(n: int) -> list[TimelineEvent]:
    return [TimelineEvent(device=f"dev-{i % 4}", stage=i % 4, kind=("compute", "send", "recv_wait")[i % 3],
                          phase="decode", step=i // 16, micro_batch=i % 4, start_s=i * 1e-4,
                          end_s=i * 1e-4 + 5e-5, nbytes=4096 if i % 3 == 1 else 0, peer="dev-1" if i % 3 == 1 else "")
            for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=200_000)
    args = ap.parse_args()
    evs = _events(args.events)
    with tempfile.TemporaryDirectory(prefix="edgeshard-bench-store-") as d:
        path = Path(d) / "ws.sqlite"
        with SessionStore(path) as store:
            sid = store.create_session("bench")
            rid = store.create_run(sid, model="m", mode="no-bubbles")
            rec = RunRecorder(store, rid)
            t0 = time.perf_counter()
            for e in evs:
                rec.on_event(e)
            t1 = time.perf_counter()
            store.flush()
            t2 = time.perf_counter()

            rid4 = store.create_run(sid, model="m", mode="no-bubbles")
            rec4 = RunRecorder(store, rid4)
            quarter = len(evs) // 4
            threads = [threading.Thread(target=lambda part: [rec4.on_event(e) for e in part],
                                        args=(evs[i * quarter:(i + 1) * quarter],)) for i in range(4)]
            t3 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            store.flush()
            t4 = time.perf_counter()
            t5 = time.perf_counter()
            n_read = len(store.timeline(rid))
            t6 = time.perf_counter()
            size = sum(os.path.getsize(p) for p in Path(d).iterdir())
    print(json.dumps({
        "bench": "store",
        "events": args.events,
        "append_events_per_s": round(args.events / (t1 - t0)),
        "committed_events_per_s": round(args.events / (t2 - t0)),
        "threads4_committed_events_per_s": round(4 * quarter / (t4 - t3)),
        "read_events_per_s": round(n_read / (t6 - t5)),
        "bytes_per_event": round(size / (args.events + 4 * quarter), 1),
    }))


if __name__ == "__main__":
    main()
