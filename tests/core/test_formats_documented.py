"""docs/formats.md names every ``edgeshard.*`` format the code writes or prints (issue 30 item 5: a
format missing from the page, like ``edgeshard.epd-pools`` was, fails here)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WRITTEN = re.compile(r'(?:format: Literal\[|_FORMAT = |"format": )"(edgeshard\.[a-z0-9-]+)"')
"""A format as the code declares one: a typed file's ``format`` field, a ``*_FORMAT`` constant, or the
``"format"`` key of a printed or written document (logger names and entry-point groups are not formats)."""


def _written_formats() -> set[str]:
    found = set()
    for package in ("core", "agents"):
        for path in (REPO / package).rglob("*.py"):
            found |= set(WRITTEN.findall(path.read_text()))
    return found


def test_the_scan_finds_the_formats_it_is_meant_to():
    assert {"edgeshard.plan", "edgeshard.epd-pools", "edgeshard.run-output", "edgeshard.agents"} <= _written_formats()


def test_formats_md_names_every_format_the_code_writes():
    page = (REPO / "docs" / "formats.md").read_text()
    missing = sorted(f for f in _written_formats() if f"`{f}`" not in page)
    assert not missing, f"docs/formats.md does not document {', '.join(missing)}"
