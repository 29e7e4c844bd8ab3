"""ExpertActivity: the counts behind the expert heat map, from io timeline events."""

from __future__ import annotations

import pytest

from agents.protocol import TimelineEvent, expert_activity
from core.techniques.expert_offload.activity import MEASURES, ExpertActivity


def io(block: int, expert: int, outcome: str, nbytes: int = 0) -> TimelineEvent:
    return TimelineEvent(device="d:storage", stage=0, kind="io", phase="decode", step=1, micro_batch=0,
                         start_s=0.0, end_s=0.001 if nbytes else 0.0, nbytes=nbytes,
                         peer=expert_activity(block, expert, outcome))


def test_counts_hits_misses_preloads_and_evictions_per_block_and_expert():
    a = ExpertActivity()
    assert a.add([io(0, 1, "load", 100), io(0, 1, "hit"), io(0, 1, "hit"), io(2, 3, "preload", 50),
                  io(2, 3, "hit"), io(0, 1, "evict")])
    assert a.grid("activations") == [[0, 3, 0, 0], [0, 0, 0, 1]]  # rows: blocks 0 and 2; 4 experts seen
    assert a.grid("hit rate")[0][:2] == [None, pytest.approx(2 / 3)]
    assert a.grid("misses")[0][1] == 1 and a.grid("preloads")[1][3] == 1 and a.grid("evictions")[0][1] == 1
    assert a.totals() == {"hits": 3, "misses": 1, "preloads": 1, "evictions": 1, "bytes_read": 150}
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
