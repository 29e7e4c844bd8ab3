"""agents.schedule: when the source starts each micro-batch step per run mode, and what a
stage does for one step. Pure: checked without agents, torch or sockets."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agents.schedule import (
    Compute,
    Receive,
    Send,
    Step,
    begin,
    on_returned,
    source_order,
    stage_operations,
    step_operations,
)


def _pairs(steps):
    return [(s.micro_batch, s.step) for s in steps]


def test_sequential_runs_each_micro_batch_to_completion_before_the_next_starts():
    assert _pairs(source_order("sequential", 3, 2)) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]


def test_pipelined_modes_start_every_micro_batch_at_once_and_take_steps_round_robin():
    for mode in ("bubbles", "no-bubbles"):
        state, first = begin(mode, 3, 2)
        assert _pairs(first) == [(0, 0), (1, 0), (2, 0)]
        assert _pairs(source_order(mode, 3, 2)) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]


def test_bubbles_start_the_next_step_only_when_every_micro_batch_of_this_step_is_back():
    state, _ = begin("bubbles", 3, 4)
    state, a = on_returned(state, 0, 0)
    state, b = on_returned(state, 1, 0)
    state, c = on_returned(state, 2, 0)
    assert a == () and b == ()
    assert _pairs(c) == [(0, 1), (1, 1), (2, 1)]


def test_no_bubbles_start_a_micro_batchs_next_step_as_soon_as_its_own_tokens_are_back():
    state, _ = begin("no-bubbles", 3, 4)
    state, a = on_returned(state, 1, 0)
    assert a == (Step(1, 1),)


def test_a_micro_batch_finished_early_is_not_waited_for_nor_continued():
    state, _ = begin("bubbles", 2, 5)
    state, a = on_returned(state, 0, 0, finished_early=True)
    state, b = on_returned(state, 1, 0)
    assert a == () and b == (Step(1, 1),)
    state, c = on_returned(state, 1, 1)
    assert c == (Step(1, 2),), "the barrier counts only micro-batches still running"

    state, _ = begin("sequential", 2, 5)
    state, d = on_returned(state, 0, 0, finished_early=True)
    assert d == (Step(1, 0),)
    state, e = on_returned(state, 1, 0, finished_early=True)
    assert e == () and state.all_finished


def test_the_run_is_finished_after_the_last_step_of_every_micro_batch():
    state, _ = begin("no-bubbles", 2, 2)
    for mb, step in [(0, 0), (1, 0), (0, 1)]:
        state, _ = on_returned(state, mb, step)
        assert not state.all_finished
    state, last = on_returned(state, 1, 1)
    assert last == () and state.all_finished


def test_no_new_tokens_start_nothing_and_the_run_is_finished_at_once():
    state, first = begin("bubbles", 3, 0)
    assert first == () and state.all_finished


def test_an_unknown_mode_is_refused_naming_the_modes():
    with pytest.raises(ValueError, match="sequential, bubbles, no-bubbles"):
        begin("zigzag", 1, 1)


def test_a_middle_stage_receives_computes_and_sends_hidden_states_on():
    ops = step_operations(1, 3, (2, 4), Step(0, 3))
    assert ops == (Receive(0, 3, 0, "hidden"), Compute(0, 3, (2, 4), False), Send(0, 3, 2, "hidden"))
    assert {op.phase for op in ops} == {"decode"}


def test_the_last_stage_samples_and_sends_the_tokens_back_to_the_source():
    ops = step_operations(2, 3, (4, 6), Step(1, 0))
    assert ops[1] == Compute(1, 0, (4, 6), True) and ops[1].phase == "prefill"
    assert ops[2] == Send(1, 0, 0, "tokens")


def test_a_one_stage_plan_only_computes_and_samples():
    assert step_operations(0, 1, (0, 6), Step(0, 0)) == (Compute(0, 0, (0, 6), True),)


def test_the_source_handles_returned_tokens_between_the_steps_it_started_before_and_those_they_release():
    source, last = stage_operations([(0, 2), (2, 6)], "bubbles", 2, 2)
    kinds = [(type(op).__name__, op.micro_batch, op.step) for op in source]
    assert kinds == [("Compute", 0, 0), ("Send", 0, 0), ("Compute", 1, 0), ("Send", 1, 0),
                     ("Receive", 0, 0), ("Receive", 1, 0),
                     ("Compute", 0, 1), ("Send", 0, 1), ("Compute", 1, 1), ("Send", 1, 1),
                     ("Receive", 0, 1), ("Receive", 1, 1)]
    assert [type(op).__name__ for op in last] == ["Receive", "Compute", "Send"] * 4


def test_the_schedule_imports_neither_torch_nor_zmq():
    code = "import sys, agents.schedule; print('torch' in sys.modules, 'zmq' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


# ------------------------------------------------------------------ joins (open runs)
def test_a_join_starts_its_prefill_at_once_in_no_bubbles_while_another_decodes():
    from agents.schedule import join

    state, _ = begin("no-bubbles", 0, 100)
    state, started = join(state, 0)
    assert started == (Step(0, 0),)
    state, _ = on_returned(state, 0, 0)
    state, started = join(state, 1)
    assert started == (Step(1, 0),)


def test_a_join_waits_for_the_barrier_in_bubbles_and_for_the_running_one_in_sequential():
    from agents.schedule import join

    state, _ = begin("bubbles", 0, 100)
    state, _ = join(state, 0)
    state, started = join(state, 1)  # micro-batch 0's prefill is in flight
    assert started == ()
    state, started = on_returned(state, 0, 0)
    assert started == (Step(0, 1), Step(1, 0))
    seq, _ = begin("sequential", 0, 100)
    seq, _ = join(seq, 0)
    seq, started = join(seq, 1)
    assert started == ()
    seq, started = on_returned(seq, 0, 0, finished_early=True)
    assert started == (Step(1, 0),)


def test_a_running_micro_batchs_index_cannot_be_joined_until_it_is_finished():
    from agents.schedule import join

    state, _ = begin("no-bubbles", 0, 100)
    state, _ = join(state, 0)
    with pytest.raises(ValueError, match="running"):
        join(state, 0)
    state, _ = on_returned(state, 0, 0, finished_early=True)
    assert join(state, 0)[1] == (Step(0, 0),)


def test_a_join_of_an_index_past_the_next_leaves_the_ones_below_idle_until_they_join():
    from agents.schedule import join

    for mode in ("no-bubbles", "bubbles", "sequential"):
        state, _ = begin(mode, 0, 100)
        state, started = join(state, 2)  # 0 and 1 have never run: the prefill starts at once all the same
        assert started == (Step(2, 0),), mode
        assert state.finished[:2] == (True, True) and state.started[:2] == (-1, -1)
        state, started = on_returned(state, 2, 0)
        assert started == (Step(2, 1),), mode  # the idle indices take no steps
        state, _ = join(state, 0)
        assert state.finished == (False, True, False), mode
