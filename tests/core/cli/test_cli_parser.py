"""Building the ``edgeshard`` parser: a command named like its command group loads that group alone."""

from __future__ import annotations

from core.cli import build_parser


def _commands(parser) -> set[str]:
    return set(parser._subparsers._group_actions[0].choices)


def test_studio_loads_only_its_own_command_group():
    """``edgeshard studio`` starts the demo's agents sooner: no other group's imports first."""
    assert _commands(build_parser("studio")) == {"studio"}


def test_a_group_name_that_is_not_a_command_loads_every_command():
    every = _commands(build_parser())
    assert "planning" not in every and {"plan", "studio", "run"} <= every
    assert _commands(build_parser("planning")) == every
    assert _commands(build_parser("no-such-command")) == every


def test_run_loads_only_the_runtime_group():
    """``edgeshard run`` refuses a bad plan sooner: no planning, sessions or technique imports first."""
    assert _commands(build_parser("run")) == {"run", "agent", "cluster"}
