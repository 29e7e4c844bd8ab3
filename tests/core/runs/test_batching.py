"""A run's micro-batches come from its plan unless the operator overrides the count."""

from __future__ import annotations

import pytest

from core.errors import FormatError
from core.planning.plan import plan_from_boundaries
from core.runs.batching import batching_settings, micro_batch_count, run_micro_batches

PLAN = plan_from_boundaries("tiny-llama", 6, ["a", "b"], [3], micro_batch_size=2, micro_batches=3)


def test_without_an_override_a_run_uses_the_plans_micro_batch_count():
    assert micro_batch_count(PLAN) == 3
    assert run_micro_batches(6, PLAN) == ((0, 1), (2, 3), (4, 5))


def test_an_override_replaces_the_plans_count_and_never_makes_empty_micro_batches():
    assert run_micro_batches(6, PLAN, 2) == ((0, 1, 2), (3, 4, 5))
    assert run_micro_batches(2, PLAN, 5) == ((0,), (1,))


def test_an_override_below_one_is_refused_naming_the_plans_count():
    with pytest.raises(FormatError, match="at least 1.*plan's 3"):
        micro_batch_count(PLAN, 0)


def test_the_recorded_settings_say_whether_the_count_was_the_plans_or_an_override():
    assert batching_settings(PLAN, None) == {"micro_batches_override": None, "micro_batches": 3,
                                            "plan_micro_batches": 3, "plan_micro_batch_size": 2}
    assert batching_settings(PLAN, 4)["micro_batches"] == 4
    assert batching_settings(None, 4) == {"micro_batches_override": 4, "micro_batches": 4}
