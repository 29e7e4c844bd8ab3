"""Chrome trace event JSON (documented fields), CSV and JSON-lines exports of a timeline."""

from __future__ import annotations

import csv
import json

import pytest

from core.errors import FormatError
from core.runs.simulator import simulate
from core.sessions.export import (
    CSV_COLUMNS,
    LANES,
    read_events_jsonl,
    write_chrome_trace,
    write_events_csv,
    write_events_jsonl,
)
from tests.core.sessions_problems import make_plan, make_problem


@pytest.fixture(scope="module")
def sim():
    p = make_problem({"a": 0.01, "b": 0.02, "c": 0.005}, generated_tokens=4, bandwidth_mbit_s=5.0)
    return simulate(p, make_plan(p, ["a", "b", "c"], [3, 5], m=1, k=2), "no-bubbles")


def test_chrome_trace_has_the_documented_fields_one_process_per_device_and_one_thread_per_lane(tmp_path, sim):
    path = write_chrome_trace(tmp_path / "t.json", sim.events, sim.tokens, source_device="a",
                              metadata={"mode": "no-bubbles"})
    doc = json.loads(path.read_text())
    # JSON Object Format: traceEvents array, optional displayTimeUnit "ms"|"ns", otherData.
    assert set(doc) == {"traceEvents", "displayTimeUnit", "otherData"}
    assert doc["displayTimeUnit"] in ("ms", "ns") and doc["otherData"] == {"mode": "no-bubbles"}
    evs = doc["traceEvents"]
    for e in evs:
        assert {"name", "ph", "pid", "tid"} <= set(e)
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
    meta = [e for e in evs if e["ph"] == "M"]
    procs = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert sorted(procs.values()) == ["a", "b", "c"] and len(procs) == 3
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert set(threads.values()) <= set(LANES)
    complete = [e for e in evs if e["ph"] == "X"]
    assert len(complete) == len(sim.events)
    for e in complete:
        assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)) and e["dur"] >= 0
        assert threads[(e["pid"], e["tid"])] == e["cat"].split(",")[0], "each lane holds one kind"
        assert (e["pid"], e["tid"]) in threads
    by_device = {d: pid for pid, d in procs.items()}
    total_us = sum(e["dur"] for e in complete if e["pid"] == by_device["b"] and e["cat"].startswith("compute"))
    total_s = sum(e.duration_s for e in sim.events if e.device == "b" and e.kind == "compute")
    assert total_us == pytest.approx(total_s * 1e6, rel=1e-6), "ts/dur are microseconds"
    instants = [e for e in evs if e["ph"] == "i"]
    assert len(instants) == len(sim.tokens)
    assert all(e["s"] in ("g", "p", "t") and e["pid"] == by_device["a"] for e in instants)


def test_events_csv_has_one_row_per_event_with_exact_times(tmp_path, sim):
    path = write_events_csv(tmp_path / "e.csv", sim.events)
    rows = list(csv.DictReader(path.open()))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert len(rows) == len(sim.events)
    for row, ev in zip(rows, sim.events):
        assert (row["device"], row["kind"], int(row["step"])) == (ev.device, ev.kind, ev.step)
        assert float(row["start_s"]) == ev.start_s and float(row["end_s"]) == ev.end_s


def test_events_jsonl_is_versioned_and_round_trips(tmp_path, sim):
    path = write_events_jsonl(tmp_path / "e.jsonl", sim.events)
    assert json.loads(path.read_text().splitlines()[0]) == {"format": "edgeshard.events", "version": 1}
    assert read_events_jsonl(path) == list(sim.events)


def test_a_bad_events_file_is_a_format_error_naming_the_line(tmp_path, sim):
    path = write_events_jsonl(tmp_path / "e.jsonl", sim.events[:2])
    path.write_text(path.read_text() + '{"device": "a", "stage": "zero"}\n')
    with pytest.raises(FormatError, match="line 4"):
        read_events_jsonl(path)
    (tmp_path / "plain.jsonl").write_text('{"device": "a"}\n')
    with pytest.raises(FormatError, match="edgeshard.events"):
        read_events_jsonl(tmp_path / "plain.jsonl")
