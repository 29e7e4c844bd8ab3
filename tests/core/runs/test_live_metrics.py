"""LiveMetrics keeps the O(events) figures up to date per event and still equals
compute_figures exactly, at every point of a run (what the live view and a replay show)."""

from __future__ import annotations

import random

import pytest

from agents.protocol import TimelineEvent
from core.planning.plan import plan_from_boundaries
from core.runs.metrics import LiveMetrics, compute_figures
from core.runs.simulator import simulate
from tests.gui.problems import make_problem


def _arrivals():
    problem = make_problem()
    plan = plan_from_boundaries("tiny-llama", 10, ["phone", "laptop", "server"], [2, 6], micro_batches=3)
    result = simulate(problem, plan, "no-bubbles", micro_batches=3, micro_batch_size=1, generated_tokens=8)
    items = [(e.end_s, 0, e) for e in result.events] + [(t.t_s, 1, t) for t in result.tokens]
    return [item for _, _, item in sorted(items, key=lambda x: (x[0], x[1]))]


def test_live_figures_equal_compute_figures_after_every_arrival():
    live = LiveMetrics()
    for item in _arrivals():
        if isinstance(item, TimelineEvent):
            live.add_event(item)
        else:
            live.add_tokens(item)
        assert live.figures() == compute_figures(live.events, live.tokens)


def test_out_of_order_and_negative_start_events_still_agree():
    items = _arrivals()
    random.Random(4).shuffle(items)
    early = TimelineEvent(device="phone", stage=0, kind="compute", phase="prefill", step=0, micro_batch=0,
                          start_s=-0.002, end_s=0.001)
    live = LiveMetrics()
    live.add_event(early)
    for item in items:
        if isinstance(item, TimelineEvent):
            live.add_event(item)
        else:
            live.add_tokens(item)
    assert live.figures() == compute_figures(live.events, live.tokens)
    assert LiveMetrics().figures() == compute_figures([], [])


def test_link_traffic_sums_each_links_sends_and_divides_decode_bytes_by_decode_tokens():
    from core.planning.cost import link_bytes_per_token
    from core.runs.metrics import link_traffic

    problem = make_problem()
    plan = plan_from_boundaries("tiny-llama", 10, ["phone", "laptop", "server"], [2, 6], micro_batches=3)
    result = simulate(problem, plan, "no-bubbles", micro_batches=3, micro_batch_size=1, generated_tokens=8)
    traffic = link_traffic(result.events, result.tokens)
    assert set(traffic) == {("phone", "laptop"), ("laptop", "server"), ("server", "phone")}
    sends = [e for e in result.events if e.kind == "send" and (e.device, e.peer) == ("phone", "laptop")]
    assert traffic[("phone", "laptop")].total_bytes == sum(e.nbytes for e in sends)
    # the simulator moves exactly what the cost model predicts per generated token of one sequence
    predicted = link_bytes_per_token(problem, plan)
    assert {link: t.bytes_per_token for link, t in traffic.items()} == pytest.approx(predicted)
    assert link_traffic(result.events, []) [("phone", "laptop")].bytes_per_token is None  # no decode token yet


def test_tokens_placed_before_the_runs_start_count_in_the_first_window():
    """An agent's clock estimate can place a token before the run's start under heavy load (CI
    saw it): the Run screen's tokens/s plot must still draw, every token counted once."""
    from agents.protocol import TokenEvent
    from core.runs.metrics import tokens_per_s_over_time

    def token(t_s, n=1):
        return TokenEvent(micro_batch=0, step=0, sequence_ids=tuple(range(n)), token_ids=(7,) * n, t_s=t_s)

    assert tokens_per_s_over_time([token(-0.3), token(-0.1, 2)], 0.5) == [(0.0, 6.0)]
    assert tokens_per_s_over_time([token(-2.0), token(0.2), token(1.2, 3)], 1.0) == [(0.0, 2.0), (1.0, 3.0)]


def test_a_token_an_agents_clock_estimate_places_before_the_runs_start_is_at_the_start():
    """No token precedes its run's start (the coordinator started the run before any agent could
    answer), but an offset estimate is off by up to its uncertainty, which a loaded host's round
    trips make larger than a tiny model's first token: CI saw every token of a run placed before
    its start. The run keeps such a token at its start, so TTFT is never negative."""
    from agents.protocol import TokensProduced
    from core.devices.clock_sync import ClockEstimate
    from core.runs import run_state
    from core.runs.metrics import compute_figures
    from core.runs.run_stream import ActiveRun, NullSink

    run = ActiveRun(run_id="r", t0=100.0, stages={"head": 0}, sink=NullSink(),
                    state=run_state.begin("r", ("head",), load=False))
    # same clocks; the estimate says the agent is 10 ms ahead (+-10 ms): its token 4 ms after the
    # start maps to 6 ms before it, the next one (14 ms after) to 4 ms after
    ahead = ClockEstimate(offset_s=0.010, uncertainty_s=0.010, rtt_s=0.020)
    for step, t in enumerate((100.004, 100.014)):
        run.take_in("head", TokensProduced(run_id="r", micro_batch=0, step=step, sequence_ids=(0,), token_ids=(7,),
                                           t=t), lambda _device: ahead)
    assert [t.t_s for t in run.tokens] == pytest.approx([0.0, 0.004])
    assert compute_figures([], run.tokens).ttft_s == 0.0
