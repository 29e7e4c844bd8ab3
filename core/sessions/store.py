"""The SessionStore: one SQLite workspace file holding everything the studio saw.

Why SQLite (through sqlite-utils): one file an operator can copy, WAL mode so the GUI
reads while a run writes, and transactions so a crash never leaves half a row.

Tables: ``sessions``; ``devices`` (as seen at the time), ``profiles``, ``plans``
(versioned JSON documents from core.formats); ``runs`` (model, mode, settings,
status, figures); ``events`` (TimelineEvents) and ``outputs`` (TokenEvents) of a run,
sharing one per-run ``seq`` (arrival order) and ``recv_s`` (arrival time, seconds since
the run started) so a replay reproduces exactly what was seen live; ``agent_logs``.
Shared events (v4): a server's micro-batch holds several requests, each its own run, and its
events are stored once in ``stream_events`` (one ``event_streams`` row per open run of the
server); each run reads its ``run_windows``: its micro-batch's events from its join to its end,
moved onto its clock. ``timeline`` merges them with the run's own rows by arrival time.

Schema versions and their migrations are ``core.sessions.schema``: a file from a newer
program is refused (``StoreError``), never touched; an older one is migrated on open.

Events arrive from any thread at high rates: ``append_event`` only queues; a writer
thread with its own connection (``core.sessions.batch_writer``) commits them in batches, at least every
``flush_interval_s`` (default 0.25 s) or every ``max_batch`` rows. In WAL mode with
synchronous=NORMAL a committed batch survives a killed process (not a power cut), so
a ``kill -9`` loses at most the last interval of events and never corrupts the file
(tests/core/test_store.py kills a real recording process to check it).

Damage: opening runs ``PRAGMA quick_check``; what it finds (a zeroed or overwritten tail,
say) is kept in ``SessionStore.damage`` and logged as a warning, and a read that meets a
damaged page is a ``StoreError`` saying how to recover, never a raw sqlite3 error.

Errors: anything the operator can cause (a path that is not a workspace, a newer
schema, an unknown run id, a bad session file) is a ``StoreError`` naming the file.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sqlite3
import tempfile
import threading
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import sqlite_utils

from agents.protocol import TimelineEvent, TokenEvent
from core import formats
from core import paths
from core.devices.cluster import Device
from core.errors import FormatError, StoreError
from core.planning.plan import ShardPlan
from core.planning.problem import PlanningProblem
from core.devices.profile import Profile
from core.sessions.batch_writer import STOP, BatchWriter
from core.sessions.origin import RecordedOrigin
from core.sessions.schema import (
    EVENT_COLS, OUTPUT_COLS, SCHEMA_VERSION, check_openable, connect, damage_of, damaged_read_error, is_damage,
    migrate, utc_now,
)

ENV_WORKSPACE = paths.ENV_WORKSPACE
log = logging.getLogger(__name__)


def default_workspace_path() -> Path:
    """$EDGESHARD_WORKSPACE, else $XDG_DATA_HOME/edgeshard/workspace.sqlite (core.paths)."""
    return paths.workspace_file()


# ---------------------------------------------------------------- values

class SessionInfo(msgspec.Struct, frozen=True, kw_only=True):
    id: int
    uid: str
    name: str
    created_at: str
    notes: str = ""


class RunInfo(msgspec.Struct, frozen=True, kw_only=True):
    id: int
    session_id: int
    model: str
    mode: str
    kind: str
    status: str
    started_at: str
    ended_at: str | None
    settings: dict[str, Any]
    figures: dict[str, Any]
    plan_id: int | None = None
    """The plan the run started on."""
    profile_id: int | None = None
    final_plan_id: int | None = None
    """The plan a recovered run finished on (its last re-plan; None: it finished on ``plan_id``)."""


class RecordedItem(msgspec.Struct, frozen=True, kw_only=True):
    """One thing a run reported, in arrival order: exactly one of event / tokens is set."""

    seq: int
    recv_s: float
    event: TimelineEvent | None = None
    tokens: TokenEvent | None = None


class RecordedLogLine(msgspec.Struct, frozen=True, kw_only=True):
    """A log line a run stored (``agents.protocol.LogLine`` is the wire message)."""

    device: str
    t_s: float
    level: str
    line: str


# ---------------------------------------------------------------- store

class SessionStore:
    """One workspace file. Thread-safe: reads and metadata writes take a lock, event
    appends are queued to the batch writer. Close it (or use ``with``) to flush."""

    def __init__(self, path: str | os.PathLike, *, flush_interval_s: float = 0.25, max_batch: int = 2000,
                 _schema_upto: int = SCHEMA_VERSION):
        self.path = Path(path).expanduser()
        if self.path.exists() and self.path.is_dir():
            raise StoreError(f"{self.path}: is a directory, expected a workspace file (the SQLite sessions "
                             f"file, ${paths.ENV_WORKSPACE}; deployment keys go in the folder ${paths.ENV_HOME})")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = connect(self.path)
        except (OSError, sqlite3.Error) as err:
            raise StoreError(f"{self.path}: cannot open workspace ({err})") from None
        self.db = sqlite_utils.Database(conn, execute_plugins=False)
        self._lock = threading.RLock()
        try:
            # Check the version before anything writes to the file (WAL mode changes its
            # header): a refused file is left exactly as it was.
            check_openable(conn, str(self.path))
            self.damage = damage_of(conn)
            if self.damage:
                log.warning("%s: workspace damaged, some sessions may be missing or unreadable: %s",
                            self.path, "; ".join(self.damage))
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
            self.schema_version = migrate(self.db, str(self.path), _schema_upto)
        except sqlite3.DatabaseError as err:
            conn.close()
            raise StoreError(f"{self.path}: not an EdgeShard workspace ({err})") from None
        except StoreError:
            conn.close()
            raise
        self.journal_mode = mode
        self._flush_interval_s, self._max_batch = flush_interval_s, max_batch
        self._writer: BatchWriter | None = None
        self._closed = False
        self._held = threading.local()
        """Per thread, the rows it queues inside ``batched`` (None outside)."""

    # -- lifecycle
    def __enter__(self) -> SessionStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Flush queued rows, stop the writer, close the file."""
        if self._closed:
            return
        self._closed = True
        w = self._writer
        if w is not None:
            w.queue.put(STOP)
            w.join()
        self.db.conn.close()
        if w is not None and w.error is not None:
            raise StoreError(f"{self.path}: writing events failed ({w.error})")

    def flush(self, timeout_s: float = 30.0) -> None:
        """Block until every queued row is committed."""
        w = self._writer
        if w is None:
            return
        done = threading.Event()
        w.queue.put(done)
        if not done.wait(timeout_s):
            raise StoreError(f"{self.path}: flushing events timed out after {timeout_s} s")
        if w.error is not None:
            raise StoreError(f"{self.path}: writing events failed ({w.error})")

    @contextmanager
    def batched(self) -> Iterator[None]:
        """Rows this thread queues inside go to the writer in one hand-over when it ends (a step's tokens, a
        batch's events): one wake-up of the writer's thread, not one a row."""
        if getattr(self._held, "rows", None) is not None:
            yield
            return
        self._held.rows = rows = []
        try:
            yield
        finally:
            self._held.rows = None
            if rows:
                self._hand(rows)

    def _queue(self, table: str, row: tuple) -> None:
        if self._closed:
            raise StoreError(f"{self.path}: workspace is closed")
        held = getattr(self._held, "rows", None)
        if held is not None:
            held.append((table, row))
            return
        self._hand((table, row))

    def _hand(self, item: tuple | list) -> None:
        """A row (table, values), or a list of them, to the writer (started on the first)."""
        w = self._writer
        if w is None:
            with self._lock:
                if self._writer is None:
                    self._writer = BatchWriter(self.path, self._flush_interval_s, self._max_batch)
                    self._writer.start()
                w = self._writer
        w.queue.put(item)

    def _insert(self, table: str, row: dict) -> int:
        """One row of plain values (plain SQL: sqlite-utils reads the table's columns on every insert, and a
        server inserts rows per request)."""
        sql = f"INSERT INTO {table} ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})"
        with self._lock, self.db.atomic():
            return self.db.conn.execute(sql, tuple(row.values())).lastrowid

    def _update_run(self, run_id: int, sql: str, params: tuple) -> None:
        with self._lock, self.db.atomic():
            if self.db.conn.execute(f"UPDATE runs SET {sql} WHERE id = ?", (*params, run_id)).rowcount == 0:
                raise StoreError(f"{self.path}: no run {run_id} (see `edgeshard sessions`)")

    def _rows(self, sql: str, params: Sequence = ()) -> list[dict]:
        with self._lock:
            try:
                cur = self.db.conn.execute(sql, params)
                cols = [c[0] for c in cur.description]
                return [dict(zip(cols, r)) for r in cur.fetchall()]
            except sqlite3.DatabaseError as err:
                if is_damage(err):
                    raise damaged_read_error(self.path, err) from None
                raise

    # -- sessions, devices, profiles, plans
    def create_session(self, name: str, notes: str = "") -> int:
        return self._insert("sessions", {"uid": uuid.uuid4().hex, "name": name, "created_at": utc_now(), "notes": notes})

    def sessions(self) -> list[SessionInfo]:
        return [SessionInfo(**r) for r in self._rows("SELECT id, uid, name, created_at, notes FROM sessions ORDER BY id")]

    def session(self, session_id: int) -> SessionInfo:
        rows = self._rows("SELECT id, uid, name, created_at, notes FROM sessions WHERE id = ?", (session_id,))
        if not rows:
            raise StoreError(f"{self.path}: no session {session_id}")
        return SessionInfo(**rows[0])

    def add_devices(self, session_id: int, devices: Iterable[Device]) -> None:
        seen = utc_now()
        rows = [{"session_id": session_id, "device_id": d.id, "seen_at": seen,
                 "device_json": msgspec.json.encode(d).decode()} for d in devices]
        with self._lock, self.db.atomic():
            self.db["devices"].insert_all(rows)

    def devices(self, session_id: int) -> list[Device]:
        rows = self._rows("SELECT device_json FROM devices WHERE session_id = ? ORDER BY id", (session_id,))
        return [msgspec.json.decode(r["device_json"], type=Device) for r in rows]

    def add_profile(self, session_id: int, profile: Profile) -> int:
        return self._insert("profiles", {"session_id": session_id, "created_at": utc_now(),
                                         "profile_json": formats.encode(profile).decode()})

    def add_plan(self, session_id: int, plan: ShardPlan, name: str = "") -> int:
        return self._insert("plans", {"session_id": session_id, "created_at": utc_now(), "name": name,
                                      "plan_json": formats.encode(plan).decode()})

    def plan(self, plan_id: int) -> ShardPlan:
        rows = self._rows("SELECT plan_json FROM plans WHERE id = ?", (plan_id,))
        if not rows:
            raise StoreError(f"{self.path}: no plan {plan_id}")
        return self._decode(rows[0]["plan_json"], ShardPlan, f"plan {plan_id}")

    def profile(self, profile_id: int) -> Profile:
        rows = self._rows("SELECT profile_json FROM profiles WHERE id = ?", (profile_id,))
        if not rows:
            raise StoreError(f"{self.path}: no profile {profile_id}")
        return self._decode(rows[0]["profile_json"], Profile, f"profile {profile_id}")

    def _decode(self, text: str, typ: type, what: str):
        try:
            return formats.decode(text, typ, f"{self.path} ({what})")
        except FormatError as err:
            raise StoreError(str(err)) from None

    # -- runs
    def create_run(self, session_id: int, *, model: str, mode: str, kind: str = "measured",
                   plan_id: int | None = None, profile_id: int | None = None,
                   problem: PlanningProblem | None = None, settings: dict[str, Any] | None = None) -> int:
        self.session(session_id)
        return self._insert("runs", {
            "session_id": session_id, "plan_id": plan_id, "profile_id": profile_id,
            "problem_json": formats.encode(problem).decode() if problem is not None else None,
            "model": model, "mode": mode, "kind": kind, "settings_json": json.dumps(settings or {}, sort_keys=True),
            "status": "running", "started_at": utc_now(), "ended_at": None, "figures_json": "{}",
        })

    def finish_run(self, run_id: int, status: str, figures: dict[str, Any] | msgspec.Struct | None = None, *,
                   queued: bool = False) -> None:
        """Its status and figures. ``queued``: by the writer, in its next batch, after the run's rows queued before
        (a reader that sees it finished sees them), with no commit of its own (a server finishes a run a request)."""
        fig = msgspec.to_builtins(figures) if figures is not None else {}
        values = (status, utc_now(), json.dumps(fig, sort_keys=True))
        if queued:
            self._queue("run_finished", (*values, run_id))
        else:
            self._update_run(run_id, "status = ?, ended_at = ?, figures_json = ?", values)

    def set_final_plan(self, run_id: int, plan: ShardPlan) -> int:
        """Record the plan a run finished on after a re-plan (stored in the run's session); its id."""
        plan_id = self.add_plan(self.run(run_id).session_id, plan, "re-planned")
        self._update_run(run_id, "final_plan_id = ?", (plan_id,))
        return plan_id

    def add_figures(self, run_id: int, figures: dict[str, Any]) -> None:
        """Merge ``figures`` into a run's recorded ones (measured after it was finished, e.g. its wire bytes)."""
        merged = {**self.run(run_id).figures, **msgspec.to_builtins(figures)}
        with self._lock, self.db.atomic():
            self.db["runs"].update(run_id, {"figures_json": json.dumps(merged, sort_keys=True)})

    def runs(self, session_id: int | None = None) -> list[RunInfo]:
        where, params = ("WHERE session_id = ?", (session_id,)) if session_id is not None else ("", ())
        return [self._run_info(r) for r in self._rows(f"SELECT * FROM runs {where} ORDER BY id", params)]

    def run(self, run_id: int) -> RunInfo:
        rows = self._rows("SELECT * FROM runs WHERE id = ?", (run_id,))
        if not rows:
            raise StoreError(f"{self.path}: no run {run_id} (see `edgeshard sessions`)")
        return self._run_info(rows[0])

    @staticmethod
    def _run_info(r: dict) -> RunInfo:
        return RunInfo(id=r["id"], session_id=r["session_id"], model=r["model"] or "", mode=r["mode"] or "",
                       kind=r["kind"], status=r["status"], started_at=r["started_at"], ended_at=r["ended_at"],
                       settings=json.loads(r["settings_json"] or "{}"), figures=json.loads(r["figures_json"] or "{}"),
                       plan_id=r["plan_id"], profile_id=r["profile_id"], final_plan_id=r.get("final_plan_id"))

    def problem_of(self, run_id: int) -> PlanningProblem | None:
        rows = self._rows("SELECT problem_json FROM runs WHERE id = ?", (run_id,))
        if not rows or rows[0]["problem_json"] is None:
            return None
        return self._decode(rows[0]["problem_json"], PlanningProblem, f"problem of run {run_id}")

    def set_origin(self, run_id: int, origin: RecordedOrigin) -> None:
        """Store the technique's problem and plan ``run_id`` was made from (what predicts its replay)."""
        self.run(run_id)
        with self._lock, self.db.atomic():
            self.db["runs"].update(run_id, {"origin_json": msgspec.json.encode(origin).decode()})

    def origin_of(self, run_id: int) -> RecordedOrigin | None:
        """None for a run recorded without one (before schema v3, or a technique that does not say)."""
        rows = self._rows("SELECT origin_json FROM runs WHERE id = ?", (run_id,))
        if not rows or rows[0]["origin_json"] is None:
            return None
        try:
            return msgspec.json.decode(rows[0]["origin_json"], type=RecordedOrigin)
        except msgspec.DecodeError as err:
            raise StoreError(f"{self.path}: the origin of run {run_id} is unreadable ({err})") from None

    # -- events, outputs, logs
    def append_event(self, run_id: int, seq: int, recv_s: float, ev: TimelineEvent) -> None:
        """Queue one event; committed by the writer within ``flush_interval_s``."""
        self._queue("events", (run_id, seq, recv_s, ev.device, ev.stage, ev.kind, ev.phase, ev.step,
                               ev.micro_batch, ev.start_s, ev.end_s, ev.nbytes, ev.peer, ev.clock_uncertainty_s))

    def append_tokens(self, run_id: int, seq: int, recv_s: float, tok: TokenEvent) -> None:
        self._queue("outputs", (run_id, seq, recv_s, tok.micro_batch, tok.step, tok.t_s, _json_text(tok.sequence_ids),
                                _json_text(tok.token_ids), _json_text(tok.text)))

    def create_event_stream(self, session_id: int) -> int:
        """A stream of events several runs share (a server's open run: its micro-batches' events, once)."""
        return self._insert("event_streams", {"session_id": session_id, "created_at": utc_now()})

    def append_stream_event(self, stream_id: int, seq: int, recv_s: float, ev: TimelineEvent) -> None:
        """Queue one shared event (``seq``/``recv_s`` on the stream's own order and clock)."""
        self._queue("stream_events", (stream_id, seq, recv_s, ev.device, ev.stage, ev.kind, ev.phase, ev.step,
                                      ev.micro_batch, ev.start_s, ev.end_s, ev.nbytes, ev.peer,
                                      ev.clock_uncertainty_s))

    def open_window(self, run_id: int, stream_id: int, micro_batch: int, *, from_s: float, shift_s: float,
                    recv_shift_s: float) -> int:
        """Run ``run_id`` holds ``micro_batch``'s events of ``stream_id`` that start at ``from_s`` or later (the
        stream's clock; until ``close_window``), each moved by ``shift_s`` onto the run's clock and its arrival by
        ``recv_shift_s`` onto the run's arrival clock."""
        return self._insert("run_windows", {"run_id": run_id, "stream_id": stream_id, "micro_batch": micro_batch,
                                            "from_s": from_s, "until_s": None, "shift_s": shift_s,
                                            "recv_shift_s": recv_shift_s})

    def close_window(self, window_id: int, until_s: float) -> None:
        """The run takes no events of its window that start after ``until_s`` (the stream's clock)."""
        with self._lock, self.db.atomic():
            self.db.conn.execute("UPDATE run_windows SET until_s = ? WHERE id = ?", (until_s, window_id))

    def append_log(self, run_id: int, device: str, t_s: float, level: str, line: str) -> None:
        self._queue("agent_logs", (run_id, device, t_s, level, line))

    def events(self, run_id: int) -> list[TimelineEvent]:
        return [i.event for i in self.timeline(run_id) if i.event is not None]

    def tokens(self, run_id: int) -> list[TokenEvent]:
        return [i.tokens for i in self.timeline(run_id) if i.tokens is not None]

    def logs(self, run_id: int) -> list[RecordedLogLine]:
        return [RecordedLogLine(**r) for r in self._rows(
            "SELECT device, t_s, level, line FROM agent_logs WHERE run_id = ? ORDER BY t_s, id", (run_id,))]

    def timeline(self, run_id: int) -> list[RecordedItem]:
        """Every committed event and token output of a run, in arrival order."""
        self.run(run_id)
        items: list[RecordedItem] = []
        for r in self._rows(f"SELECT {', '.join(EVENT_COLS)} FROM events WHERE run_id = ? ORDER BY seq, id", (run_id,)):
            ev = TimelineEvent(**{k: r[k] for k in EVENT_COLS[3:]})
            items.append(RecordedItem(seq=r["seq"], recv_s=r["recv_s"], event=ev))
        for r in self._rows(f"SELECT {', '.join(OUTPUT_COLS)} FROM outputs WHERE run_id = ? ORDER BY seq, id", (run_id,)):
            tok = TokenEvent(micro_batch=r["micro_batch"], step=r["step"], t_s=r["t_s"],
                             sequence_ids=tuple(_from_json(r["sequence_ids"])),
                             token_ids=tuple(_from_json(r["token_ids"])), text=tuple(_from_json(r["text"])))
            items.append(RecordedItem(seq=r["seq"], recv_s=r["recv_s"], tokens=tok))
        items.sort(key=lambda i: i.seq)
        shared = self._window_events(run_id)
        if not shared:
            return items
        merged = sorted(items + shared, key=lambda i: i.recv_s)  # stable: each part keeps its own order
        return [msgspec.structs.replace(i, seq=k) for k, i in enumerate(merged)]

    def _window_events(self, run_id: int) -> list[RecordedItem]:
        """The shared events a run's windows hold, on its clocks (micro-batch 0: the run's own), in stream order."""
        cols = ", ".join(f"e.{c}" for c in EVENT_COLS[3:] if c not in ("micro_batch", "start_s", "end_s"))
        rows = self._rows(
            f"SELECT e.recv_s + w.recv_shift_s AS recv_s, e.start_s + w.shift_s AS start_s, e.end_s + w.shift_s "
            f"AS end_s, {cols} FROM run_windows w JOIN stream_events e ON e.stream_id = w.stream_id AND "
            f"e.micro_batch = w.micro_batch WHERE w.run_id = ? AND e.start_s >= w.from_s AND (w.until_s IS NULL "
            f"OR e.start_s <= w.until_s) ORDER BY w.id, e.seq, e.id", (run_id,))
        return [RecordedItem(seq=0, recv_s=r.pop("recv_s"), event=TimelineEvent(micro_batch=0, **r)) for r in rows]

    def integrity_check(self) -> str:
        with self._lock:
            return self.db.conn.execute("PRAGMA integrity_check").fetchone()[0]

    # -- one session as one file
    def export_session(self, session_id: int, path: str | os.PathLike) -> Path:
        """Write one session (its devices, profiles, plans, runs, events, outputs, logs)
        as a standalone single-file workspace another machine can import."""
        self.session(session_id)
        self.flush()
        dest = Path(path).expanduser()
        if dest.exists():
            raise StoreError(f"{dest}: already exists; choose another file name")
        tmp = dest.with_name(f".{dest.name}.partial")
        if tmp.exists():
            tmp.unlink()
        try:
            out = SessionStore(tmp)
            try:
                _copy_session(out, self.path, session_id)
                with out._lock:
                    out.db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                    out.db.conn.execute("PRAGMA journal_mode=DELETE")
            finally:
                out.close()
            os.replace(tmp, dest)
        except BaseException:
            for p in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
                if p.exists():
                    p.unlink()
            raise
        return dest

    def import_session(self, path: str | os.PathLike) -> int:
        """Add the session of an exported file to this workspace; returns its new id.

        The file is migrated on a private copy (an older export is fine; a newer one is
        refused) and ids are renumbered. Importing the same session twice is refused.
        """
        src = Path(path).expanduser()
        if not src.is_file():
            raise StoreError(f"{src}: no such session file")
        with tempfile.TemporaryDirectory(prefix="edgeshard-import-") as d:
            copy = Path(d) / "session.sqlite"
            shutil.copyfile(src, copy)
            try:
                other = SessionStore(copy)
            except StoreError as err:
                raise StoreError(f"{src}: cannot import: {err}") from None
            try:
                sessions = other.sessions()
            finally:
                other.close()
            if len(sessions) != 1:
                raise StoreError(f"{src}: a session file holds exactly one session, this one holds {len(sessions)}")
            existing = self._rows("SELECT id FROM sessions WHERE uid = ?", (sessions[0].uid,))
            if existing:
                raise StoreError(f"{src}: this session is already in the workspace as session {existing[0]['id']}")
            self.flush()
            return _copy_session(self, copy, sessions[0].id)


def _json_text(values: tuple) -> str:
    """A token row's ids or texts as a JSON array. msgspec, not json: a served token is a row, and a row's three
    cost ~1 us here against json's ~16 us (both ways; timeit at load 15)."""
    return msgspec.json.encode(values).decode()


_from_json = msgspec.json.Decoder().decode


def _columns(conn: sqlite3.Connection, table: str) -> list[str]:
    return [r[1] for r in conn.execute(f"PRAGMA main.table_info({table})") if r[1] != "id"]


def _copy_session(dest: SessionStore, src_path: Path, session_id: int) -> int:
    """Copy one session from the workspace file ``src_path`` into ``dest`` (same schema
    version), renumbering ids; one transaction. Returns the session's id in ``dest``."""
    conn = dest.db.conn
    with dest._lock:
        conn.execute("ATTACH DATABASE ? AS src", (str(src_path),))
        try:
            with dest.db.atomic():
                cols = _columns(conn, "sessions")
                conn.execute(f"INSERT INTO main.sessions ({', '.join(cols)}) "
                             f"SELECT {', '.join(cols)} FROM src.sessions WHERE id = ?", (session_id,))
                new_sid = conn.execute("SELECT last_insert_rowid()").fetchone()[0]
                ids: dict[str, dict[int, int]] = {}
                for table in ("devices", "profiles", "plans", "event_streams"):
                    ids[table] = {}
                    cols = _columns(conn, table)
                    sel = ", ".join("?" if c == "session_id" else c for c in cols)
                    for (old,) in conn.execute(f"SELECT id FROM src.{table} WHERE session_id = ? ORDER BY id",
                                               (session_id,)).fetchall():
                        conn.execute(f"INSERT INTO main.{table} ({', '.join(cols)}) SELECT {sel} FROM src.{table} "
                                     f"WHERE id = ?", (new_sid, old))
                        ids[table][old] = conn.execute("SELECT last_insert_rowid()").fetchone()[0]
                cols = _columns(conn, "stream_events")
                sel = ", ".join("?" if c == "stream_id" else c for c in cols)
                for old, new in ids["event_streams"].items():
                    conn.execute(f"INSERT INTO main.stream_events ({', '.join(cols)}) SELECT {sel} FROM "
                                 f"src.stream_events WHERE stream_id = ? ORDER BY id", (new, old))
                run_cols = _columns(conn, "runs")
                for old_run, plan_id, profile_id, final_plan_id in conn.execute(
                        "SELECT id, plan_id, profile_id, final_plan_id FROM src.runs WHERE session_id = ? ORDER BY id",
                        (session_id,)).fetchall():
                    remap = {"session_id": new_sid, "plan_id": ids["plans"].get(plan_id),
                             "profile_id": ids["profiles"].get(profile_id),
                             "final_plan_id": ids["plans"].get(final_plan_id)}
                    sel = ", ".join("?" if c in remap else c for c in run_cols)
                    params = [remap[c] for c in run_cols if c in remap]
                    conn.execute(f"INSERT INTO main.runs ({', '.join(run_cols)}) SELECT {sel} FROM src.runs "
                                 f"WHERE id = ?", (*params, old_run))
                    new_run = conn.execute("SELECT last_insert_rowid()").fetchone()[0]
                    for table in ("events", "outputs", "agent_logs"):
                        cols = _columns(conn, table)
                        sel = ", ".join("?" if c == "run_id" else c for c in cols)
                        conn.execute(f"INSERT INTO main.{table} ({', '.join(cols)}) SELECT {sel} FROM src.{table} "
                                     f"WHERE run_id = ? ORDER BY id", (new_run, old_run))
                    cols = _columns(conn, "run_windows")
                    for row in conn.execute(f"SELECT {', '.join(cols)} FROM src.run_windows WHERE run_id = ? "
                                            f"ORDER BY id", (old_run,)).fetchall():
                        row = dict(zip(cols, row), run_id=new_run)
                        row["stream_id"] = ids["event_streams"][row["stream_id"]]
                        conn.execute(f"INSERT INTO main.run_windows ({', '.join(row)}) VALUES "
                                     f"({', '.join('?' * len(row))})", tuple(row.values()))
        finally:
            conn.execute("DETACH DATABASE src")
    return new_sid
