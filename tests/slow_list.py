"""The list of slow tests (tests/slow_tests.txt) that `make test-fast` leaves out: read by the
suite's conftest and by scripts/slow_tests.py, which measures new ones."""

from __future__ import annotations

from pathlib import Path

SLOW_LIST = Path(__file__).with_name("slow_tests.txt")


def read_slow_keys(path: Path = SLOW_LIST) -> set[str]:
    """``file.py::test`` (or ``file.py::Class::test``, or one ``[param]`` of it) per line; # comments."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {line for line in lines if line}


def is_listed(key: str, keys: set[str]) -> str | None:
    """The entry of ``keys`` that names ``key`` (itself, or the test without its ``[param]``)."""
    for candidate in (key, key.split("[", 1)[0]):
        if candidate in keys:
            return candidate
    return None
