"""SessionStore: real SQLite files, WAL, batched writes, migrations, crash safety, session files."""

from __future__ import annotations

import hashlib
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import sqlite_utils

from agents.protocol import TimelineEvent, TokenEvent
from core.errors import StoreError
from core.sessions.recording import RunRecorder, record_simulation
from core.runs.simulator import simulate
from core.sessions.schema import SCHEMA_VERSION, migrate, schema_version_of
from core.sessions.store import SessionStore
from tests.core.sessions_problems import make_plan, make_problem

REPO = Path(__file__).resolve().parents[3]


def _ev(i: int, device: str = "a") -> TimelineEvent:
    return TimelineEvent(device=device, stage=0, kind="compute", phase="decode", step=i, micro_batch=0,
                         start_s=i * 0.01, end_s=i * 0.01 + 0.005)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_new_workspace_is_created_at_the_current_schema_in_wal_mode(tmp_path):
    with SessionStore(tmp_path / "ws.sqlite") as store:
        assert store.schema_version == SCHEMA_VERSION
        assert store.journal_mode == "wal"
        tables = set(store.db.table_names())
    assert {"sessions", "devices", "profiles", "plans", "runs", "events", "outputs", "agent_logs",
            "schema_version"} <= tables


def test_session_devices_profile_plan_and_run_round_trip(tmp_path):
    p = make_problem({"a": 0.01, "b": 0.02})
    plan = make_plan(p, ["a", "b"], [4])
    with SessionStore(tmp_path / "ws.sqlite") as store:
        sid = store.create_session("bench day", notes="two boards")
        store.add_devices(sid, p.profile.cluster.devices)
        prof = store.add_profile(sid, p.profile)
        pl = store.add_plan(sid, plan, "latency")
        rid = store.create_run(sid, model="tiny-test", mode="no-bubbles", plan_id=pl, profile_id=prof, problem=p,
                               settings={"micro_batches": 2})
        store.finish_run(rid, "completed", {"ttft_s": 0.5})
    with SessionStore(tmp_path / "ws.sqlite") as store:
        assert [s.name for s in store.sessions()] == ["bench day"]
        assert store.devices(sid) == list(p.profile.cluster.devices)
        assert store.profile(prof) == p.profile
        assert store.plan(pl) == plan
        assert store.problem_of(rid) == p
        run = store.run(rid)
        assert (run.status, run.mode, run.kind, run.settings, run.figures) == (
            "completed", "no-bubbles", "measured", {"micro_batches": 2}, {"ttft_s": 0.5})


def test_events_and_tokens_from_many_threads_are_all_stored_in_arrival_order(tmp_path):
    with SessionStore(tmp_path / "ws.sqlite") as store:
        sid = store.create_session("s")
        rid = store.create_run(sid, model="m", mode="sequential")
        rec = RunRecorder(store, rid)

        def emit(dev: str) -> None:
            for i in range(500):
                rec.on_event(_ev(i, dev))
                if i % 50 == 0:
                    rec.on_tokens(TokenEvent(micro_batch=0, step=i, sequence_ids=(0,), token_ids=(i,),
                                             text=(f"w{i}",), t_s=i * 0.01))

        threads = [threading.Thread(target=emit, args=(d,)) for d in "abcd"]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rec.finish("completed")
        items = store.timeline(rid)
    assert [i.seq for i in items] == list(range(4 * 510))
    assert [i.recv_s for i in items] == sorted(i.recv_s for i in items)
    for d in "abcd":
        assert [i.event.step for i in items if i.event and i.event.device == d] == list(range(500))
    toks = [i.tokens for i in items if i.tokens]
    assert len(toks) == 40 and toks[0].text == ("w0",)



def test_rows_handed_over_in_batches_from_several_threads_are_all_stored_in_arrival_order(tmp_path):
    with SessionStore(tmp_path / "ws.sqlite") as store:
        rid = store.create_run(store.create_session("s"), model="m", mode="sequential")
        rec = RunRecorder(store, rid)

        def emit(dev: str) -> None:
            for k in range(10):
                with store.batched():  # one hand-over to the writer per 50 rows
                    for i in range(50 * k, 50 * k + 50):
                        rec.on_event(_ev(i, dev))

        threads = [threading.Thread(target=emit, args=(d,)) for d in "abcd"]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        store.flush()
        items = store.timeline(rid)
    assert [i.seq for i in items] == list(range(2000))
    for d in "abcd":
        assert [i.event.step for i in items if i.event.device == d] == list(range(500))


def test_a_recorder_that_keeps_what_it_recorded_finishes_with_its_stored_timelines_figures(tmp_path):
    from core.runs.metrics import compute_figures

    with SessionStore(tmp_path / "ws.sqlite") as store:
        rid = store.create_run(store.create_session("s"), model="m", mode="sequential")
        rec = RunRecorder(store, rid, keep=True)
        for i in range(60):
            rec.on_event(_ev(i, "abc"[i % 3]))
            if i % 3 == 2:
                rec.on_tokens(TokenEvent(micro_batch=0, step=i // 3, sequence_ids=(0,), token_ids=(i,),
                                         text=(f"w{i}",), t_s=i * 0.0107))
        figures = rec.finish("completed")  # its status goes with its rows, in the writer's next batch
        store.flush()
        assert store.run(rid).status == "completed" and store.run(rid).figures["tokens"] == 20
        assert figures == compute_figures(store.events(rid), store.tokens(rid))

def test_queued_events_are_committed_within_the_flush_interval_without_an_explicit_flush(tmp_path):
    path = tmp_path / "ws.sqlite"
    with SessionStore(path, flush_interval_s=0.2) as store:
        rid = store.create_run(store.create_session("s"), model="m", mode="sequential")
        for i in range(10):
            store.append_event(rid, i, 0.0, _ev(i))
        deadline = time.monotonic() + 10.0  # 50 intervals: room for a loaded host, none for "only at close"
        seen = 0
        while time.monotonic() < deadline and seen < 10:
            time.sleep(0.05)
            with sqlite3.connect(path) as other:
                seen = other.execute("SELECT COUNT(*) FROM events").fetchone()[0]
        assert seen == 10


def test_a_workspace_from_a_newer_program_is_refused_and_left_untouched(tmp_path):
    path = tmp_path / "ws.sqlite"
    SessionStore(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT INTO schema_version (version, applied_at) VALUES (99, 'future')")
    conn.close()
    before = _sha(path)
    with pytest.raises(StoreError, match=r"(?i)newer EdgeShard Studio \(schema v99\).*upgrade"):
        SessionStore(path)
    assert _sha(path) == before


def test_a_v1_workspace_is_migrated_forward_and_keeps_its_data(tmp_path):
    # The fixture is written by the real v1 migration, then filled as v1 code did.
    path = tmp_path / "old.sqlite"
    db = sqlite_utils.Database(path)
    assert migrate(db, str(path), upto=1) == 1
    db.conn.execute("INSERT INTO sessions (uid, name, created_at, notes) VALUES ('u1', 'old', '2025-01-01', '')")
    db.conn.execute("INSERT INTO runs (session_id, model, mode, settings_json, status, started_at, figures_json) "
                    "VALUES (1, 'm', 'sequential', '{}', 'completed', '2025-01-01', '{\"ttft_s\": 1.0}')")
    db.conn.execute("INSERT INTO events (run_id, seq, recv_s, device, stage, kind, phase, step, micro_batch, start_s, "
                    "end_s, nbytes, peer, clock_uncertainty_s) VALUES (1, 0, 0.1, 'a', 0, 'compute', 'prefill', 0, 0, "
                    "0.0, 0.1, 0, '', 0.0)")
    db.conn.commit()
    db.close()
    assert "agent_logs" not in sqlite_utils.Database(path).table_names()
    with SessionStore(path) as store:
        assert store.schema_version == SCHEMA_VERSION == 5
        run = store.run(1)
        assert (run.kind, run.figures) == ("measured", {"ttft_s": 1.0})
        assert store.events(1) == [TimelineEvent(device="a", stage=0, kind="compute", phase="prefill", step=0,
                                                 micro_batch=0, start_s=0.0, end_s=0.1)]
        store.append_log(1, "a", 0.5, "info", "loaded shard")
        store.flush()
        assert store.logs(1)[0].line == "loaded shard"
        assert store.origin_of(1) is None  # recorded before origins were: its replay predicts nothing
        assert run.final_plan_id is None  # recorded before re-plans were: it finished where it started
        versions = [r[0] for r in store.db.conn.execute("SELECT version FROM schema_version ORDER BY version")]
    assert versions == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("content", [b"hello, not a database" * 100, None])
def test_a_file_that_is_not_a_workspace_is_refused_with_a_store_error(tmp_path, content):
    path = tmp_path / "x.sqlite"
    if content is not None:
        path.write_bytes(content)
    else:  # a real SQLite file of some other program
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE notes (x TEXT)")
        conn.close()
    before = _sha(path)
    with pytest.raises(StoreError, match="not an EdgeShard workspace"):
        SessionStore(path)
    assert _sha(path) == before


def test_an_unknown_run_is_a_store_error(tmp_path):
    with SessionStore(tmp_path / "ws.sqlite") as store:
        with pytest.raises(StoreError, match="no run 42"):
            store.timeline(42)
        with pytest.raises(StoreError, match="no run 42"):
            RunRecorder(store, 42)


_CHILD = r"""
import sys, time
from agents.protocol import TimelineEvent
from core.sessions.recording import RunRecorder
from core.sessions.store import SessionStore
store = SessionStore(sys.argv[1])
rid = store.create_run(store.create_session("crash"), model="m", mode="sequential")
rec = RunRecorder(store, rid)
print(rid, flush=True)
i = 0
while True:
    now = time.time()
    rec.on_event(TimelineEvent(device="a", stage=0, kind="compute", phase="decode", step=i, micro_batch=0,
                               start_s=now, end_s=now))
    if i % 10 == 0:
        print(i, now, flush=True)  # "event i (stamped now) was handed to the recorder"
        time.sleep(0.002)
    i += 1
"""


def test_kill_9_during_a_run_loses_at_most_the_last_second_and_never_corrupts_the_file(tmp_path):
    path = tmp_path / "ws.sqlite"
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(path)], stdout=subprocess.PIPE, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        rid = int(proc.stdout.readline())
        # 500 events handed over first (a child starved by a loaded host gets there later, not never),
        # then 1.5 s more: those 500 are older than a second at the kill whatever the host's speed
        early = []
        while not early or early[-1][0] < 500:
            line = proc.stdout.readline()
            assert line, "the child ended before recording 500 events"
            early.append(tuple(map(float, line.split())))
        time.sleep(1.5)
        killed_at = time.time()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        # a line the kill cut short (its stamp not written) is no report: only whole lines count
        rest = proc.stdout.read().decode().split("\n")[:-1]
        reported = early + [tuple(map(float, line.split())) for line in rest]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    # The newest event the child handed over at least a second before the kill must be stored
    # (measured on the child's own stamps, so a child starved by a busy machine is not "loss").
    due = max(int(i) for i, stamp in reported if stamp <= killed_at - 1.0)
    with SessionStore(path) as store:
        assert store.integrity_check() == "ok"
        events = store.events(rid)
        assert len(events) > 500, "the child recorded 500 events, then went on for 1.5 s"
        assert [e.step for e in events] == list(range(len(events))), "a prefix, without gaps"
        assert len(events) > due, f"lost events older than 1 s (stored {len(events)}, needed > {due})"
        store.append_event(rid, len(events), 0.0, _ev(0))  # the file is writable again
        store.flush()
        assert len(store.events(rid)) == len(events) + 1


def test_a_session_exported_to_one_file_imports_into_another_workspace_identically(tmp_path):
    p = make_problem({"a": 0.01, "b": 0.02}, generated_tokens=6)
    plan = make_plan(p, ["a", "b"], [4], m=1, k=2)
    res = simulate(p, plan, "no-bubbles")
    with SessionStore(tmp_path / "here.sqlite") as here:
        here.create_session("other stuff")
        sid = here.create_session("demo")
        here.add_devices(sid, p.profile.cluster.devices)
        rid = record_simulation(here, sid, p, plan, res)
        here.append_log(rid, "a", 0.1, "warning", "slow link")
        out = here.export_session(sid, tmp_path / "out" / "demo.edgeshard-session")
        src_timeline, src_run = here.timeline(rid), here.run(rid)
        with pytest.raises(StoreError, match="already exists"):
            here.export_session(sid, out)
    assert os.listdir(tmp_path / "out") == ["demo.edgeshard-session"], "a single file"
    with SessionStore(tmp_path / "there.sqlite") as there:
        there.create_session("pre-existing")
        new_sid = there.import_session(out)
        (run,) = there.runs(new_sid)
        assert there.timeline(run.id) == src_timeline
        assert (run.figures, run.mode, run.kind) == (src_run.figures, src_run.mode, src_run.kind)
        assert there.plan(run.plan_id) == plan and there.problem_of(run.id) == p
        assert there.devices(new_sid) == list(p.profile.cluster.devices)
        assert there.logs(run.id)[0].line == "slow link"
        with pytest.raises(StoreError, match="already in the workspace"):
            there.import_session(out)


def test_a_session_file_from_a_newer_program_is_refused_on_import(tmp_path):
    with SessionStore(tmp_path / "a.sqlite") as a:
        sid = a.create_session("x")
        out = a.export_session(sid, tmp_path / "x.session")
    with sqlite3.connect(out) as conn:
        conn.execute("INSERT INTO schema_version (version, applied_at) VALUES (7, 'future')")
    conn.close()
    with SessionStore(tmp_path / "b.sqlite") as b:
        with pytest.raises(StoreError, match="cannot import.*newer"):
            b.import_session(out)
        assert b.sessions() == []


def _zero_tail(path: Path, pages: int) -> None:
    """A workspace whose last pages were lost to zeros (a crash on a filesystem that
    extends files before it writes them, a bad copy)."""
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.close()
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size - pages * 4096)
        f.write(b"\0" * pages * 4096)


def _workspace_with_sessions(path: Path) -> None:
    with SessionStore(path) as store:
        for i in range(20):
            store.create_session(f"s{i}", "n" * 4000)


def test_a_workspace_with_a_zeroed_tail_is_opened_with_a_warning_naming_the_damage(tmp_path, caplog):
    path = tmp_path / "ws.sqlite"
    _workspace_with_sessions(path)
    _zero_tail(path, 20)
    with caplog.at_level("WARNING", logger="core.sessions.store"), SessionStore(path) as store:
        assert store.damage
    assert "damaged" in caplog.text and str(path) in caplog.text


def test_a_read_that_meets_a_zeroed_page_is_a_store_error_saying_how_to_recover(tmp_path):
    path = tmp_path / "ws.sqlite"
    _workspace_with_sessions(path)
    _zero_tail(path, 20)
    with SessionStore(path) as store, pytest.raises(StoreError, match=r"damaged.*\.recover"):
        store.sessions()


def test_a_sound_workspace_has_no_damage(tmp_path):
    path = tmp_path / "ws.sqlite"
    _workspace_with_sessions(path)
    with SessionStore(path) as store:
        assert store.damage == []


def test_a_recovered_run_records_the_plan_it_started_on_and_the_re_plan_it_finished_on(tmp_path):
    from core.planning.plan import plan_from_boundaries
    from core.sessions.recording import record_run

    started = plan_from_boundaries("tiny", 6, ["a", "b", "c"], [2, 4])
    finished = plan_from_boundaries("tiny", 6, ["a", "b"], [3])
    with record_run(tmp_path / "ws.sqlite", model="tiny", mode="no-bubbles", settings={}, plan=started) as run:
        run.status, run.final_plan = "completed", finished
    with SessionStore(tmp_path / "ws.sqlite") as here:
        info = here.run(run.run_id)
        assert here.plan(info.plan_id) == started and here.plan(info.final_plan_id) == finished
        out = here.export_session(run.session_id, tmp_path / "recovered.edgeshard-session")
    with SessionStore(tmp_path / "other.sqlite") as there:
        there.add_plan(there.create_session("shifts the ids"), started)
        (copied,) = there.runs(there.import_session(out))
        assert there.plan(copied.plan_id) == started and there.plan(copied.final_plan_id) == finished
