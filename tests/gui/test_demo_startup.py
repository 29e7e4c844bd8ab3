"""The demo's start-up breakdown (what ``bench/demo_startup.py`` reports), as a pure function."""

from __future__ import annotations

from gui.demo_cluster import STARTUP_PHASES, startup_breakdown


def test_the_breakdown_gives_seconds_since_the_launch_in_critical_path_order():
    names = [name for name, _ in STARTUP_PHASES]
    phases = {name: 100.0 + i for i, name in enumerate(reversed(names))}  # marked in any order
    got = startup_breakdown(phases, since=99.5)
    assert list(got) == names
    assert got[names[-1]] == 0.5 and got[names[0]] == 0.5 + len(names) - 1


def test_steps_not_reached_are_left_out():
    """An agent started as its own interpreter has no zygote steps."""
    got = startup_breakdown({"setup_started": 10.25, "agents_up": 12.0}, since=10.0)
    assert got == {"setup_started": 0.25, "agents_up": 2.0}
