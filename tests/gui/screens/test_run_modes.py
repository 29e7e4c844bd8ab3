"""The run panel offers the runtime's modes, taken from the wire format's one definition."""

from __future__ import annotations

from agents.protocol import RUN_MODES


def test_the_run_panel_lists_the_wire_formats_run_modes():
    import gui.screens.run as run_panel

    assert run_panel.MODES is RUN_MODES
    assert set(run_panel.MODE_HELP) == set(RUN_MODES)
