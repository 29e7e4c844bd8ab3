"""Each served request recorded as its own run in the workspace: its prompt, parameters, tokens, figures,
and its micro-batch's timeline events from its join, on a clock that starts at its join.

A micro-batch's events are stored once, in the open run's event stream, and each request's run holds a
window on them (``SessionStore.open_window``): 16 rows are not 16 copies. Records are opened and finished
on one thread of their own, off the coordinator's IO thread (it delivers everyone's tokens). A request's
figures are computed when its record closes from what the server kept of it (``RunRecorder(keep=True)``:
its tokens and events; ``KeptEvents``: its window's share of the stream), the lists a read of its
timeline gives back: that read cost ~1.7 ms a request (300 events rebuilt from SQLite), a quarter of the
server's CPU per token with 16 streams (docs/serving.md, Measured).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec

from agents.protocol import TimelineEvent, TokenEvent
from core.runs.batching import batching_settings
from core.runs.wire import counters_of, sent_between, wire_figures
from core.serving.served import ServedRequest
from core.sessions.recording import RunRecorder

log = logging.getLogger(__name__)

EVENTS_LAG_S = 0.25
"""How long after its end a request's record is finished: its figures count the events that arrived by then
(the agents send theirs every ~50 ms; a later one is still in its replay, through its window)."""
JOIN_SENT_WAIT_S = 0.05
"""How long a request's record waits for the stages to accept its join before it is written anyway."""
WIRE_SETTLE_S = 0.05
"""A request's wire bytes are read at least this long after its end (its last events are sent by then)."""
KEEP_S = 0.5
"""Events that started this long ago are kept for a window opened later (arrival lags, clock estimates)."""


def retried(write, tries: int = 8):
    """A store write, tried again when SQLite refuses it as locked: the store's event writer commits on
    its own connection, and a transaction that read before that commit is refused at once (SQLite's
    busy timeout does not apply to it). Many requests ending together met it under load."""
    import sqlite3

    for i in range(tries):
        try:
            return write()
        except sqlite3.OperationalError as err:
            if "locked" not in str(err) or i == tries - 1:
                raise
            time.sleep(0.02 * (i + 1))


class KeptEvents:
    """An open run's streamed events, kept (per micro-batch, with their arrival on the stream's clock) as long
    as a request whose window may hold them has not closed: what its figures count."""

    def __init__(self) -> None:
        self._by_micro_batch: dict[int, list[tuple[float, TimelineEvent]]] = {}
        self._needs: dict[object, tuple[int, float]] = {}
        """Per request with a window to come or open: (its micro-batch, its window's start)."""
        self._lock = threading.Lock()

    def add(self, recv_s: float, events: list[TimelineEvent]) -> None:
        """``events`` that arrived together, at ``recv_s``."""
        with self._lock:
            for event in events:
                self._by_micro_batch.setdefault(event.micro_batch, []).append((recv_s, event))

    def need(self, key, micro_batch: int, from_s: float) -> None:
        """``key``'s window (on ``micro_batch`` from ``from_s``) will be counted: its events are kept until ``done``."""
        with self._lock:
            self._needs[key] = (micro_batch, from_s)

    def window(self, micro_batch: int, from_s: float, until_s: float | None, shift_s: float,
               recv_shift_s: float) -> list[tuple[float, TimelineEvent]]:
        """The events a window holds, (arrival, event) on its run's clocks, as ``SessionStore.timeline`` reads them."""
        with self._lock:
            kept = list(self._by_micro_batch.get(micro_batch, ()))
        return [(recv + recv_shift_s, msgspec.structs.replace(e, micro_batch=0, start_s=e.start_s + shift_s,
                                                              end_s=e.end_s + shift_s))
                for recv, e in kept if e.start_s >= from_s and (until_s is None or e.start_s <= until_s)]

    def done(self, key, now_s: float) -> None:
        """``key``'s window is counted: its micro-batch's events that no open window needs are dropped
        (``now_s``: the run's clock now; those that started within ``KEEP_S`` of it stay)."""
        with self._lock:
            micro_batch, _ = self._needs.pop(key, (None, 0.0))
            events = self._by_micro_batch.get(micro_batch)
            if events is None:
                return
            low = min([now_s - KEEP_S] + [f for mb, f in self._needs.values() if mb == micro_batch])
            self._by_micro_batch[micro_batch] = [x for x in events if x[1].start_s >= low]


@dataclass(frozen=True)
class Window:
    """A request's window on an event stream (``SessionStore.open_window``'s arguments, and the run's ``t0``)."""

    id: int
    kept: KeptEvents
    micro_batch: int
    from_s: float
    shift_s: float
    recv_shift_s: float
    t0: float


class RequestRecords:
    """The served requests' run records in ``model``'s workspace (``model.store``; none: nothing is recorded)."""

    def __init__(self, model) -> None:
        """``model``: the ``core.serving.cluster_runs.ServedModel`` that owns these records (its ``store``,
        ``plan`` and ``coordinator`` are read; not imported: that module imports this one)."""
        self.model = model
        self._lock = threading.Lock()
        self._records: dict[ServedRequest, RunRecorder] = {}
        self._unrecorded: dict[ServedRequest, list] = {}
        """Requests whose run record is being created: what their stream brings waits here."""
        self._windows: dict[ServedRequest, list[Window]] = {}
        self._wire_at: dict[ServedRequest, object] = {}
        """Per recorded request, the agents' wire counters when its record opened (``core.runs.wire``)."""
        self.wire_last: tuple[float, object] = (0.0, None)
        """The agents' wire counters read last, and when (``time.time()``; ``_wire_counters``)."""
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="edgeshard-serve-record")
        self._due: deque[tuple[float, ServedRequest]] = deque()
        """Ended requests whose records close at their time (``finish``), oldest first: one thread waits for them
        all, where a ``threading.Timer`` a request started a thread each (~0.1 ms)."""
        self._due_changed = threading.Condition()
        self._closing = False
        if model.store is not None:
            threading.Thread(target=self._close_when_due, name="edgeshard-serve-record-due", daemon=True).start()

    @property
    def store(self):
        return self.model.store

    def batched(self):
        """Rows recorded on this thread inside are handed to the workspace's writer together (``SessionStore.batched``)."""
        return self.store.batched() if self.store is not None else contextlib.nullcontext()

    def close(self) -> None:
        """Once the last ended request's events can have arrived, close every record left and wait for them."""
        with self._due_changed:
            last = self._due[-1][0] if self._due else time.monotonic()
        time.sleep(max(0.0, last - time.monotonic()))
        with self._due_changed:
            self._closing = True
            for _, r in self._due:
                self._thread.submit(self._close_record, r)
            self._due.clear()
            self._due_changed.notify_all()
        self._thread.shutdown(wait=True)

    def _close_when_due(self) -> None:
        with self._due_changed:
            while not self._closing:
                if not self._due:
                    self._due_changed.wait()
                elif (wait := self._due[0][0] - time.monotonic()) > 0:
                    self._due_changed.wait(wait)
                else:
                    self._thread.submit(self._close_record, self._due.popleft()[1])

    def open(self, live: list[ServedRequest], stream, slot: int, t0: float, *, resumed: bool,
             accepted: threading.Event) -> None:
        """Open the records of ``live`` (joining micro-batch ``slot`` of ``stream``'s run), or for resumed ones
        another window; written once the join is out (``accepted``)."""
        if self.store is None:
            return
        if not resumed:
            with self._lock:
                self._unrecorded.update({r: [] for r in live})
        for r in live:
            if stream.id is not None:
                stream.kept.need(r, slot, r.joined_at - 0.001 - t0)
            self._thread.submit(self._once_out, accepted, self._open_window if resumed else self._open_record,
                                r, live, stream, slot, t0)

    @staticmethod
    def _once_out(accepted: threading.Event, write, *args) -> None:
        """``write`` (a record's) once the stages accepted the join, or ``JOIN_SENT_WAIT_S`` passed: written
        meanwhile, it held the GIL the IO thread needed to send the join (~0.4 ms of half the requests' TTFT)."""
        accepted.wait(JOIN_SENT_WAIT_S)
        write(*args)

    def _open_record(self, r: ServedRequest, batch: list[ServedRequest], stream, slot: int, t0: float) -> None:
        """The request's run record, its window on its micro-batch's events (``_open_window``), then what its
        stream brought meanwhile (this thread: before any ``_close_record`` of it, which is submitted later)."""
        try:
            rec = self._record(r, batch)
        except Exception:  # the request is served unrecorded; the server says so in its log
            log.exception("recording request %s failed", r.id)
            with self._lock:
                self._unrecorded.pop(r, None)
            stream.kept.done(r, time.time() - t0)
            return
        self._open_window(r, batch, stream, slot, t0, rec=rec)
        at = self.wire_last[1]  # its wire bytes count from the last read before its join (not read now: below)
        with self._lock:
            early = self._unrecorded.pop(r, [])
            self._records[r], self._wire_at[r] = rec, at
        for item in early:
            (rec.on_tokens if isinstance(item, TokenEvent) else rec.on_event)(item)

    def _open_window(self, r: ServedRequest, batch: list[ServedRequest], stream, slot: int, t0: float,
                     rec: RunRecorder | None = None) -> None:
        """``r``'s run holds micro-batch ``slot``'s events of ``stream`` from its join on, moved onto its clock (the
        open run's clock starts at ``t0``); a resumed request opens another on the new run's stream."""
        rec = rec or self._records.get(r)
        if rec is None or stream.id is None:
            stream.kept.done(r, time.time() - t0)
            return
        from_s, shift_s, recv_shift_s = r.joined_at - 0.001 - t0, t0 - r.joined_at, stream.t0 - rec.t0
        try:
            window = retried(lambda: self.store.open_window(rec.run_id, stream.id, slot, from_s=from_s, shift_s=shift_s,
                                                            recv_shift_s=recv_shift_s))
        except Exception:  # its run is recorded without this part of its timeline; the log says so
            log.exception("recording request %s's events failed", r.id)
            stream.kept.done(r, time.time() - t0)
            return
        with self._lock:
            self._windows.setdefault(r, []).append(Window(window, stream.kept, slot, from_s, shift_s, recv_shift_s, t0))

    def add(self, r: ServedRequest, item: TokenEvent | TimelineEvent) -> None:
        """One of ``r``'s own items (its token, a recovery's event) into its record."""
        self.add_all([(r, item)])

    def add_all(self, rows: list[tuple[ServedRequest, TokenEvent | TimelineEvent]]) -> None:
        """Each item into its request's record (a step's token rows: one lock for the step); an item of a
        request whose record is not written yet waits with it."""
        with self._lock:
            recs = []
            for r, item in rows:
                early = self._unrecorded.get(r)
                if early is not None:
                    early.append(item)
                else:
                    recs.append((self._records.get(r), item))
        for rec, item in recs:
            if rec is not None:
                (rec.on_tokens if isinstance(item, TokenEvent) else rec.on_event)(item)

    def on_stream_events(self, stream, events: list[TimelineEvent]) -> None:
        """Stored once, in the run's stream, and kept for the figures of the requests whose windows hold them
        (they arrived together: one arrival time)."""
        if stream.id is not None:
            recv = time.monotonic() - stream.t0
            for event in events:
                self.store.append_stream_event(stream.id, next(stream.seq), recv, event)
            stream.kept.add(recv, events)

    def finish(self, r: ServedRequest) -> None:
        """Finished once its last events can have arrived (the agents send theirs every ~50 ms)."""
        r.ended_at = r.ended_at or time.time()
        with self._lock:  # read together: its record moves from one to the other under this lock
            recorded = r in self._records or r in self._unrecorded
        if recorded:
            with self._due_changed:
                if not self._closing:
                    self._due.append((time.monotonic() + EVENTS_LAG_S, r))
                    self._due_changed.notify_all()

    def _close_record(self, r: ServedRequest) -> None:
        """Its windows closed and its run finished; on the record thread, whose results nobody reads, so a
        failure is logged and the run still finished (not left "running" in the workspace)."""
        with self._lock:
            rec = self._records.pop(r, None)
            windows = self._windows.pop(r, [])
        shared: list[tuple[float, TimelineEvent]] = []
        for w in windows:
            until: float | None = r.ended_at - w.t0
            try:
                retried(lambda: self.store.close_window(w.id, until))
            except Exception:  # its replay runs on past its end; the log says so
                log.exception("closing request %s's events window failed", r.id)
                until = None
            shared += w.kept.window(w.micro_batch, w.from_s, until, w.shift_s, w.recv_shift_s)
            w.kept.done(r, time.time() - w.t0)
        if rec is None:
            return
        status = "stopped" if r.cancelled else "failed" if r.failed is not None else "completed"
        before, devices = self._wire_at.pop(r, None), self.model.plan.devices()
        try:
            after = self._wire_counters(since=r.ended_at) if before is not None else None
        except Exception:  # recorded without its wire bytes
            log.exception("reading the agents' wire counters for request %s failed", r.id)
            after = None
        wire = wire_figures(None if after is None else sent_between(before, after), devices, None)
        try:
            retried(lambda: rec.finish(status, {**r.figures(), "wire": wire}, shared=shared))
        except Exception:
            log.exception("finishing request %s's run record failed", r.id)

    def mark_wire(self) -> None:
        """Read the agents' wire counters now (a loaded plan): later records count from here."""
        self.wire_last = (time.time(), counters_of(self.model.coordinator, self.model.plan.devices()))

    def _wire_counters(self, since: float):
        """The agents' wire counters as of ``since`` (``time.time()``) or later: the last read when it is that
        recent (requests ending together share one read), else read now. A request's record takes the last read
        as its start rather than reading at its join: a status round trip to every agent during its prefill
        cost ~7.6 ms of its TTFT (2 stages, load 14-17, alternate requests in one server)."""
        at, counters = self.wire_last
        if at < since + WIRE_SETTLE_S or counters is None:
            self.mark_wire()
            at, counters = self.wire_last
        return counters

    def _record(self, r: ServedRequest, batch: list[ServedRequest]) -> RunRecorder:
        m, p = self.model, r.parsed
        settings = p.sampling.applied_to(m.settings.generation, r.seed, r.max_tokens)
        record = {
            "model_dir": m.model_dir, "prompts": [r.prompt_text], "lanes": list(m.plan.devices()),
            "started_by": "edgeshard serve", "request_id": r.id,
            "endpoint": "/v1/completions" if p.kind == "completion" else "/v1/chat/completions",
            "messages": [list(x) for x in p.messages] if p.kind == "chat" else None,
            "max_new_tokens": r.max_tokens, "mode": settings.mode, "temperature": settings.temperature,
            "top_p": settings.top_p, "seed": r.seed, "stop": list(p.sampling.stop), "stream": p.stream,
            "repetition_penalty": settings.repetition_penalty,
            "no_repeat_ngram_size": settings.no_repeat_ngram_size, "frequency_penalty": settings.frequency_penalty,
            "presence_penalty": settings.presence_penalty, "logit_bias": [list(b) for b in settings.logit_bias],
            "dtype": settings.dtype,
            "prompt_tokens": len(r.prompt_ids), "batch": [b.id for b in batch],
            **batching_settings(m.plan, settings.micro_batches),
        }
        run_id = retried(lambda: self.store.create_run(m.session_id, model=m.name, mode=settings.mode,
                                                       kind="measured", plan_id=m.plan_id, settings=record))
        return RunRecorder(self.store, run_id, keep=True)

