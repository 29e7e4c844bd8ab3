"""The demo's kept profile: when it is found again (a hit), and every change that makes it a miss."""

from __future__ import annotations

import time

import pytest

from core.devices.profile_cache import (code_digest, describe_age, has_cached_profiles, load_cached_profile,
                                        profile_key, save_cached_profile)
from core.planning.scenarios import random_problem

BASE = dict(model_config={"model_type": "llama", "num_hidden_layers": 6, "hidden_size": 128},
            devices={"edge-a": {"memory_budget_bytes": 100, "compute_slowdown": 1.0, "link_mbit": 200.0},
                     "edge-b": {"memory_budget_bytes": 80, "compute_slowdown": 1.5, "link_mbit": 100.0}},
            options={"prompt_tokens": 16, "batch_sizes": [1, 2]}, code="abc",
            host={"cpu": "x86", "cores": 2, "torch": "2.13.0"})


def _with(**changes) -> dict:
    return {**BASE, **changes}


def test_the_same_inputs_in_any_order_give_the_same_key():
    reordered = dict(model_config=dict(reversed(list(BASE["model_config"].items()))),
                     devices=dict(reversed(list(BASE["devices"].items()))),
                     options=BASE["options"], code=BASE["code"], host=BASE["host"])
    assert profile_key(**reordered) == profile_key(**BASE)


@pytest.mark.parametrize("changed", [
    _with(model_config={**BASE["model_config"], "hidden_size": 192}),  # another model's units
    _with(devices={**BASE["devices"], "edge-b": {**BASE["devices"]["edge-b"], "compute_slowdown": 2.0}}),  # emulation
    _with(devices={**BASE["devices"], "edge-b": {**BASE["devices"]["edge-b"], "link_mbit": 50.0}}),  # a link
    _with(devices={"edge-a": BASE["devices"]["edge-a"]}),  # a device fewer
    _with(options={**BASE["options"], "prompt_tokens": 32}),  # how it was profiled
    _with(code="abd"),  # the agents' code
    _with(host={**BASE["host"], "torch": "2.14.0"}),  # the library that computes
    _with(host={**BASE["host"], "cores": 4}),  # the machine
], ids=["model", "slowdown", "link", "devices", "options", "code", "torch", "host"])
def test_any_change_to_what_was_measured_gives_another_key(changed):
    assert profile_key(**changed) != profile_key(**BASE)


def test_the_code_digest_changes_when_a_source_changes_or_appears(tmp_path):
    (tmp_path / "profiler.py").write_text("A = 1\n")
    before = code_digest(tmp_path)
    assert code_digest(tmp_path) == before
    (tmp_path / "profiler.py").write_text("A = 2\n")
    edited = code_digest(tmp_path)
    assert edited != before
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "new.py").write_text("")
    assert code_digest(tmp_path) not in (before, edited)


def test_a_kept_profile_is_found_under_its_key_only(tmp_path):
    profile = random_problem(1).profile
    save_cached_profile(tmp_path, "k1" * 20, profile)
    hit = load_cached_profile(tmp_path, "k1" * 20)
    assert hit is not None and hit.profile == profile and abs(hit.measured_at - time.time()) < 60
    assert load_cached_profile(tmp_path, "k2" * 20) is None


def test_a_new_measurement_replaces_the_kept_one(tmp_path):
    save_cached_profile(tmp_path, "k1" * 20, random_problem(1).profile)
    save_cached_profile(tmp_path, "k2" * 20, random_problem(2).profile)
    assert load_cached_profile(tmp_path, "k1" * 20) is None
    assert load_cached_profile(tmp_path, "k2" * 20).profile == random_problem(2).profile
    assert len(list(tmp_path.iterdir())) == 1


def test_a_damaged_file_is_a_miss(tmp_path):
    path = save_cached_profile(tmp_path, "k1" * 20, random_problem(1).profile)
    path.write_text("{not json")
    assert load_cached_profile(tmp_path, "k1" * 20) is None


def test_the_age_reads_as_a_time_today_and_with_the_date_before():
    now = time.mktime((2026, 11, 26, 15, 0, 0, 0, 0, -1))
    assert describe_age(now - 3600, now) == "14:00"
    assert describe_age(now - 86400, now) == "2026-11-25 15:00"


def test_whether_any_profile_is_kept_is_known_before_the_key(tmp_path):
    """The demo tells its zygote at once to preload when nothing is kept (no key needed)."""
    assert not has_cached_profiles(tmp_path / "missing") and not has_cached_profiles(tmp_path)
    save_cached_profile(tmp_path, "k1" * 20, random_problem(1).profile)
    assert has_cached_profiles(tmp_path)
