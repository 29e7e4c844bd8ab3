"""The simulator agrees with core.planning.cost's closed forms where they apply and shows what they miss."""

from __future__ import annotations

import pytest

from agents.protocol import TimelineEvent, TokenEvent
from core.planning import cost
from core.errors import PlanInvalid
from core.planning.plan import ShardPlan, Stage
from core.runs.simulator import simulate
from tests.core.sessions_problems import make_plan, make_problem

HETERO = {"a": 0.010, "b": 0.020, "c": 0.005}


def _problem(**kw):
    return make_problem(HETERO, **kw)


@pytest.mark.parametrize("batch", [1, 4])
def test_sequential_latency_and_ttft_equal_the_closed_form_step_times(batch):
    p = _problem(batch_size=batch, generated_tokens=6)
    plan = make_plan(p, ["a", "b", "c"], [3, 5])
    res = simulate(p, plan, "sequential")
    assert res.figures.per_token_latency_s == pytest.approx(cost.step_time_s(p, plan, "decode", batch), rel=1e-12)
    assert res.figures.ttft_s == pytest.approx(cost.step_time_s(p, plan, "prefill", batch), rel=1e-12)
    assert res.figures.tokens == batch * 6


def test_sequential_throughput_equals_the_closed_form_with_one_micro_batch():
    p = _problem(generated_tokens=10)
    plan = make_plan(p, ["a", "b", "c"], [3, 5])
    res = simulate(p, plan, "sequential")
    assert res.figures.decode_tokens_per_s == pytest.approx(cost.throughput_tokens_s(p, plan, 1, 1)[0], rel=1e-9)


@pytest.mark.parametrize(
    "k, bandwidth, why",
    [(3, 100.0, "compute bound: K·B > L"), (1, 100.0, "cycle bound: L > K·B"), (4, 0.5, "link bound: occupancy is B")],
)
def test_no_bubbles_steady_state_throughput_equals_the_closed_form(k, bandwidth, why):
    p = _problem(generated_tokens=40, bandwidth_mbit_s=bandwidth)
    plan = make_plan(p, ["a", "b", "c"], [3, 5], m=2, k=k)
    res = simulate(p, plan, "no-bubbles")
    expected, *_ = cost.throughput_tokens_s(p, plan, 2, k)
    assert res.steady_tokens_per_s == pytest.approx(expected, rel=1e-9), why


@pytest.mark.parametrize("k", [1, 3])
def test_the_once_per_stage_overhead_moves_simulator_and_closed_forms_alike(k):
    import msgspec

    base = _problem(generated_tokens=40)
    ovh = {"a": 0.004, "b": 0.001, "c": 0.002}
    times = tuple(msgspec.structs.replace(t, stage_decode_overhead_s=ovh[t.device],
                                          stage_prefill_overhead_s=2 * ovh[t.device]) for t in base.profile.times)
    p = msgspec.structs.replace(base, profile=msgspec.structs.replace(base.profile, times=times))
    plan = make_plan(p, ["a", "b", "c"], [3, 5], m=1, k=k)
    seq = simulate(p, plan, "sequential")
    # every stage holds decoder blocks: one overhead per stage and step, not one per block
    assert cost.step_time_s(p, plan, "decode", 1) == pytest.approx(cost.step_time_s(base, plan, "decode", 1) + 0.007)
    assert cost.step_time_s(p, plan, "prefill", 1) == pytest.approx(cost.step_time_s(base, plan, "prefill", 1) + 0.014)
    assert seq.figures.per_token_latency_s == pytest.approx(cost.step_time_s(p, plan, "decode", 1), rel=1e-12)
    assert seq.figures.ttft_s == pytest.approx(cost.step_time_s(p, plan, "prefill", 1), rel=1e-12)
    pipe = simulate(p, plan, "no-bubbles")
    assert pipe.steady_tokens_per_s == pytest.approx(cost.throughput_tokens_s(p, plan, 1, k)[0], rel=1e-9)
    computes = {e.stage: e.duration_s for e in pipe.events if e.kind == "compute" and e.phase == "decode"}
    assert computes[0] == pytest.approx(HETERO["a"] * 3 + 0.004)


def test_single_device_plan_runs_without_transfers():
    p = _problem(generated_tokens=5)
    plan = ShardPlan(model=p.profile.model.name, num_units=8, stages=(Stage(device="a", start=0, end=8),))
    res = simulate(p, plan, "sequential")
    assert {e.kind for e in res.events} == {"compute"}
    assert res.figures.per_token_latency_s == pytest.approx(cost.step_time_s(p, plan, "decode", 1))


def test_bubbles_cost_a_round_of_pipeline_fill_per_step_which_the_closed_form_misses():
    # Homogeneous stages, negligible links: GPipe's bubble, a round of K micro-batches
    # through k stages takes (k + K - 1)·C instead of K·C.
    p = make_problem({"a": 0.01, "b": 0.01, "c": 0.01, "d": 0.01}, blocks=6, bandwidth_mbit_s=1e12,
                     latency_ms=0.0, generated_tokens=20)
    plan = make_plan(p, ["a", "b", "c", "d"], [2, 4, 6], m=1, k=3)
    c = 0.02  # two units per stage
    bubbles = simulate(p, plan, "bubbles")
    no_bubbles = simulate(p, plan, "no-bubbles")
    assert bubbles.steady_tokens_per_s == pytest.approx(3 / ((4 + 3 - 1) * c), rel=1e-6)
    closed, *_ = cost.throughput_tokens_s(p, plan, 1, 3)
    assert no_bubbles.steady_tokens_per_s == pytest.approx(closed, rel=1e-6)
    # here the no-bubbles pipeline is cycle bound (L = 4·C > K·C): 3 tokens per 4·C
    assert bubbles.steady_tokens_per_s / closed == pytest.approx(4 / 6, rel=1e-6)


def test_link_contention_delays_a_decode_transfer_behind_another_micro_batch_prefill():
    # Slow a→b link: micro-batch 1's prompt-sized prefill transfer holds the link while
    # micro-batch 0's first decode activation waits behind it.
    p = make_problem({"a": 0.001, "b": 0.001}, blocks=2, bandwidth_mbit_s=2.0, latency_ms=1.0,
                     prompt_tokens=64, generated_tokens=4)
    plan = make_plan(p, ["a", "b"], [2], m=1, k=2)
    contended = simulate(p, plan, "no-bubbles")
    alone = simulate(p, plan, "no-bubbles", micro_batches=1)
    assert alone.link_wait_s == 0.0
    assert contended.link_wait_s > 0.1
    mb0 = {t.step: t.t_s for t in contended.tokens if t.micro_batch == 0}
    closed_step = cost.step_time_s(p, plan, "decode", 1)
    assert mb0[1] - mb0[0] > 2 * closed_step  # the closed form sees a free link
    assert alone.figures.per_token_latency_s == pytest.approx(closed_step, rel=1e-9)


def test_without_overlap_a_stage_waits_for_its_send_and_throughput_drops_to_compute_plus_transfer():
    p = _problem(generated_tokens=40, bandwidth_mbit_s=1.0)
    plan = make_plan(p, ["a", "b", "c"], [3, 5], m=2, k=4)
    res = simulate(p, plan, "no-bubbles", overlap=False)
    _, _, comp, _ = cost.throughput_tokens_s(p, plan, 2, 4)
    occ = [cost.link_occupancy_s(p, st.device, cost.next_device(plan, j), cost.stage_output_bytes(p, st, 2))
           for j, st in enumerate(plan.stages)]
    cycle = cost.step_time_s(p, plan, "decode", 2)
    expected = 4 * 2 / max(4 * max(c + o for c, o in zip(comp, occ)), cycle)
    assert res.steady_tokens_per_s == pytest.approx(expected, rel=1e-9)
    assert res.steady_tokens_per_s < simulate(p, plan, "no-bubbles").steady_tokens_per_s


@pytest.mark.parametrize("mode", ["sequential", "bubbles", "no-bubbles"])
def test_events_have_the_shape_of_a_real_run(mode):
    p = _problem(generated_tokens=5, bandwidth_mbit_s=5.0)
    plan = make_plan(p, ["a", "b", "c"], [3, 5], m=1, k=3)
    res = simulate(p, plan, mode, micro_batches=3)
    assert all(isinstance(e, TimelineEvent) for e in res.events)
    assert all(isinstance(t, TokenEvent) for t in res.tokens)
    assert {e.kind for e in res.events} <= {"compute", "send", "recv_wait"}
    for j, st in enumerate(plan.stages):
        comp = sorted((e for e in res.events if e.stage == j and e.kind == "compute"), key=lambda e: e.start_s)
        assert len(comp) == 3 * 5  # every micro-batch, every step
        assert all(e.device == st.device for e in comp)
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(comp, comp[1:])), "one compute at a time"
        sends = sorted((e for e in res.events if e.stage == j and e.kind == "send"), key=lambda e: e.start_s)
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(sends, sends[1:])), "one transfer per link"
        assert {e.peer for e in sends} == {cost.next_device(plan, j)}
        assert all(e.nbytes > 0 for e in sends)
    assert {(e.phase, e.step == 0) for e in res.events} == {("prefill", True), ("decode", False)}
    assert sorted((t.micro_batch, t.step) for t in res.tokens) == [(mb, s) for mb in range(3) for s in range(5)]
    assert [e.end_s for e in res.events] == sorted(e.end_s for e in res.events)


def test_a_plan_with_a_broken_shape_is_refused_with_every_violation():
    p = _problem()
    plan = make_plan(p, ["b", "a"], [4])
    with pytest.raises(PlanInvalid) as err:
        simulate(p, plan, "sequential")
    assert "source" in str(err.value)


def test_an_unknown_mode_is_refused():
    p = _problem()
    with pytest.raises(ValueError, match="no-bubbles"):
        simulate(p, make_plan(p, ["a", "b"], [4]), "zigzag")


def test_stages_emulated_on_one_host_share_its_cores():
    # Four equal stages on a 2-core host, negligible links: every stage busy at once
    # progresses at half speed, so the pipeline delivers 2 cores' worth: 2 / ΣC tokens/s.
    p = make_problem({"a": 0.01, "b": 0.01, "c": 0.01, "d": 0.01}, blocks=6, bandwidth_mbit_s=1e12,
                     latency_ms=0.0, generated_tokens=40)
    plan = make_plan(p, ["a", "b", "c", "d"], [2, 4, 6], m=1, k=8)
    total_c = 4 * 0.02
    shared = simulate(p, plan, "no-bubbles", host_cores=2)
    assert shared.steady_tokens_per_s == pytest.approx(2 / total_c, rel=1e-6)
    assert simulate(p, plan, "no-bubbles", host_cores=4).steady_tokens_per_s == pytest.approx(
        simulate(p, plan, "no-bubbles").steady_tokens_per_s, rel=1e-9)
    # one compute at a time: sharing changes nothing
    seq = simulate(p, plan, "sequential")
    assert simulate(p, plan, "sequential", host_cores=1).events == seq.events
    busy = sorted((e for e in shared.events if e.kind == "compute" and e.phase == "decode"), key=lambda e: e.start_s)
    assert max(e.duration_s for e in busy) == pytest.approx(2 * 0.02, rel=1e-6), "half speed when all four run"


def test_shared_cores_finish_every_step_of_a_bubbled_pipeline_of_three_stages():
    # A stale completion of a stage's previous job once matched its next job's version and
    # finished that job as the old step: 3 stages, bubbles, K >= 3 on 2 cores never ended.
    p = make_problem({"a": 0.01, "b": 0.013, "c": 0.007}, blocks=6, bandwidth_mbit_s=20, latency_ms=4.0,
                     generated_tokens=24)
    plan = make_plan(p, ["a", "b", "c"], [2, 4], m=1, k=4)
    for k in (3, 4):
        sim = simulate(p, plan, "bubbles", micro_batches=k, micro_batch_size=1, host_cores=2)
        assert sorted((t.micro_batch, t.step) for t in sim.tokens) == [(mb, s) for mb in range(k) for s in range(24)]
