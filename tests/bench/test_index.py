"""bench/README.md is the index of bench/: every script is in it, and it names no script that is gone.

And a script moved under bench/investigations/ still finds the bench modules it imports
(``runtime``, ``runtime_threads``, ...): run as ``python bench/investigations/x.py`` only its own
folder is on ``sys.path``, unless it puts bench/ there itself.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
ROW = re.compile(r"^\|\s*`([\w/]+\.py)`\s*\|", re.M)


def _scripts() -> set[str]:
    return {p.relative_to(BENCH).as_posix() for p in BENCH.rglob("*.py")
            if p.name != "__init__.py" and "__pycache__" not in p.parts}


def _indexed() -> set[str]:
    return set(ROW.findall((BENCH / "README.md").read_text()))


def test_every_bench_script_is_in_the_index():
    missing = sorted(_scripts() - _indexed())
    assert not missing, f"add a row for each to bench/README.md (what figure it owns, where it is quoted): {missing}"


def test_the_index_names_no_script_that_does_not_exist():
    gone = sorted(_indexed() - _scripts())
    assert not gone, f"bench/README.md lists scripts that are not in bench/: {gone}"


def _imported_bench_modules(path: Path, bench_modules: set[str]) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & bench_modules


def _puts_bench_on_sys_path(path: Path) -> bool:
    """Whether the script assigns into ``sys.path`` with ``parents[1]`` (bench/, seen from investigations/)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Subscript) and ast.unparse(t.value) == "sys.path" for t in node.targets):
            return "parents[1]" in ast.unparse(node.value)
    return False


def test_an_investigation_finds_the_bench_modules_it_imports():
    top = {p.stem for p in BENCH.glob("*.py")}
    investigations = {p.stem for p in (BENCH / "investigations").glob("*.py")}
    unreachable = []
    for script in sorted((BENCH / "investigations").glob("*.py")):
        wanted = _imported_bench_modules(script, top | investigations)
        reachable = investigations | (top if _puts_bench_on_sys_path(script) else set())
        unreachable += [f"{script.name} imports {m}" for m in sorted(wanted - reachable)]
    assert not unreachable, unreachable
