"""The Run screen's prediction batches prompts as the real run does and stays small."""

from __future__ import annotations

import pytest

from core.runs.coordinator import split_micro_batches
from core.runs.prediction import MAX_STAGE_STEPS, predict_run, run_group_sizes
from core.runs.simulator import simulate
from tests.core.sessions_problems import make_plan, make_problem

HETERO = {"a": 0.010, "b": 0.020, "c": 0.005}


def _problem_and_plan():
    p = make_problem(HETERO, generated_tokens=6)
    return p, make_plan(p, ["a", "b", "c"], [3, 5])


def test_five_prompts_in_two_micro_batches_are_predicted_as_three_plus_two_like_the_real_run():
    p, plan = _problem_and_plan()
    prediction = predict_run(p, plan, "no-bubbles", n_prompts=5, micro_batches=2, max_new_tokens=4)
    assert prediction.group_sizes == (3, 2)
    real = split_micro_batches(5, 2)
    for t in prediction.result.tokens:
        assert t.sequence_ids == real[t.micro_batch]
    assert prediction.result.figures.tokens == 5 * 4  # not 6 * 4 (3 + 3)


def test_a_smaller_micro_batch_computes_for_less_time_than_a_bigger_one():
    p, plan = _problem_and_plan()
    res = simulate(p, plan, "no-bubbles", micro_batch_sizes=(3, 1), generated_tokens=2)
    prefill = {e.micro_batch: e.end_s - e.start_s for e in res.events
               if e.kind == "compute" and e.stage == 0 and e.phase == "prefill"}
    assert prefill[1] < prefill[0]
    equal = simulate(p, plan, "no-bubbles", micro_batch_sizes=(2, 2), generated_tokens=3)
    same = simulate(p, plan, "no-bubbles", micro_batches=2, micro_batch_size=2, generated_tokens=3)
    assert equal.events == same.events and equal.tokens == same.tokens


def test_every_mode_splits_the_prompts_into_the_plans_micro_batches_unless_overridden():
    p, _ = _problem_and_plan()
    plan = make_plan(p, ["a", "b", "c"], [3, 5], m=2, k=2)
    assert run_group_sizes(5, plan) == (3, 2)
    assert run_group_sizes(5, plan, 4) == (2, 1, 1, 1)
    assert run_group_sizes(2, plan, 8) == (1, 1)
    sequential = predict_run(p, plan, "sequential", n_prompts=4, micro_batches=None, max_new_tokens=3)
    assert sequential.group_sizes == (2, 2)
    assert {t.micro_batch for t in sequential.result.tokens} == {0, 1}


def test_a_long_many_micro_batch_run_predicts_only_its_first_steps_and_says_so():
    p, plan = _problem_and_plan()
    prediction = predict_run(p, plan, "no-bubbles", n_prompts=64, micro_batches=64, max_new_tokens=4096)
    assert prediction.steps_predicted == MAX_STAGE_STEPS // (64 * len(plan.stages))
    assert len(prediction.result.events) <= 3 * MAX_STAGE_STEPS
    assert prediction.result.generated_tokens == prediction.steps_predicted
    assert f"first {prediction.steps_predicted} of 4096 steps" in prediction.note
    short = predict_run(p, plan, "no-bubbles", n_prompts=2, micro_batches=2, max_new_tokens=8)
    assert short.steps_predicted == 8 and short.note == ""


def test_an_empty_micro_batch_size_is_refused():
    p, plan = _problem_and_plan()
    with pytest.raises(ValueError):
        simulate(p, plan, "no-bubbles", micro_batch_sizes=(2, 0))
