"""The attention probe's kept fits are keyed by the very profile they were measured under."""

from __future__ import annotations

import gc

from gui.techniques.attention_probe import Same


class _Profile:
    pass


def test_a_key_part_matches_only_the_same_object_and_keeps_it_alive():
    first = _Profile()
    fits = {(Same(first), "model"): "fit"}
    assert (Same(first), "model") in fits
    assert (Same(_Profile()), "model") not in fits  # an equal-looking, other profile
    first_id = id(first)
    del first
    gc.collect()
    # the key holds the profile: its id cannot be handed to a later profile while the fit is kept
    assert any(id(k[0].obj) == first_id for k in fits)
