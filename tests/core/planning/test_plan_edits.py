"""Hand edits of a plan keep it contiguous and never leave a stage empty."""

import pytest

from core.planning.plan import plan_from_boundaries
from core.planning.edits import PlanEditError, add_stage, move_boundary, remove_stage, set_stage_device, single_device_plan


def three():
    return plan_from_boundaries("m", 10, ["a", "b", "c"], [3, 6], strategy="solver")


def test_move_boundary_moves_units_between_neighbours_and_marks_the_plan_manual():
    p = move_boundary(three(), 2, 8)
    assert [(s.start, s.end) for s in p.stages] == [(0, 3), (3, 8), (8, 10)]
    assert p.strategy == "manual"


@pytest.mark.parametrize("new_start", [3, 10, 11])
def test_move_boundary_refuses_to_empty_a_stage(new_start):
    with pytest.raises(PlanEditError, match="empty"):
        move_boundary(three(), 2, new_start)


def test_setting_a_device_used_elsewhere_swaps_the_two_stages_devices():
    assert set_stage_device(three(), 0, "c").devices() == ("c", "b", "a")


def test_add_stage_splits_the_largest_stage_and_remove_merges_into_the_previous():
    p = add_stage(single_device_plan("m", 10, "a"), "b")
    assert [(s.device, s.start, s.end) for s in p.stages] == [("a", 0, 5), ("b", 5, 10)]
    q = remove_stage(three(), 1)
    assert [(s.device, s.start, s.end) for s in q.stages] == [("a", 0, 6), ("c", 6, 10)]
    r = remove_stage(three(), 0)
    assert [(s.device, s.start, s.end) for s in r.stages] == [("b", 0, 6), ("c", 6, 10)]


def test_the_last_stage_cannot_be_removed():
    with pytest.raises(PlanEditError):
        remove_stage(single_device_plan("m", 4, "a"), 0)
