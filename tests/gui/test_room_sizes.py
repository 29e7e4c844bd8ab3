"""No GUI source file grows past 600 lines (issue 29): a file that does is split along a seam into
its room (gui/screens, gui/techniques, gui/timeline, gui/widgets, gui/connection)."""

from __future__ import annotations

from pathlib import Path

GUI = Path(__file__).resolve().parents[2] / "gui"


def test_no_gui_source_file_is_over_600_lines():
    sizes = {str(p.relative_to(GUI.parent)): len(p.read_text().splitlines()) for p in GUI.rglob("*.py")}
    assert len(sizes) > 30  # the whole tree was read
    assert {f: n for f, n in sizes.items() if n > 600} == {}
