"""bench/peer_pipelining.py: the prefill's phase split and the torch peer's prefill-only command."""

from __future__ import annotations

import pytest

from agents.protocol import TimelineEvent, TokenEvent
from bench.peer_pipelining import _Peer, ours_prefill_phases, prefill_phases, torch_prefill_phases
from core.models.checkpoints import ModelRecipe, make_model
from core.runs.coordinator import RunResult


def test_prefill_phases_split_the_time_from_the_command_to_the_first_token():
    split = prefill_phases(10.0, [(10.5, 70.5), (71.0, 131.0)], 131.5)
    assert split == pytest.approx({"total": 121.5, "dispatch": 0.5, "compute0": 60.0, "compute1": 60.0,
                                   "hop01": 0.5, "back": 0.5, "overhead": 1.5})


def test_torch_prefill_is_timed_from_the_command_written_not_from_rank_0s_schedule():
    result = {"t_command": 100.0, "spans": [[[100.002, 100.062]], [[100.0625, 100.1225]]], "t_first": 100.123,
              "prefill_s": 0.1205}
    split = torch_prefill_phases(result)
    assert split["total"] == pytest.approx(0.123)
    assert split["dispatch"] == pytest.approx(0.002)


def test_ours_prefill_takes_each_stages_prefill_compute_in_stage_order_and_the_first_token():
    def compute(stage, step, start, end):
        return TimelineEvent(device=f"d{stage}", stage=stage, kind="compute",
                             phase="prefill" if step == 0 else "decode", step=step, micro_batch=0,
                             start_s=start, end_s=end)

    events = (compute(1, 0, 0.0615, 0.1215), compute(0, 0, 0.0005, 0.0605), compute(0, 1, 0.123, 0.140),
              TimelineEvent(device="d0", stage=0, kind="send", phase="prefill", step=0, micro_batch=0,
                            start_s=0.0606, end_s=0.061))
    tokens = (TokenEvent(micro_batch=0, step=1, sequence_ids=(0,), token_ids=(7,), t_s=0.16),
              TokenEvent(micro_batch=0, step=0, sequence_ids=(0,), token_ids=(5,), t_s=0.122))
    result = RunResult(run_id="r", tokens=((5, 7),), events=events, token_events=tokens, clocks={}, wall_s=0.2)
    split = ours_prefill_phases(result)
    assert split == pytest.approx({"total": 0.122, "dispatch": 0.0005, "compute0": 0.06, "compute1": 0.06,
                                   "hop01": 0.001, "back": 0.0005, "overhead": 0.002})


@pytest.mark.slow
def test_a_prefill_only_command_gives_each_ranks_prefill_span_after_the_command_and_no_decode_rate(tmp_path):
    model = make_model(ModelRecipe(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=7),
                       tmp_path / "llama")
    peer = _Peer(2, str(model), threads=1, new_tokens=3)
    try:
        full = peer.round(1, 1)
        first = peer.round(1, 1, steps=1)
    finally:
        peer.close()
    assert full["decode_tok_s"] > 0 and first["decode_tok_s"] is None
    (s0,), (s1,) = first["spans"]
    assert first["t_command"] < s0[0] < s0[1] <= s1[0] < s1[1] < first["t_first"]
    assert len(first["tokens"]) == 1
