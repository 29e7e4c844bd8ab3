"""No test compares the system with itself where an independent reference exists (issue 30 item 4).

A test function that asserts ``==`` between the results of two runs of the system (two calls of its run
paths, e.g. a staggered run against a one-replica run) proves only that the two agree, not that either is
right; the references that exist are transformers' own ``generate`` (``tests.core.hf_reference``,
``model.generate``), EPD's ``reference_tokens`` (Llava's ``generate``) and a plain torch forward. Such a
test must also check one run against one of them, or be listed in ``SELF_COMPARISONS`` with why no
reference applies. The scan reads the tests' syntax only: a call's name decides what it is."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SYSTEM_RUNS = frozenset({
    "run_offload", "run_staggered", "generate", "generate_partitioned", "generate_with", "generate_encoded",
    "run_spatial", "run_and_record", "run_epd",
})
"""Bare-name calls that run the system (``coordinator.run`` too, below)."""
REFERENCES = frozenset({
    "hf_greedy_new_tokens", "hf_seeded_new_tokens", "hf_generate", "reference_tokens", "hf_logits",
})
"""Bare-name calls of an independent reference; any ``<model>.generate(...)`` (transformers') counts too."""
SELF_COMPARISONS: dict[str, str] = {}
"""``path::test`` -> why the test compares two runs of the system where no independent reference applies."""


def _is_system_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    if isinstance(f, ast.Name):
        return f.id in SYSTEM_RUNS
    return isinstance(f, ast.Attribute) and f.attr == "run" and isinstance(f.value, ast.Name) \
        and f.value.id in ("coordinator", "co", "coord")


def _is_reference_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return (isinstance(f, ast.Name) and f.id in REFERENCES) or (isinstance(f, ast.Attribute) and f.attr == "generate")


def _runs_in(expr: ast.AST, roots: dict[str, frozenset]) -> frozenset:
    """The system runs ``expr`` is built from: its own run calls (by position) and those of the names it reads."""
    out: set = set()
    for node in ast.walk(expr):
        if _is_system_call(node):
            out.add((node.lineno, node.col_offset))
        elif isinstance(node, ast.Name) and node.id in roots:
            out |= roots[node.id]
    return frozenset(out)


def self_comparisons(source: str) -> list[str]:
    """Names of the test functions in ``source`` that assert the results of two different system runs
    equal and check no run against an independent reference (a run's parts compared with each other,
    e.g. its events with its tokens, are one run)."""
    found = []
    for fn in ast.parse(source).body:  # module-level test functions (pytest's)
        if not isinstance(fn, ast.FunctionDef) or not fn.name.startswith("test"):
            continue
        if any(_is_reference_call(n) for n in ast.walk(fn)):
            continue
        roots: dict[str, frozenset] = {}
        for node in ast.walk(fn):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.For, ast.comprehension)) \
                    and getattr(node, "value", getattr(node, "iter", None)) is not None:
                runs = _runs_in(node.iter if isinstance(node, (ast.For, ast.comprehension)) else node.value, roots)
                targets = (node.targets if isinstance(node, ast.Assign) else [node.target])
                for name in (t.id for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)):
                    if runs:
                        roots[name] = roots.get(name, frozenset()) | runs
        for node in ast.walk(fn):
            if isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare) \
                    and any(isinstance(op, ast.Eq) for op in node.test.ops):
                sides = [r for r in (_runs_in(side, roots) for side in [node.test.left, *node.test.comparators]) if r]
                if len(sides) >= 2 and len(frozenset().union(*sides)) >= 2:
                    found.append(fn.name)
                    break
    return found


def test_the_scan_finds_a_system_compared_with_itself_and_passes_one_checked_against_a_reference():
    itself = '''
def test_two_replicas_are_one(cluster):
    two = run_staggered(cluster, m, ("c0", "c1"), mem, req)
    one = run_staggered(cluster, m, ("c0",), mem, req)
    assert two.tokens == one.tokens
'''
    checked = itself + "    assert [list(t) for t in one.tokens] == hf_greedy_new_tokens(m, enc, 4)\n"
    against_hf = '''
def test_one_run_is_hf(cluster):
    got = run_offload(cluster, m, "d", mem, req)
    assert [list(t) for t in got.tokens] == hf_greedy_new_tokens(m, enc, 4)
'''
    one_run = '''
def test_a_runs_tokens_match_its_events(cluster):
    run = run_offload(cluster, m, "d", mem, req)
    tokens = run.tokens
    assert len(tokens) == len(run.token_events)
'''
    assert self_comparisons(itself) == ["test_two_replicas_are_one"]
    assert self_comparisons(checked) == [] and self_comparisons(against_hf) == [] and self_comparisons(one_run) == []


def test_no_test_compares_the_system_with_itself_without_an_independent_reference():
    offenders = []
    for path in sorted(TESTS.rglob("test_*.py")):
        if path.resolve() == Path(__file__).resolve():
            continue
        rel, text = path.relative_to(TESTS).as_posix(), path.read_text()
        if text.count(".run(") + sum(text.count(f"{name}(") for name in SYSTEM_RUNS) < 2:
            continue  # fewer than two run calls: nothing to compare (parsed only when there are)
        offenders += [f"{rel}::{name}" for name in self_comparisons(text)
                      if f"{rel}::{name}" not in SELF_COMPARISONS]
    assert not offenders, ("these tests compare two runs of the system and check neither against an independent "
                           "reference (transformers' generate, tests.core.hf_reference): " + ", ".join(offenders))
