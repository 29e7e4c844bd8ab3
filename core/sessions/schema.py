"""The workspace file's schema: its tables, the migrations between versions, and the checks
that decide whether a file may be opened at all.

Why apart from ``core.sessions.store``: what the file *is* (versions, tables, damage) changes
rarely and must be read on its own when a migration is added; the store's queries change
with every feature.

Schema versions: ``MIGRATIONS[i]`` takes a workspace from version i to i+1, each in its
own transaction, recorded in ``schema_version``. A file from a newer program is
refused (``StoreError``), never touched; an older one is migrated on open.
v1: sessions, devices, profiles, plans, runs, events, outputs.
v2: agent_logs; runs.kind (measured | simulated); (run_id, seq) indexes.
v3: runs.origin_json (the technique's own problem and plan the run was made from,
``core.sessions.origin.RecordedOrigin``; NULL for runs recorded before: "No prediction").
v4: event_streams, stream_events, run_windows: a served micro-batch's events stored once and shared by
    the runs of its requests, each reading its window of them (``SessionStore.timeline``).
v5: runs.final_plan_id: the plan a run finished on when a lost device re-planned it (``plan_id`` stays the
    one it started on; NULL: it finished where it started).

Damage: ``damage_of`` runs ``PRAGMA quick_check`` (read-only, so a damaged workspace can
still be opened for what is left); a read that meets a damaged page becomes
``damaged_read_error``, a ``StoreError`` saying how to recover.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import sqlite_utils

from core.errors import StoreError


def _v1(db: sqlite_utils.Database) -> None:
    db["sessions"].create({"id": int, "uid": str, "name": str, "created_at": str, "notes": str}, pk="id")
    db["sessions"].create_index(["uid"], unique=True)
    db["devices"].create({"id": int, "session_id": int, "device_id": str, "seen_at": str, "device_json": str},
                         pk="id", foreign_keys=[("session_id", "sessions", "id")])
    db["profiles"].create({"id": int, "session_id": int, "created_at": str, "profile_json": str},
                          pk="id", foreign_keys=[("session_id", "sessions", "id")])
    db["plans"].create({"id": int, "session_id": int, "created_at": str, "name": str, "plan_json": str},
                       pk="id", foreign_keys=[("session_id", "sessions", "id")])
    db["runs"].create(
        {"id": int, "session_id": int, "plan_id": int, "profile_id": int, "problem_json": str,
         "model": str, "mode": str, "settings_json": str, "status": str, "started_at": str,
         "ended_at": str, "figures_json": str},
        pk="id", foreign_keys=[("session_id", "sessions", "id")],
    )
    db["events"].create(
        {"id": int, "run_id": int, "seq": int, "recv_s": float, "device": str, "stage": int, "kind": str,
         "phase": str, "step": int, "micro_batch": int, "start_s": float, "end_s": float, "nbytes": int,
         "peer": str, "clock_uncertainty_s": float},
        pk="id", foreign_keys=[("run_id", "runs", "id")],
    )
    db["outputs"].create(
        {"id": int, "run_id": int, "seq": int, "recv_s": float, "micro_batch": int, "step": int, "t_s": float,
         "sequence_ids": str, "token_ids": str, "text": str},
        pk="id", foreign_keys=[("run_id", "runs", "id")],
    )


def _v2(db: sqlite_utils.Database) -> None:
    db["agent_logs"].create(
        {"id": int, "run_id": int, "device": str, "t_s": float, "level": str, "line": str},
        pk="id", foreign_keys=[("run_id", "runs", "id")],
    )
    db["runs"].add_column("kind", str, not_null_default="measured")
    db["events"].create_index(["run_id", "seq"])
    db["outputs"].create_index(["run_id", "seq"])
    db["agent_logs"].create_index(["run_id", "t_s"])


def _v3(db: sqlite_utils.Database) -> None:
    db["runs"].add_column("origin_json", str)


def _v4(db: sqlite_utils.Database) -> None:
    db["event_streams"].create({"id": int, "session_id": int, "created_at": str}, pk="id",
                               foreign_keys=[("session_id", "sessions", "id")])
    db["stream_events"].create(
        {"id": int, "stream_id": int, "seq": int, "recv_s": float, "device": str, "stage": int, "kind": str,
         "phase": str, "step": int, "micro_batch": int, "start_s": float, "end_s": float, "nbytes": int,
         "peer": str, "clock_uncertainty_s": float},
        pk="id", foreign_keys=[("stream_id", "event_streams", "id")],
    )
    db["run_windows"].create(
        {"id": int, "run_id": int, "stream_id": int, "micro_batch": int, "from_s": float, "until_s": float,
         "shift_s": float, "recv_shift_s": float},
        pk="id", foreign_keys=[("run_id", "runs", "id"), ("stream_id", "event_streams", "id")],
    )
    db["stream_events"].create_index(["stream_id", "micro_batch", "start_s"])
    db["run_windows"].create_index(["run_id"])


def _v5(db: sqlite_utils.Database) -> None:
    db["runs"].add_column("final_plan_id", int)


MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = [_v1, _v2, _v3, _v4, _v5]
SCHEMA_VERSION = len(MIGRATIONS)

EVENT_COLS = ("run_id", "seq", "recv_s", "device", "stage", "kind", "phase", "step", "micro_batch",
               "start_s", "end_s", "nbytes", "peer", "clock_uncertainty_s")
OUTPUT_COLS = ("run_id", "seq", "recv_s", "micro_batch", "step", "t_s", "sequence_ids", "token_ids", "text")
STREAM_EVENT_COLS = ("stream_id", *EVENT_COLS[1:])
LOG_COLS = ("run_id", "device", "t_s", "level", "line")
def connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), timeout=30.0, check_same_thread=False)
    conn.execute("PRAGMA busy_timeout = 30000")
    return conn


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def schema_version_of(conn: sqlite3.Connection) -> int | None:
    """Newest applied version, None for a file without a schema_version table."""
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if "schema_version" not in names:
        return None if names else 0
    row = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
    return int(row[0] or 0)


def check_openable(conn: sqlite3.Connection, path: str) -> int:
    """The file's schema version (0 for an empty file); a StoreError for a file that is
    not a workspace or was written by a newer program."""
    try:
        version = schema_version_of(conn)
    except sqlite3.DatabaseError as err:
        raise StoreError(f"{path}: not an EdgeShard workspace ({err})") from None
    if version is None:
        raise StoreError(f"{path}: not an EdgeShard workspace (it is an SQLite file without a schema_version table)")
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"{path}: this workspace was written by a newer EdgeShard Studio (schema v{version}); "
            f"this program reads up to v{SCHEMA_VERSION}. Upgrade edgeshard-studio to open it."
        )
    return version


def damage_of(conn: sqlite3.Connection, limit: int = 5) -> list[str]:
    """What ``PRAGMA quick_check`` finds wrong (at most ``limit`` lines); [] for a sound
    file. Read-only, so a damaged workspace can still be opened for what is left."""
    try:
        lines = [r[0] for r in conn.execute(f"PRAGMA quick_check({int(limit)})").fetchall()]
    except sqlite3.DatabaseError as err:
        return [str(err)]
    return [] if lines == ["ok"] else lines


def is_damage(err: sqlite3.Error) -> bool:
    return getattr(err, "sqlite_errorcode", None) in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


def damaged_read_error(path: Path, err: sqlite3.Error) -> StoreError:
    return StoreError(f"{path}: the workspace file is damaged ({err}); copy it aside and recover what is left "
                      f"with `sqlite3 {path.name} .recover`, or restore a backup")


def migrate(db: sqlite_utils.Database, path: str, upto: int = SCHEMA_VERSION) -> int:
    """Bring a workspace to version ``upto`` (tests pass a lower one to write old files)."""
    version = check_openable(db.conn, path)
    if version == 0:
        db["schema_version"].create({"version": int, "applied_at": str}, pk="version", if_not_exists=True)
    for target in range(version + 1, upto + 1):
        with db.atomic():
            MIGRATIONS[target - 1](db)
            db.conn.execute("INSERT INTO schema_version (version, applied_at) VALUES (?, ?)", (target, utc_now()))
    return max(version, upto)
