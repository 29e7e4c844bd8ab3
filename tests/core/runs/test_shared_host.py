"""core.runs.shared_host.SharedCores: processor sharing of a host's cores (pure)."""

from __future__ import annotations

import heapq

import pytest

from core.runs.shared_host import SharedCores


def _finish_all(cores: float, jobs: dict[str, tuple[float, float]], background: float = 0.0) -> dict[str, float]:
    """Start each job (key -> (start, work)), run the completions in time order: key -> end."""
    heap: list = []
    host = SharedCores(cores, lambda t, key, v: heapq.heappush(heap, (t, 1, key, v)), background)
    for key, (start, work) in jobs.items():
        heapq.heappush(heap, (start, 0, key, work))
    ends = {}
    while heap:
        t, kind, key, x = heapq.heappop(heap)
        if kind == 0:
            host.start(key, x, t)
        elif host.finish(key, x, t) is not None:
            ends[key] = t
    return ends


def test_two_jobs_on_one_core_each_take_twice_their_work():
    assert _finish_all(1, {"a": (0.0, 1.0), "b": (0.0, 1.0)}) == pytest.approx({"a": 2.0, "b": 2.0})


def test_jobs_within_the_cores_run_at_full_speed():
    assert _finish_all(2, {"a": (0.0, 1.0), "b": (0.0, 3.0)}) == pytest.approx({"a": 1.0, "b": 3.0})


def test_background_processes_slow_a_job_alone():
    # one core, one other runnable process: half a core
    assert _finish_all(1, {"a": (0.0, 1.0)}, background=1.0) == pytest.approx({"a": 2.0})


def test_a_job_speeds_up_when_another_finishes():
    # both at 1/2 until a is done at 1.0 (0.5 of work each), then b alone does its last 1.5
    assert _finish_all(1, {"a": (0.0, 0.5), "b": (0.0, 2.0)}) == pytest.approx({"a": 1.0, "b": 2.5})


def test_rate_is_the_cores_over_the_jobs_and_background_at_most_one():
    host = SharedCores(2, lambda *a: None, background=2.0)
    assert host.rate(1) == 1.0 * 2 / 3
    assert host.rate(2) == 0.5
    assert SharedCores(4, lambda *a: None).rate(3) == 1.0


def test_bad_cores_or_background_are_refused():
    with pytest.raises(ValueError, match="cores"):
        SharedCores(0, lambda *a: None)
    with pytest.raises(ValueError, match="background"):
        SharedCores(2, lambda *a: None, background=-1)
