"""Which tests `make test-fast` should leave out: those over a time limit in a pytest junit report.

    python -m pytest -q -m "not slow and not netns" --junitxml=/tmp/fast.xml
    python scripts/slow_tests.py /tmp/fast.xml >> tests/slow_tests.txt

A test's time in the report is its setup, call and teardown together, so a module-scoped
fixture counts on the first test that uses it; once that test is listed the next one pays it,
so run the two lines again until nothing new is printed (but the one below). Each test folder (package) keeps one
quick test (the suite refuses to start otherwise): where all its tests are over the limit, its
quickest is not printed. A session-wide set-up (tests/agents' tiny checkpoints, with the first
import of torch and transformers: ~10 s under load) lands on whichever test needs it first:
listing that test only moves it to the next one, so leave it off the list.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.slow_list import is_listed, read_slow_keys  # noqa: E402


def times_by_test(report: Path) -> dict[str, float]:
    """``file.py::test[param]`` → seconds (setup + call + teardown) for every test case in ``report``."""
    return {key: seconds for key, (_, seconds) in _cases(report).items()}


def _cases(report: Path) -> dict[str, tuple[str, float]]:
    """``file.py::test[param]`` → (its folder's dotted path, seconds)."""
    cases: dict[str, tuple[str, float]] = {}
    for case in ET.parse(report).iter("testcase"):
        parts = case.get("classname", "").split(".")  # tests.gui.test_x[.TestClass]
        at = max(i for i, p in enumerate(parts) if not p[:1].isupper())  # modules are lowercase, classes not
        key = "::".join([parts[at] + ".py", *parts[at + 1:], case.get("name", "")])
        folder = ".".join(parts[:at])
        cases[key] = (folder, cases.get(key, (folder, 0.0))[1] + float(case.get("time", 0.0)))
    return cases


def newly_slow(cases: dict[str, tuple[str, float]], listed: set[str], over: float) -> dict[str, float]:
    """The tests over ``over`` seconds not listed yet, but each folder's quickest when it would
    leave that folder without a quick test."""
    by_folder: dict[str, list[tuple[str, float]]] = {}
    for key, (folder, seconds) in cases.items():
        if not is_listed(key, listed):
            by_folder.setdefault(folder, []).append((key, seconds))
    slow: dict[str, float] = {}
    for tests in by_folder.values():
        over_limit = [(k, t) for k, t in tests if t > over]
        if len(over_limit) == len(tests):
            over_limit.remove(min(over_limit, key=lambda kt: kt[1]))  # this one pays the folder's set-up
        slow.update(over_limit)
    return slow


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("reports", nargs="+", type=Path, help="junit XML from pytest --junitxml")
    parser.add_argument("--over", type=float, default=0.3, help="seconds above which a test is slow (default 0.3)")
    args = parser.parse_args(argv)
    listed = read_slow_keys()
    cases: dict[str, tuple[str, float]] = {}
    for report in args.reports:
        cases.update(_cases(report))
    times = {key: seconds for key, (_, seconds) in cases.items()}
    slow = newly_slow(cases, listed, args.over)
    for key, seconds in sorted(slow.items(), key=lambda kv: -kv[1]):
        print(f"{key}  # {seconds:.1f} s")
    kept = sum(t for k, t in times.items() if k not in slow and not is_listed(k, listed))
    print(f"{len(times)} tests, {sum(times.values()):.0f} s; without the listed and the {len(slow)} new ones {kept:.0f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
