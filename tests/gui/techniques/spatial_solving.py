"""Waiting for the spatial plan view's solves, which run on its workers (``solver``, ``comparer``)."""

from __future__ import annotations


def solved(qtbot, view, timeout_ms: int = 60_000):
    """``view`` once every solve and comparison it started has landed."""
    qtbot.waitUntil(lambda: not view.solver.is_busy() and not view.comparer.is_busy(), timeout=timeout_ms)
    return view
