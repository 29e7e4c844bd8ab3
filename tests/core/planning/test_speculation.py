"""The speculation cost model (``core.planning.speculation``): expected tokens per trip against a
simulation of the acceptance process, a trip's cost from the profile's terms, and the choice of k."""

from __future__ import annotations

import random

import pytest

from core.devices.cluster import Cluster, Device, Link
from core.devices.profile import DeviceTimes, Profile
from core.models.units import ModelSpec, ModelUnit
from core.planning.cost import step_time_s
from core.planning.plan import plan_from_boundaries
from core.planning.problem import PlanningProblem, Workload
from core.planning.speculation import (DraftFigures, choose_draft, choose_k, draft_token_s, expected_tokens_per_trip,
                                       speculative_tokens_s, trip_s, verify_trip_s)


def _problem(latency_ms: float) -> PlanningProblem:
    """Embedding, two blocks, head on devices a and b; ``latency_ms`` per message each way."""
    units = (ModelUnit(index=0, kind="embedding", name="embed", param_bytes=100, activation_bytes_per_token=1000),
             *(ModelUnit(index=i, kind="decoder_block", name=f"block {i}", param_bytes=300,
                         activation_bytes_per_token=1000, kv_bytes_per_token=2) for i in (1, 2)),
             ModelUnit(index=3, kind="head", name="head", param_bytes=200, activation_bytes_per_token=4))
    model = ModelSpec(name="toy", family="llama", dtype="fp32", units=units)
    cluster = Cluster(devices=(Device(id="a", memory_bytes=1 << 30), Device(id="b", memory_bytes=1 << 30)),
                      links=(Link(src="a", dst="b", bandwidth_mbit_s=800.0, latency_ms=latency_ms),
                             Link(src="b", dst="a", bandwidth_mbit_s=800.0, latency_ms=latency_ms)))
    # decode: 1 ms a unit; prefill of 8 tokens: 2 ms a unit
    times = tuple(DeviceTimes(device=d, decode_batch_sizes=(1,), decode_s=((1e-3,),) * 4, prefill_token_counts=(8,),
                              prefill_s=((2e-3,),) * 4) for d in "ab")
    return PlanningProblem(profile=Profile(model=model, cluster=cluster, times=times), source="a",
                           workload=Workload(prompt_tokens=4, generated_tokens=32))


PLAN = plan_from_boundaries("toy", 4, ["a", "b"], [2])


@pytest.mark.parametrize("alpha, k", [(0.0, 3), (0.5, 1), (0.5, 4), (0.8, 6)])
def test_expected_tokens_per_trip_is_the_mean_of_a_simulated_acceptance_process(alpha, k):
    rng = random.Random(7)
    trips = 20_000
    total = 0
    for _ in range(trips):
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        total += accepted + 1  # the target's own token
    assert expected_tokens_per_trip(alpha, k) == pytest.approx(total / trips, rel=0.02)
    assert expected_tokens_per_trip(1.0, k) == k + 1


def test_a_verify_trip_costs_a_decode_step_at_one_position_and_the_profiled_prefill_at_its_token_count():
    problem = _problem(latency_ms=5.0)
    assert verify_trip_s(problem, PLAN, 1) == pytest.approx(step_time_s(problem, PLAN, "decode", 1))
    hops = 2 * 5e-3 + (1000 * 8 + 4 * 8) * 8 / 800e6
    assert verify_trip_s(problem, PLAN, 8) == pytest.approx(4 * 2e-3 + hops)
    halfway = 4 * 1.5e-3 + 2 * 5e-3 + (1000 * 4.5 + 4 * 4.5) * 8 / 800e6
    assert verify_trip_s(problem, PLAN, 4.5) == pytest.approx(halfway)


def test_a_drafts_token_costs_its_units_on_the_source_device():
    assert draft_token_s(_problem(1.0), PLAN, layers=1) == pytest.approx(3e-3)  # embedding, one block, head


def test_slow_links_and_a_good_draft_make_speculation_pay_and_the_planner_picks_the_best_k():
    problem = _problem(latency_ms=20.0)
    draft = DraftFigures(acceptance_rate=0.8, token_s=1e-3)
    choice = choose_k(problem, PLAN, draft)
    rates = {k: speculative_tokens_s(problem, PLAN, draft, k) for k in range(0, 9)}
    assert choice.k == max(rates, key=rates.get) > 0
    assert choice.speedup == pytest.approx(rates[choice.k] / rates[0]) and choice.speedup > 1.5


def test_a_draft_the_target_never_agrees_with_leaves_plain_decoding():
    choice = choose_k(_problem(latency_ms=20.0), PLAN, DraftFigures(acceptance_rate=0.0, token_s=1e-3))
    assert choice.k == 0 and choice.speculative_tokens_s == choice.plain_tokens_s


def test_a_draft_timed_on_the_plans_source_is_costed_by_that_time_and_another_devices_is_not():
    import msgspec

    from core.devices.profile import DraftTime
    from core.planning.speculation import measured_draft_token_s

    problem = _problem(1.0)
    timed = msgspec.structs.replace(problem, profile=msgspec.structs.replace(problem.profile, draft_times=(
        DraftTime(device="a", draft="draft", token_s=7e-3), DraftTime(device="b", draft="draft", token_s=9e-3))))
    assert measured_draft_token_s(timed, "a", "draft") == 7e-3
    assert measured_draft_token_s(timed, "a", "other-draft") is None
    assert measured_draft_token_s(problem, "a", "draft") is None


def test_a_draft_on_another_device_pays_its_token_there_and_a_hop_each_way_a_trip():
    problem, k = _problem(latency_ms=5.0), 3
    here = DraftFigures(acceptance_rate=0.5, token_s=2e-3)
    there = DraftFigures(acceptance_rate=0.5, token_s=1e-3, device="b")
    committed = (1 - 0.5 ** 4) / 0.5  # E(3): the tokens sent to the draft's device a trip, 8 bytes each
    hops = 2 * 5e-3 + (committed * 8 + k * 8) * 8 / 800e6  # a -> b the committed tokens, b -> a the proposals
    assert trip_s(problem, PLAN, there, k) == pytest.approx(k * 1e-3 + hops + verify_trip_s(problem, PLAN, k + 1))
    assert trip_s(problem, PLAN, here, k) == pytest.approx(k * 2e-3 + verify_trip_s(problem, PLAN, k + 1))
    assert draft_token_s(problem, PLAN, 1, "b") == pytest.approx(3e-3)  # the proxy on b's own profiled units


def test_auto_puts_the_draft_where_it_is_fastest_counting_its_hops():
    fast_b = [DraftFigures(acceptance_rate=0.8, token_s=5e-3), DraftFigures(acceptance_rate=0.8, token_s=1e-3, device="b")]
    near, far = _problem(latency_ms=0.1), _problem(latency_ms=50.0)
    figures, choice = choose_draft(near, PLAN, fast_b)  # b drafts 5x faster, its hops cost 0.2 ms a trip
    assert figures.device == "b" and choice == choose_k(near, PLAN, fast_b[1])
    figures, choice = choose_draft(far, PLAN, fast_b)  # 100 ms of hops a trip outweigh <= 32 ms of drafting saved
    assert figures.device == "" and choice == choose_k(far, PLAN, fast_b[0])
