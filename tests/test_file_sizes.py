"""No source file in agents/, core/ or gui/ is over 600 lines: a file that long holds more than
one responsibility, and a newcomer reads a wing by its files (issue 29)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 600


def _lines(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for _ in f)


def test_no_source_file_in_agents_core_or_gui_is_over_600_lines():
    sources = [p for package in ("agents", "core", "gui") for p in (ROOT / package).rglob("*.py")
               if "__pycache__" not in p.parts]
    assert len(sources) > 150  # the three floors were read, not an empty folder
    over = sorted((n, p.relative_to(ROOT).as_posix()) for p in sources if (n := _lines(p)) > LIMIT)
    assert not over, f"split along their seams (limit {LIMIT} lines): " + ", ".join(f"{p} ({n})" for n, p in over)
