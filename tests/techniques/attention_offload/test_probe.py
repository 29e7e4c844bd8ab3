"""A memory agent's attention measured by a probe run (pure): ``fit_devices`` reads each memory
agent's per-frame cost off a run's events, so the cost model's attention term gives back what the
agent measured; a simulated probe's own frame cost is found back."""

from __future__ import annotations

import statistics

import msgspec
import pytest

from agents.protocol import TimelineEvent
from core.techniques.attention_offload.cost import attention_seconds_by_device
from core.techniques.attention_offload.probe import QUANTILE, fit_devices, probe_request, quantile
from core.techniques.attention_offload.problem import OffloadDevice, OffloadModel, OffloadPlan, OffloadProblem, OffloadWorkload
from core.techniques.attention_offload.simulator import simulate

MODEL = OffloadModel(name="t", layers=4, hidden=128, q_heads=4, kv_heads=2, head_dim=32, intermediate=384, vocab=512,
                     bytes_per_element=4)


def _problem(frame_s: float = 0.0) -> OffloadProblem:
    def device(name, flops, bandwidth, frame=0.0):
        return OffloadDevice(id=name, flops=flops, memory_bandwidth=bandwidth, memory_bytes=1 << 30,
                             link_bandwidth=1e9, frame_s=frame)

    return OffloadProblem(devices=(device("c", 5e8, 1e8), device("m0", 4e8, 8e8, frame_s), device("m1", 3e8, 5e8, frame_s)),
                          model=MODEL, workload=OffloadWorkload(prompt_tokens=8, generated_tokens=6))


def _attention(device: str, step: int, layer: int, span: float) -> TimelineEvent:
    start = step + layer * 0.01
    return TimelineEvent(device=device, stage=layer, kind="compute", phase="decode" if step else "prefill",
                         step=step, micro_batch=0, start_s=start, end_s=start + span)


def test_each_memory_agent_s_attention_term_gives_back_its_measured_span():
    spans = {"m0": [4e-4, 5e-4, 6e-4, 3.5e-3], "m1": [7e-4, 8e-4, 9e-4, 5e-3]}  # one preempted span each
    events = [_attention(m, step, layer, spans[m][layer]) for m in spans for step in range(6) for layer in range(4)]
    fit = fit_devices(_problem(), events, memory=["m0", "m1"], batch=2, prompt_tokens=8)
    context = 8 + statistics.median([2, 3, 4, 5]) - 1
    for m in ("m0", "m1"):
        # independently: numpy's linear rule for the lower quartile of the 16 spans read (steps 2..5)
        read = sorted(spans[m] * 4)
        at = QUANTILE * (len(read) - 1)
        expected = read[int(at)] + (read[int(at) + 1] - read[int(at)]) * (at - int(at))
        assert fit.attention_s[m] == pytest.approx(expected)
        kv = 1 * 2 * context * 2 * MODEL.head_dim * MODEL.bytes_per_element / fit.problem.device(m).memory_bandwidth
        assert fit.problem.device(m).frame_s == pytest.approx((expected - kv) / 2)
    fitted = [fit.problem.device("m0"), fit.problem.device("m1")]
    assert attention_seconds_by_device(fit.problem, fitted, 2, context) == pytest.approx(
        [fit.attention_s["m0"], fit.attention_s["m1"]])
    assert fit.problem.device("c") == _problem().device("c")  # the compute side keeps the profile's figures


def test_a_simulated_probe_s_frame_cost_is_found_back():
    truth = _problem(frame_s=2e-4)
    plan = OffloadPlan(compute=("c",), memory=("m0", "m1"), batch=2, in_flight=1)
    events = simulate(truth, plan, generated_tokens=6).events
    fit = fit_devices(_problem(), events, memory=["m0", "m1"], batch=2, prompt_tokens=8)
    for m in ("m0", "m1"):  # the KV read grows with the context over the steps read: within 2 %
        assert fit.problem.device(m).frame_s == pytest.approx(2e-4, rel=0.02)


def test_a_probe_without_decode_steps_on_a_memory_agent_is_refused_naming_it():
    events = [_attention("m0", step, 0, 1e-3) for step in range(6)]
    with pytest.raises(ValueError, match="m1"):
        fit_devices(_problem(), events, memory=["m0", "m1"], batch=2, prompt_tokens=8)


def test_the_probe_request_is_a_full_batch_of_in_vocabulary_ids_without_eos():
    request = probe_request(512, batch=2, prompt_tokens=8, new_tokens=6)
    assert len(request.input_ids) == 2 and {len(r) for r in request.input_ids} == {8}
    assert all(3 <= t < 512 for r in request.input_ids for t in r) and request.eos_token_ids == ()
    assert request.input_ids[0] != request.input_ids[1] and request.max_new_tokens == 6


def test_quantile_follows_the_linear_rule():
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.25) == pytest.approx(statistics.quantiles([1, 2, 3, 4], n=4,
                                                                                         method="inclusive")[0])
    assert quantile([5.0], 0.25) == 5.0


def test_fitting_changes_nothing_but_the_memory_agents_frame_costs():
    events = [_attention(m, step, 0, 1e-3) for m in ("m0", "m1") for step in range(6)]
    fit = fit_devices(_problem(), events, memory=["m0", "m1"], batch=2, prompt_tokens=8)
    for d, before in zip(fit.problem.devices, _problem().devices):
        assert msgspec.structs.replace(d, frame_s=0.0) == before


def test_a_kept_fit_onto_another_runs_problem_brings_only_the_frame_costs():
    """The studio keeps a probe's fit for later runs of the same profile and roles: those runs have
    their own workload, which the fit must not replace with the probed run's."""
    events = [_attention(m, step, 0, 1e-3 * (1 + i)) for i, m in enumerate(("m0", "m1")) for step in range(6)]
    fit = fit_devices(_problem(), events, memory=["m0"], batch=2, prompt_tokens=8)
    later = msgspec.structs.replace(_problem(), workload=OffloadWorkload(prompt_tokens=20, generated_tokens=40))
    onto = fit.onto(later)
    assert onto.workload == later.workload and onto.model == later.model
    assert onto.device("m0").frame_s == fit.problem.device("m0").frame_s > 0
    assert onto.device("m1") == later.device("m1") and onto.device("c") == later.device("c")
