"""ExpertActivity: the counts behind the expert heat map, from io timeline events."""

from __future__ import annotations

import pytest
import torch

from agents.techniques.expert_offload.offload import ExpertOffloadExecutor
from agents.local_pipeline import generate_partitioned
from agents.sampling import SamplingParams
from agents.shard import StageExecutor
from core.models.checkpoints import ModelRecipe, make_model
from agents.protocol import TimelineEvent
from agents.techniques.expert_offload.activity import expert_activity
from core.techniques.expert_offload.activity import MEASURES, ExpertActivity


def io(block: int, expert: int, outcome: str, nbytes: int = 0, at: float = 0.0) -> TimelineEvent:
    return TimelineEvent(device="d:storage", stage=0, kind="io", phase="decode", step=1, micro_batch=0,
                         start_s=at, end_s=at + (0.001 if nbytes else 0.0), nbytes=nbytes,
                         peer=expert_activity(block, expert, outcome))


def test_counts_hits_misses_preloads_and_evictions_per_block_and_expert():
    a = ExpertActivity()
    assert a.add([io(0, 1, "load", 100), io(0, 1, "hit"), io(0, 1, "hit"), io(2, 3, "preload", 50),
                  io(2, 3, "hit"), io(0, 1, "evict")])
    assert a.grid("activations") == [[0, 3, 0, 0], [0, 0, 0, 1]]  # rows: blocks 0 and 2; 4 experts seen
    assert a.grid("hit rate")[0][:2] == [None, pytest.approx(2 / 3)]
    assert a.grid("misses")[0][1] == 1 and a.grid("preloads")[1][3] == 1 and a.grid("evictions")[0][1] == 1
    assert a.totals() == {"hits": 3, "misses": 1, "preloads": 1, "evictions": 1, "bytes_read": 150, "resident": 1}
    assert a.hit_rate() == pytest.approx(3 / 4)


def test_events_that_are_not_expert_activity_are_ignored():
    a = ExpertActivity()
    compute = TimelineEvent(device="d", stage=0, kind="compute", phase="decode", step=1, micro_batch=0,
                            start_s=0.0, end_s=1.0, peer=expert_activity(0, 0, "hit"))
    storage = TimelineEvent(device="d:storage", stage=0, kind="io", phase="decode", step=1, micro_batch=0,
                            start_s=0.0, end_s=1.0, nbytes=9, peer="storage")
    odd = [io(0, 0, "hit")]
    odd = [TimelineEvent(**{**{f: getattr(odd[0], f) for f in odd[0].__struct_fields__}, "peer": p})
           for p in ("expert x.1 hit", "expert 1.2 flew", "expert 1 hit", "")]
    assert not a.add([compute, storage, *odd])
    assert a.is_empty() and a.grid("activations") == [] and a.hit_rate() is None


def test_an_unknown_measure_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="activations"):
        ExpertActivity().grid("heat")
    assert "hit rate" in MEASURES


def test_residency_follows_each_experts_latest_event_by_time_not_by_arrival():
    a = ExpertActivity()
    a.add([io(0, 1, "load", 100, at=1.0), io(0, 2, "preload", 100, at=1.5), io(1, 0, "load", 100, at=2.0)])
    assert a.resident() == [(0, 1), (0, 2), (1, 0)]
    a.add([io(0, 1, "evict", at=3.0), io(0, 2, "hit", at=2.5)])
    assert a.resident() == [(0, 2), (1, 0)] and not a.is_resident(0, 1) and a.is_resident(0, 2)
    a.add([io(1, 0, "evict", at=4.0), io(0, 1, "load", 100, at=3.5)])  # a lane delivered its later event first
    assert a.resident() == [(0, 1), (0, 2)]
    assert a.grid("resident") == [[0, 1, 1], [0, 0, 0]] and a.totals()["resident"] == 2
    a.add([io(0, 2, "evict", at=5.0), io(0, 2, "hit", at=2.6)])  # an older hit arriving late changes nothing
    assert a.resident() == [(0, 1)]


def test_the_resident_experts_are_what_the_agents_buffer_holds_after_a_real_run(tmp_path):
    model = make_model(ModelRecipe(family="mixtral", layers=3, hidden=64, heads=4, kv_heads=2, vocab=512, seed=4,
                                   experts=8), tmp_path / "tiny-mixtral")
    # blocks 1 and 2 (units 2, 3) on this stage: the events name the checkpoint's blocks
    head = StageExecutor(str(model), 0, 2)
    executor = ExpertOffloadExecutor(str(model), 2, 5, slots=5, preload=2)
    activity = ExpertActivity()
    ids = torch.tensor([[5, 17, 99, 3, 42, 7, 8, 300]])
    try:
        generate_partitioned([head, executor], ids, torch.ones_like(ids),
                             SamplingParams(max_new_tokens=8, eos_token_ids=(), pad_token_id=0))
        executor.close()
        executor._io.join(30)  # the preload thread has done its queued loads: the buffer stands still
        assert not executor._io.is_alive()
        events = [TimelineEvent(device="d:storage", stage=1, kind=kind, phase="decode", step=0, micro_batch=0,
                                start_s=start, end_s=end, nbytes=nbytes, peer=peer)
                  for kind, start, end, nbytes, peer in executor.take_events()]
        held = sorted((executor.layer_indices[layer], expert) for layer, expert in executor.buffer._held)
    finally:
        executor.close()
    assert activity.add(reversed(events))  # whatever order they arrive in
    assert activity.totals()["evictions"] > 0 and activity.blocks == {1, 2}
    assert activity.resident() == held and 0 < len(held) <= 5
