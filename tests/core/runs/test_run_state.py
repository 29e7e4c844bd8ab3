"""The run state machine on its own: every transition, fed the messages agents really send
(``agents.protocol`` structs), no sockets."""

from __future__ import annotations

import pytest

from agents.protocol import AgentEvent, EventBatch, Pong, RunError, RunFinished, TokensProduced
from core.runs.run_state import (
    Aborted,
    AgentLost,
    Decoding,
    Failed,
    Finished,
    FromAgent,
    Loading,
    LoadProgress,
    Prefill,
    Recovering,
    Replan,
    ReplanImpossible,
    Replanned,
    Resume,
    StageLoaded,
    StageRefused,
    StageStarted,
    Starting,
    StopRequested,
    apply,
    begin,
    is_terminal,
    progress,
)

RUN = "r1"
STAGES = ("a", "b")


def _feed(state, *events):
    for e in events:
        state = apply(state, e)
    return state


def _events(stage_phase_steps, run_id=RUN, device="a"):
    return FromAgent(device, EventBatch(run_id=run_id, device=device, stage=0, events=tuple(
        AgentEvent("compute", phase, step, 0, 1.0, 2.0) for phase, step in stage_phase_steps)))


def _tokens(step, run_id=RUN):
    return FromAgent("a", TokensProduced(run_id=run_id, micro_batch=0, step=step, sequence_ids=(0,),
                                         token_ids=(7,), t=1.0))


def _finished(run_id=RUN):
    return FromAgent("a", RunFinished(run_id=run_id, tokens=((7, 8),)))


def _running():
    return _feed(begin(RUN, STAGES, load=False), StageStarted("b"), StageStarted("a"))


def test_a_run_whose_shards_are_loaded_begins_starting_and_one_that_needs_them_begins_loading():
    assert begin(RUN, STAGES, load=False) == Starting(RUN, STAGES)
    loading = begin(RUN, STAGES, load=True)
    assert isinstance(loading, Loading) and (loading.done, loading.total) == (0.0, 2)


def test_loading_counts_each_stages_fraction_and_a_loaded_stage_as_whole():
    state = _feed(begin(RUN, STAGES, load=True), LoadProgress("a", 0.25), LoadProgress("b", 0.5),
                  LoadProgress("a", 0.1), StageLoaded("b"))
    assert isinstance(state, Loading) and state.done == pytest.approx(1.25) and state.loaded == {"b"}


def test_every_stage_loaded_moves_to_starting():
    assert _feed(begin(RUN, STAGES, load=True), StageLoaded("a"), StageLoaded("b")) == Starting(RUN, STAGES)


def test_every_stage_started_moves_to_prefill():
    state = _feed(begin(RUN, STAGES, load=False), StageStarted("b"))
    assert isinstance(state, Starting) and state.started == {"b"}
    assert apply(state, StageStarted("a")) == Prefill(RUN, STAGES)


def test_prefill_events_and_the_first_tokens_keep_the_run_in_prefill():
    state = _feed(_running(), _events([("prefill", 0)]), _tokens(0))
    assert state == Prefill(RUN, STAGES, tokens=1)


def test_a_decode_step_moves_to_decoding_and_the_step_only_goes_forward():
    state = _feed(_running(), _tokens(0), _tokens(2), _events([("decode", 1)]))
    assert state == Decoding(RUN, STAGES, step=2, tokens=2)


def test_events_streamed_before_the_last_start_reply_is_handled_count_as_started():
    """The source's events travel on the IO thread and can overtake its start reply."""
    state = _feed(begin(RUN, STAGES, load=False), StageStarted("b"), _events([("decode", 3)]), StageStarted("a"))
    assert state == Decoding(RUN, STAGES, step=3)


def test_run_finished_ends_the_run_with_its_tokens():
    assert _feed(_running(), _tokens(0), _finished()) == Finished(RUN, STAGES, ((7, 8),))


def test_a_short_run_can_finish_before_the_coordinator_handled_every_start_reply():
    state = _feed(begin(RUN, STAGES, load=False), StageStarted("b"), _finished())
    assert isinstance(state, Finished)


def test_a_run_error_fails_the_run_naming_the_device_that_raised():
    err = FromAgent("a", RunError(run_id=RUN, device="b", message="RuntimeError: boom"))
    assert _feed(_running(), err) == Failed(RUN, STAGES, "RuntimeError: boom", "b", "agent_error")


def test_losing_a_stage_fails_the_run_naming_it():
    state = apply(_running(), AgentLost("b", "no heartbeat for 2.1 s"))
    assert isinstance(state, Failed) and state.device == "b" and state.code == "agent_lost"
    assert "no heartbeat for 2.1 s" in state.reason


def test_losing_an_agent_outside_the_plan_changes_nothing():
    assert apply(_running(), AgentLost("idle-one", "no heartbeat")) == _running()


def test_a_refused_load_fails_with_the_refusals_code():
    state = apply(begin(RUN, STAGES, load=True), StageRefused("a", "cannot load its shard: 3 GiB > 1 GiB",
                                                               "over_budget"))
    assert state == Failed(RUN, STAGES, "cannot load its shard: 3 GiB > 1 GiB", "a", "over_budget")


def test_a_refused_start_fails_the_run():
    state = apply(begin(RUN, STAGES, load=False), StageRefused("b", "cannot start the run (bad_state): no shard"))
    assert isinstance(state, Failed) and state.device == "b" and state.code == "refused"


@pytest.mark.parametrize("make", [
    lambda: begin(RUN, STAGES, load=True),
    lambda: begin(RUN, STAGES, load=False),
    _running,
    lambda: apply(_running(), _tokens(3)),
], ids=["loading", "starting", "prefill", "decoding"])
def test_the_operator_can_stop_a_run_in_any_live_state(make):
    assert apply(make(), StopRequested("run cancelled")) == Aborted(RUN, STAGES, "run cancelled")


@pytest.mark.parametrize("end", [
    Finished(RUN, STAGES, ((1,),)),
    Failed(RUN, STAGES, "boom", "a"),
    Aborted(RUN, STAGES),
], ids=["finished", "failed", "aborted"])
def test_nothing_moves_a_run_that_has_ended(end):
    for event in (StopRequested(), AgentLost("a", "x"), _tokens(5), _finished(), StageStarted("a"),
                  StageLoaded("a"), StageRefused("a", "late")):
        assert apply(end, event) == end
    assert is_terminal(end)


def test_messages_of_an_earlier_run_are_ignored():
    state = _running()
    for late in (_tokens(4, run_id="old"), _finished(run_id="old"),
                 FromAgent("a", RunError(run_id="old", device="a", message="stale"))):
        assert apply(state, late) == state


@pytest.mark.parametrize("event", [_tokens(0), _finished(), _events([("prefill", 0)])],
                         ids=["tokens", "finished", "events"])
def test_run_messages_while_the_shards_load_are_a_protocol_failure_naming_the_sender(event):
    state = apply(begin(RUN, STAGES, load=True), event)
    assert isinstance(state, Failed) and state.code == "protocol" and state.device == "a"
    assert "while loading" in state.reason


def test_a_stage_starting_before_every_shard_is_loaded_is_a_protocol_failure():
    state = apply(begin(RUN, STAGES, load=True), StageStarted("a"))
    assert isinstance(state, Failed) and state.code == "protocol" and state.device == "a"


def test_a_shard_reported_loaded_during_a_run_is_a_protocol_failure():
    state = apply(_running(), StageLoaded("a"))
    assert isinstance(state, Failed) and state.code == "protocol"


def test_a_device_outside_the_plan_reporting_a_stage_is_a_protocol_failure_naming_it():
    state = apply(begin(RUN, STAGES, load=False), StageStarted("stranger"))
    assert isinstance(state, Failed) and state.device == "stranger" and state.code == "protocol"


def test_a_late_start_reply_or_load_progress_during_the_run_changes_nothing():
    state = apply(_running(), _tokens(1))
    assert apply(state, StageStarted("a")) == state and apply(state, LoadProgress("a", 0.5)) == state


def test_an_agent_message_that_is_not_about_runs_is_a_protocol_failure_not_an_exception():
    state = apply(_running(), FromAgent("a", Pong(t0=0.0, t1=0.0, t2=0.0)))
    assert isinstance(state, Failed) and state.code == "protocol"


def test_an_input_the_machine_does_not_know_is_a_protocol_failure_not_an_exception():
    state = apply(_running(), "not an event")
    assert isinstance(state, Failed) and state.code == "protocol"


def test_progress_counts_tokens_while_running_and_is_complete_once_finished():
    # Finished holds the token ids (a tuple), not a count: the coordinator's progress loop
    # once compared that tuple with an int when a run ended between two polls.
    assert progress(_feed(_running(), _tokens(0)), 10) == 1
    assert progress(_feed(_running(), _tokens(0), _finished()), 10) == 10
    assert progress(begin(RUN, STAGES, load=True), 10) == 0


# ---------------------------------------------------------------------- recovery

def _lost_mid_decode():
    return _feed(_running(), _tokens(0), _tokens(3), AgentLost("b", "no heartbeat for 2.0 s"))


def test_a_replan_turns_a_run_failed_by_a_lost_agent_into_recovering_it():
    state = apply(_lost_mid_decode(), Replan())
    assert state == Recovering(RUN, STAGES, "b", "agent stopped answering (no heartbeat for 2.0 s)")
    assert state.phase == "replanning" and not is_terminal(state)


@pytest.mark.parametrize("end", [
    Failed(RUN, STAGES, "boom", "a", "agent_error"),
    Finished(RUN, STAGES, ((1,),)),
    Aborted(RUN, STAGES),
], ids=["agent-error", "finished", "aborted"])
def test_only_a_lost_agent_can_be_recovered(end):
    assert apply(end, Replan()) == end


def test_a_live_stages_error_is_recovered_as_the_loss_of_the_stage_the_coordinator_found_silent():
    end = Failed(RUN, STAGES, "lost its peer b", "a", "agent_error")
    assert apply(end, Replan("b")) == Recovering(RUN, STAGES, "b", "a reported: lost its peer b")


def test_a_recovery_loads_the_new_stages_then_resumes_as_a_new_segment_that_ignores_the_old_one():
    state = _feed(_lost_mid_decode(), Replan(), Replanned(("a", "c")))
    assert state.phase == "loading" and state.new_stages == ("a", "c")
    state = apply(state, Resume("r2"))
    assert state == Starting("r2", ("a", "c"))
    assert apply(state, _tokens(9, run_id=RUN)) == state  # the interrupted segment's straggler
    state = _feed(state, StageStarted("c"), StageStarted("a"), _finished(run_id="r2"))
    assert isinstance(state, Finished) and state.run_id == "r2"


def test_no_plan_for_the_survivors_fails_the_run_naming_the_lost_device():
    state = _feed(_lost_mid_decode(), Replan(), ReplanImpossible("0.10 GiB missing"))
    assert isinstance(state, Failed) and state.code == "no_plan" and state.device == "b"
    assert "b was lost" in state.reason and "0.10 GiB missing" in state.reason


def test_a_replan_onto_the_lost_device_or_a_resume_before_any_plan_is_a_protocol_failure():
    recovering = _feed(_lost_mid_decode(), Replan())
    assert apply(recovering, Replanned(("a", "b"))).code == "protocol"
    assert apply(recovering, Resume("r2")).code == "protocol"
    assert apply(_running(), Replanned(("a",))).code == "protocol"


def test_losing_a_new_stage_while_recovering_fails_again_and_can_be_recovered_again():
    state = _feed(_lost_mid_decode(), Replan(), Replanned(("a", "c")))
    assert apply(state, AgentLost("b", "late news")) == state  # the one already lost
    again = apply(state, AgentLost("c", "no heartbeat"))
    assert isinstance(again, Failed) and again.code == "agent_lost" and again.device == "c"
    assert apply(again, Replan()).failed == "c"


def test_the_operator_can_stop_a_recovery():
    state = apply(_feed(_lost_mid_decode(), Replan()), StopRequested())
    assert isinstance(state, Aborted)
