"""`make test-fast` leaves out the tests named in tests/slow_tests.txt: the list's format, and
scripts/slow_tests.py reading a junit report into entries of it."""

import importlib.util
from pathlib import Path

from tests.slow_list import SLOW_LIST, is_listed, read_slow_keys

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("slow_tests", ROOT / "scripts" / "slow_tests.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_entry_names_a_test_in_a_test_file():
    keys = read_slow_keys()
    assert keys
    for key in keys:
        module, test = key.split("::", 1)
        assert module.startswith("test_") and module.endswith(".py") and "/" not in module, key
        assert test.split("::")[-1].startswith("test_"), key


def test_an_entry_without_a_parameter_names_every_parameter_and_comments_are_not_entries(tmp_path):
    listing = tmp_path / "slow.txt"
    listing.write_text("# measured\ntest_a.py::test_b  # 3.0 s\n\ntest_a.py::test_c[two]\n")
    keys = read_slow_keys(listing)
    assert keys == {"test_a.py::test_b", "test_a.py::test_c[two]"}
    assert is_listed("test_a.py::test_b[one]", keys) == "test_a.py::test_b"
    assert is_listed("test_a.py::test_c[two]", keys) == "test_a.py::test_c[two]"
    assert is_listed("test_a.py::test_c[one]", keys) is None


def test_the_script_sums_each_tests_setup_call_and_teardown_under_its_file_name(tmp_path):
    report = tmp_path / "junit.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.gui.screens.test_run" name="test_x[a]" time="2.5"/>'
        '<testcase classname="tests.core.test_formats.TestLoad" name="test_y" time="0.25"/>'
        '</testsuite></testsuites>')
    assert _script().times_by_test(report) == {"test_run.py::test_x[a]": 2.5, "test_formats.py::TestLoad::test_y": 0.25}


def test_the_list_lives_beside_the_tests():
    assert SLOW_LIST == ROOT / "tests" / "slow_tests.txt"


def test_where_every_test_of_a_folder_is_over_the_limit_its_quickest_is_kept_for_test_fast():
    cases = {"test_a.py::test_1": ("tests.x", 3.0), "test_a.py::test_2": ("tests.x", 2.0),
             "test_b.py::test_3": ("tests.y", 3.0), "test_b.py::test_4": ("tests.y", 0.1)}
    assert _script().newly_slow(cases, set(), over=1.0) == {"test_a.py::test_1": 3.0, "test_b.py::test_3": 3.0}
    assert _script().newly_slow(cases, {"test_a.py::test_2"}, over=1.0) == {"test_b.py::test_3": 3.0}


class _Item:
    def __init__(self, nodeid: str, *marks: str):
        self.nodeid, self.marks = nodeid, set(marks)

    def get_closest_marker(self, name):
        return name if name in self.marks else None


def test_a_folder_whose_every_quick_test_the_list_took_is_refused_but_not_one_that_marks_itself_slow():
    from tests.conftest import folders_left_without_a_quick_test

    items = [_Item("tests/x/test_a.py::test_1", "slow"), _Item("tests/x/test_b.py::test_2", "slow"),
             _Item("tests/y/test_c.py::test_3", "slow"), _Item("tests/z/test_d.py::test_4", "slow"),
             _Item("tests/z/test_d.py::test_5", "netns")]
    listed = {"tests/x/test_a.py::test_1", "tests/z/test_d.py::test_4"}
    assert folders_left_without_a_quick_test(items, listed) == ["tests/x", "tests/z"]  # y marked itself
