"""Attention offloading's calibration and shared-host simulation (pure): ``components`` reads the
cost model's terms back from a timeline, ``calibrate`` fits them, ``simulate(host_cores=)`` shares cores."""

from __future__ import annotations

import pytest

from agents.protocol import TimelineEvent
from core.techniques.attention_offload.calibration import calibrate, components
from core.techniques.attention_offload.cost import attention_seconds_by_device, dense_seconds, head_seconds
from core.techniques.attention_offload.problem import OffloadDevice, OffloadModel, OffloadPlan, OffloadProblem, OffloadWorkload
from core.techniques.attention_offload.simulator import simulate

MODEL = OffloadModel(name="t", layers=4, hidden=256, q_heads=8, kv_heads=2, head_dim=32, intermediate=512, vocab=512,
                     bytes_per_element=4)


def _problem(memory: int = 2, frame_s: float = 1e-4, latency_s: float = 0.0) -> OffloadProblem:
    compute = [OffloadDevice(id=f"c{i}", flops=2e9, memory_bandwidth=1e10, memory_bytes=1 << 30, link_bandwidth=1e15,
                             link_latency_s=latency_s, frame_s=frame_s, step_overhead_s=5e-4) for i in range(2)]
    mem = [OffloadDevice(id=f"m{i}", flops=1e12, memory_bandwidth=2e8, memory_bytes=1 << 30, link_bandwidth=1e15,
                         link_latency_s=latency_s, frame_s=frame_s) for i in range(memory)]
    return OffloadProblem(devices=tuple(compute + mem), model=MODEL,
                          workload=OffloadWorkload(prompt_tokens=12, generated_tokens=16))


ONE = OffloadPlan(compute=("c0",), memory=("m0", "m1"), batch=3, in_flight=1)


def _ev(device, step, start, end, kind="compute", peer=""):
    return TimelineEvent(device=device, stage=0, kind=kind, phase="decode", step=step, micro_batch=0,
                         start_s=start, end_s=end, peer=peer)


def test_a_one_replica_run_s_last_segment_gap_and_first_segment_are_the_step_s_boundary_slice():
    # 2 layers: per step 3 segments on the dense agent (before each attention, after the last)
    events = []
    for step, t in ((1, 0.0), (2, 10.0), (3, 20.0)):
        events += [_ev("c", step, t, t + 1), _ev("c", step, t + 3, t + 4), _ev("c", step, t + 6, t + 8),
                   _ev("m", step, t + 1.5, t + 2), _ev("m", step, t + 4.5, t + 5)]
    got = components(events, ["c"], ["m"], layers=2, warm=1)
    assert got["dense_slice"] == 1.0  # step 1's second segment
    assert got["boundary_slice"] == 5.0  # step 1's last (6..8), the gap (8..10) and step 2's first (10..11)
    assert got["to_attention"] == 0.5 and got["attention"] == 0.5
    assert got["step_period"] == 10.0  # boundary to boundary: 6 -> 16


def test_components_of_a_simulated_run_are_the_cost_model_s_terms():
    p = _problem()
    sim = simulate(p, ONE, generated_tokens=12)
    got = components(sim.events, ["c0"], ["m0", "m1"], MODEL.layers)
    c0, memory = p.device("c0"), [p.device("m0"), p.device("m1")]
    assert got["dense_slice"] == pytest.approx(dense_seconds(p, c0, 3, 2))
    assert got["boundary_slice"] == pytest.approx(dense_seconds(p, c0, 3, 2) + head_seconds(p, c0, 3))
    # the attention at the median decode step's context
    ctx = [p.workload.prompt_tokens + s - 1 for s in range(4, 12)]
    spans = sorted(max(attention_seconds_by_device(p, memory, 3, c)) for c in ctx)
    assert spans[0] <= got["attention"] <= spans[-1]


def test_sharing_the_host_s_cores_stretches_one_replica_by_its_share():
    p = _problem(memory=1)
    plan = OffloadPlan(compute=("c0",), memory=("m0",), batch=3, in_flight=1)
    alone = simulate(p, plan, generated_tokens=10).decode_tokens_per_s
    # one job computes at a time: 2 cores over 1 job + 3 others = half a core
    assert simulate(p, plan, generated_tokens=10, host_cores=2, background=3).decode_tokens_per_s == pytest.approx(
        alone / 2, rel=1e-6)
    assert simulate(p, plan, generated_tokens=10, host_cores=2).decode_tokens_per_s == pytest.approx(alone, rel=1e-9)


def test_two_replicas_on_a_shared_host_gain_less_than_on_their_own_devices():
    p = _problem()
    rot = OffloadPlan(compute=("c0", "c1"), memory=("m0", "m1"), batch=3, in_flight=3)
    own = simulate(p, rot, generated_tokens=10).decode_tokens_per_s
    one_own = simulate(p, ONE, generated_tokens=10).decode_tokens_per_s
    shared = simulate(p, rot, generated_tokens=10, host_cores=2, background=2).decode_tokens_per_s
    one_shared = simulate(p, ONE, generated_tokens=10, host_cores=2, background=2).decode_tokens_per_s
    assert shared < own
    assert shared / one_shared < own / one_own


def test_calibrating_on_a_shared_host_gives_back_the_simulated_throughput():
    # a "profiling run": the simulator's own, on 2 cores with 4 other runnable processes (a job alone
    # gets 2 / 5 of a core); calibrated with that share, the problem predicts the same decode rate
    p = _problem(frame_s=2e-4)
    profile = simulate(p, ONE, generated_tokens=16, host_cores=2, background=4)
    cal = calibrate(MODEL, [profile.events], compute=["c0", "c1"], memory=["m0", "m1"], batch=3, prompt_tokens=12,
                    generated_tokens=16, warm=2, host_cores=2, host_share=0.4)
    assert cal.figures["background"] == pytest.approx(4.0)
    again = simulate(cal.problem, ONE, generated_tokens=16, host_cores=2, background=cal.figures["background"])
    assert again.decode_tokens_per_s == pytest.approx(profile.decode_tokens_per_s, rel=0.03)


def test_calibrating_on_independent_devices_charges_the_round_trip_to_the_frames():
    p = _problem(frame_s=0.0, latency_s=1e-3)
    profile = simulate(p, ONE, generated_tokens=16)
    cal = calibrate(MODEL, [profile.events], compute=["c0"], memory=["m0", "m1"], batch=3, prompt_tokens=12,
                    generated_tokens=16, warm=2)
    assert cal.problem.device("c0").link_latency_s == 0.0
    # the round trip beyond the attention (4 latencies of 1 ms) is charged to the frames: 2·m on the
    # compute side, 2 on a memory device
    assert 2 * 2 * cal.figures["frame_compute"] + 2 * cal.figures["frame_memory"] == pytest.approx(4e-3, rel=1e-6)
    again = simulate(cal.problem, ONE, generated_tokens=16)
    assert again.decode_tokens_per_s == pytest.approx(profile.decode_tokens_per_s, rel=0.03)


def test_calibrating_without_a_decode_step_or_with_a_bad_share_is_refused():
    with pytest.raises(ValueError, match="at least one profiling run"):
        calibrate(MODEL, [], compute=["c0"], memory=["m0"], batch=3, prompt_tokens=12, generated_tokens=16)
    short = simulate(_problem(), ONE, generated_tokens=3).events
    with pytest.raises(ValueError, match="no decode step past warm-up"):
        calibrate(MODEL, [short], compute=["c0"], memory=["m0", "m1"], batch=3, prompt_tokens=12, generated_tokens=3,
                  warm=3)
    with pytest.raises(ValueError, match="share of a core"):
        calibrate(MODEL, [short], compute=["c0"], memory=["m0", "m1"], batch=3, prompt_tokens=12, generated_tokens=3,
                  host_cores=2, host_share=0.0)


def test_a_device_s_simulated_core_share_is_its_work_over_its_busy_time():
    p = _problem()
    alone = simulate(p, ONE, generated_tokens=10)
    assert alone.core_share("c0") == pytest.approx(1.0)
    shared = simulate(p, ONE, generated_tokens=10, host_cores=2, background=3)
    assert shared.work_s["c0"] == pytest.approx(alone.work_s["c0"])
    assert shared.core_share("c0") == pytest.approx(0.5)  # alone among 3 others on 2 cores


def test_the_background_is_found_back_from_a_reported_core_share():
    from core.techniques.attention_offload.calibration import background_for_share

    p = _problem()
    rot = OffloadPlan(compute=("c0", "c1"), memory=("m0", "m1"), batch=3, in_flight=3)
    share = simulate(p, rot, generated_tokens=10, host_cores=2, background=3.0).core_share("c0")
    assert background_for_share(p, rot, share, device="c0", host_cores=2, generated_tokens=10) == pytest.approx(
        3.0, abs=0.05)
    # a share the run's own agents already take away without any background: none
    assert background_for_share(p, rot, 1.0, device="c0", host_cores=2, generated_tokens=10) == 0.0
