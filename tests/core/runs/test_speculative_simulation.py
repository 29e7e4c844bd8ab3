"""The simulator's speculative trips (``core.runs.simulator.simulate_speculative``) against the cost
model's closed form (``core.planning.speculation.predicted_run_s``) and the trip rules a real run follows."""

from __future__ import annotations

import pytest

from core.planning.speculation import DraftFigures, expected_tokens_per_trip, predicted_run_s
from core.runs.simulator import simulate, simulate_speculative
from tests.core.planning.test_speculation import PLAN, _problem

DRAFT = DraftFigures(acceptance_rate=0.75, token_s=1.5e-3)


@pytest.mark.parametrize("k", [2, 5])
def test_a_speculative_simulation_ends_when_the_closed_form_predicts(k):
    problem = _problem(latency_ms=5.0)
    result = simulate_speculative(problem, PLAN, DRAFT, k, generated_tokens=121)
    assert len(result.tokens) == 121
    assert result.tokens[-1].t_s == pytest.approx(predicted_run_s(problem, PLAN, DRAFT, k, 121), rel=0.03)


def test_each_trip_drafts_k_on_the_source_verifies_k_plus_one_everywhere_and_rolls_back_what_it_rejected():
    k, problem = 4, _problem(latency_ms=5.0)
    result = simulate_speculative(problem, PLAN, DRAFT, k, generated_tokens=41)
    drafts = [e for e in result.events if e.kind == "draft"]
    assert {e.device for e in drafts} == {"a"} and all(e.nbytes <= k for e in drafts)
    trips = len({t.t_s for t in result.tokens}) - 1  # a trip's tokens arrive together; [0]: the prefill's
    assert len(drafts) == trips
    assert (len(result.tokens) - 1) / trips == pytest.approx(expected_tokens_per_trip(DRAFT.acceptance_rate, k), rel=0.1)
    rollbacks = [e for e in result.events if e.kind == "rollback"]
    assert rollbacks and {e.device for e in rollbacks} == {"a", "b"}
    assert all(0 < e.nbytes <= k for e in rollbacks)


def test_k_zero_is_plain_sequential_decoding():
    problem = _problem(latency_ms=5.0)
    plain = simulate(problem, PLAN, "sequential", micro_batch_sizes=(1,), generated_tokens=9)
    assert simulate_speculative(problem, PLAN, DRAFT, 0, generated_tokens=9).tokens == plain.tokens


def test_a_draft_on_another_stage_drafts_there_between_a_hop_each_way_and_ends_when_the_closed_form_predicts():
    from dataclasses import replace

    problem, k, far = _problem(latency_ms=5.0), 3, replace(DRAFT, device="b")
    result = simulate_speculative(problem, PLAN, far, k, generated_tokens=61)
    assert result.tokens[-1].t_s == pytest.approx(predicted_run_s(problem, PLAN, far, k, 61), rel=0.03)
    drafts = [e for e in result.events if e.kind == "draft"]
    assert {e.device for e in drafts} == {"b"}
    asks = [e for e in result.events if e.kind == "send" and e.phase == "decode" and e.nbytes < 100]  # token ids
    assert sum(1 for e in asks if (e.device, e.peer) == ("a", "b")) == sum(1 for e in drafts if e.nbytes)
    assert sum(1 for e in asks if (e.device, e.peer) == ("b", "a") and e.nbytes == 8 * k) >= len(drafts) - 1
    plain_source = simulate_speculative(problem, PLAN, DRAFT, k, generated_tokens=61)
    assert result.tokens[-1].t_s > plain_source.tokens[-1].t_s  # same draft cost, two more 5 ms hops a trip
