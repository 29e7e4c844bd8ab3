"""Shared events (schema v4): a stream's events stored once, read by each run through its window
(its micro-batch, from its join to its end, moved onto its clocks); exported and imported with their
runs; a workspace written before v4 opens with its runs as they were. Real SQLite files."""

from __future__ import annotations

import sqlite_utils

from agents.protocol import TimelineEvent, TokenEvent
from core.sessions.schema import SCHEMA_VERSION, migrate
from core.sessions.store import SessionStore


def _ev(step: int, start_s: float, micro_batch: int = 0) -> TimelineEvent:
    return TimelineEvent(device="a", stage=0, kind="compute", phase="decode", step=step, micro_batch=micro_batch,
                         start_s=start_s, end_s=start_s + 0.01, nbytes=step, peer="b")


def _tok(step: int, t_s: float) -> TokenEvent:
    return TokenEvent(micro_batch=0, step=step, t_s=t_s, sequence_ids=(0,), token_ids=(100 + step,), text=(f"w{step}",))


def _two_runs_on_one_stream(store: SessionStore) -> tuple[int, int, int]:
    """Micro-batch 0's steps 0-3 start at 0.0, 0.1, 0.2, 0.3 s and arrive 0.05 s later; micro-batch 1 has one.
    Run A joined at 0.05 and ended at 0.25 (its clock 0.05 s behind the stream's, its arrival clock 0.5 s
    ahead); run B joined at 0.15 and is still running (clock 0.15 s behind)."""
    session = store.create_session("served")
    stream = store.create_event_stream(session)
    for seq, (step, start, mb) in enumerate([(0, 0.0, 0), (1, 0.1, 0), (9, 0.12, 1), (2, 0.2, 0), (3, 0.3, 0)]):
        store.append_stream_event(stream, seq, start + 0.05, _ev(step, start, mb))
    a = store.create_run(session, model="m", mode="no-bubbles")
    b = store.create_run(session, model="m", mode="no-bubbles")
    store.close_window(store.open_window(a, stream, 0, from_s=0.05, shift_s=-0.05, recv_shift_s=-0.5), 0.25)
    store.open_window(b, stream, 0, from_s=0.15, shift_s=-0.15, recv_shift_s=0.0)
    store.append_tokens(a, 0, -0.33, _tok(1, 0.1))  # arrives (on A's clock) between its steps 1 and 2
    store.append_tokens(a, 1, -0.2, _tok(2, 0.2))   # and after step 2
    store.flush()
    return session, a, b


def test_each_run_reads_its_micro_batchs_events_in_its_window_on_its_own_clocks_stored_once(tmp_path):
    with SessionStore(tmp_path / "ws.sqlite") as store:
        _, a, b = _two_runs_on_one_stream(store)
        items = store.timeline(a)
        assert [i.seq for i in items] == [0, 1, 2, 3]
        assert [(i.event or i.tokens).step for i in items] == [1, 1, 2, 2]  # merged by arrival
        assert [round(i.recv_s, 9) for i in items] == [-0.35, -0.33, -0.25, -0.2]
        assert store.events(a) == [TimelineEvent(device="a", stage=0, kind="compute", phase="decode", step=s,
                                                 micro_batch=0, start_s=t - 0.05, end_s=t + 0.01 - 0.05, nbytes=s,
                                                 peer="b") for s, t in ((1, 0.1), (2, 0.2))]
        assert [e.step for e in store.events(b)] == [2, 3]  # open: everything from its join on
        assert [t.token_ids for t in store.tokens(a)] == [(101,), (102,)]
        assert store.db.conn.execute("SELECT COUNT(*) FROM stream_events").fetchone()[0] == 5
        assert store.db.conn.execute("SELECT COUNT(*) FROM events").fetchone()[0] == 0


def test_an_exported_and_imported_session_keeps_each_runs_shared_events(tmp_path):
    with SessionStore(tmp_path / "ws.sqlite") as store:
        session, a, b = _two_runs_on_one_stream(store)
        before = [store.timeline(a), store.timeline(b)]
        store.export_session(session, tmp_path / "served.session")
    with SessionStore(tmp_path / "other.sqlite") as other:
        other.create_session("already here")  # ids renumbered on import
        new = other.import_session(tmp_path / "served.session")
        runs = other.runs(new)
        assert [other.timeline(r.id) for r in runs] == before
        assert other.db.conn.execute("SELECT COUNT(*) FROM stream_events").fetchone()[0] == 5


def test_a_workspace_from_before_shared_events_opens_with_its_served_runs_as_recorded(tmp_path):
    """A v3 workspace (each request's events copied into its own run, as serve recorded them) migrates to v4."""
    path = tmp_path / "v3.sqlite"
    db = sqlite_utils.Database(path)
    assert migrate(db, str(path), upto=3) == 3
    db.conn.execute("INSERT INTO sessions (uid, name, created_at, notes) VALUES ('u1', 'serve', '2026-01-01', '')")
    for run in (1, 2):
        db.conn.execute("INSERT INTO runs (session_id, model, mode, settings_json, status, started_at, figures_json, "
                        "kind) VALUES (1, 'm', 'no-bubbles', '{}', 'completed', '2026-01-01', '{}', 'measured')")
        for seq, step in enumerate((1, 2)):
            db.conn.execute("INSERT INTO events (run_id, seq, recv_s, device, stage, kind, phase, step, micro_batch, "
                            "start_s, end_s, nbytes, peer, clock_uncertainty_s) VALUES (?, ?, ?, 'a', 0, 'compute', "
                            "'decode', ?, 0, ?, ?, ?, 'b', 0.0)", (run, seq, 0.1 * step, step, 0.1 * step,
                                                                   0.1 * step + 0.01, step))
    db.conn.commit()
    db.close()
    with SessionStore(path) as store:
        assert store.schema_version == SCHEMA_VERSION == 5
        for run in (1, 2):
            assert store.events(run) == [_ev(s, 0.1 * s) for s in (1, 2)]
        stream = store.create_event_stream(1)  # and it records served runs the new way
        store.append_stream_event(stream, 0, 0.0, _ev(7, 0.5))
        store.open_window(2, stream, 0, from_s=0.0, shift_s=0.0, recv_shift_s=1.0)
        store.flush()
        assert [e.step for e in store.events(2)] == [1, 2, 7]
