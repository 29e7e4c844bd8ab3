"""What predicts a recorded run: the technique's own problem and plan it was made from.

Why stored with the run: a technique other than layer sharding runs a ``ShardPlan`` made from its
own plan (``Technique.run_plan``), and only its own problem and plan predict that run
(``core.runs.prediction.PlanOrigin``); without them a replay had "No prediction". The store keeps
them as JSON it does not interpret: ``core.sessions`` sits below ``core.techniques``, so the
technique's types decode them there (``core.techniques.run_origin``).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

ORIGIN_FORMAT = "edgeshard.run-origin"


class RecordedOrigin(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A run's ``PlanOrigin`` as stored in the workspace (``runs.origin_json``, schema v3)."""

    format: Literal["edgeshard.run-origin"] = ORIGIN_FORMAT
    version: int = 1
    technique: str
    """``Technique.name``: whose ``problem_type``/``plan_type`` the two documents are."""
    problem: msgspec.Raw
    plan: msgspec.Raw

    @classmethod
    def of(cls, technique: str, problem: Any, plan: Any) -> RecordedOrigin:
        return cls(technique=technique, problem=msgspec.Raw(msgspec.json.encode(problem)),
                   plan=msgspec.Raw(msgspec.json.encode(plan)))
