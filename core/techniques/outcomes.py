"""The row every technique's strategy gives Compare: one base its outcome types extend.

Each technique keeps its own outcome type (its plan and cost differ, and so does what reads as
latency and tokens per second); the fields they all share, and how a strategy that produced no
plan is recorded, live here once.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec


class StrategyOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """The shared fields of ``core.techniques.StrategyOutcomeLike``; a technique subclasses it with
    its typed ``plan`` (and cost) and the ``latency_s`` / ``tokens_per_s`` its cost gives."""

    strategy: str
    objective: str
    status: str
    """optimal | ok | oom | invalid | failed"""
    error: str = ""
    elapsed_s: float = 0.0

    @classmethod
    def failed(cls, strategy: str, objective: str, error: str, *, started: float | None = None):
        """The row of a strategy that produced no plan; ``started`` (a ``perf_counter`` reading)
        gives its elapsed time, None leaves it 0 (refused before it ran)."""
        elapsed = 0.0 if started is None else time.perf_counter() - started
        return cls(strategy=strategy, objective=objective, status="failed", error=error, elapsed_s=elapsed)


class PerTokenOutcome(StrategyOutcome, frozen=True, kw_only=True):
    """An outcome whose ``cost`` has ``latency_per_token_s``: one token a step, so tokens/s is its inverse."""

    cost: Any = None

    @property
    def latency_s(self) -> float | None:
        return self.cost.latency_per_token_s if self.cost else None

    @property
    def tokens_per_s(self) -> float | None:
        return 1.0 / self.cost.latency_per_token_s if self.cost else None


__all__ = ["PerTokenOutcome", "StrategyOutcome"]
