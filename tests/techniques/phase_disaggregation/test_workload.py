"""Workloads: seeded Poisson arrivals, trace files checked line by line, the same requests at another rate."""

from __future__ import annotations

import pytest

from core.errors import FormatError
from core.techniques.phase_disaggregation.types import EpdInputError
from core.techniques.phase_disaggregation.workload import at_rate, load_trace, mean_rate_rps, poisson_workload


def test_same_seed_gives_the_same_workload_and_another_seed_another():
    a = poisson_workload(rate_rps=2.0, requests=50, seed=7, images=(1, 4))
    assert a == poisson_workload(rate_rps=2.0, requests=50, seed=7, images=(1, 4))
    assert a != poisson_workload(rate_rps=2.0, requests=50, seed=8, images=(1, 4))


def test_poisson_arrivals_come_at_about_the_rate():
    w = poisson_workload(rate_rps=5.0, requests=2000, seed=1)
    assert (len(w.requests) - 1) / w.duration_s == pytest.approx(5.0, rel=0.1)


def test_drawn_sizes_stay_in_their_ranges():
    w = poisson_workload(rate_rps=1.0, requests=200, seed=2, images=(0, 3), tiles_per_image=(2, 5))
    assert {r.images for r in w.requests} == {0, 1, 2, 3}
    assert all(2 <= r.tiles_per_image <= 5 for r in w.requests)


def test_an_inverted_range_is_refused():
    with pytest.raises(EpdInputError, match="output_tokens"):
        poisson_workload(rate_rps=1.0, requests=5, seed=0, output_tokens=(8, 4))


def test_at_rate_keeps_the_requests_and_scales_their_arrivals():
    w = poisson_workload(rate_rps=2.0, requests=20, seed=3, images=(1, 3))
    fast = at_rate(w, 4.0)
    assert [r.images for r in fast.requests] == [r.images for r in w.requests]
    assert fast.requests[-1].arrival_s == pytest.approx(w.requests[-1].arrival_s / 2)
    assert mean_rate_rps(fast) == 4.0


def test_trace_file_loads_sorted_from_time_zero(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("arrival_s,images,tiles_per_image,prompt_tokens,output_tokens\n"
                 "12.5,1,4,30,10\n10.0,2,1,20,5\n")
    w = load_trace(p)
    assert w.source == "trace" and w.trace == str(p)
    assert [(r.arrival_s, r.images) for r in w.requests] == [(0.0, 2), (2.5, 1)]


def test_trace_with_a_bad_cell_names_its_line(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("arrival_s,images,tiles_per_image,prompt_tokens,output_tokens\n0,1,4,30,10\n1,x,4,30,10\n")
    with pytest.raises(FormatError, match="line 3"):
        load_trace(p)


def test_trace_without_a_column_says_which(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("arrival_s,images,prompt_tokens,output_tokens\n0,1,30,10\n")
    with pytest.raises(FormatError, match="tiles_per_image"):
        load_trace(p)


def test_trace_with_zero_output_tokens_is_refused_with_its_line(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("arrival_s,images,tiles_per_image,prompt_tokens,output_tokens\n0,1,4,30,0\n")
    with pytest.raises(FormatError, match="line 2.*output_tokens"):
        load_trace(p)
