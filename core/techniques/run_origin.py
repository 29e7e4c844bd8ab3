"""A recorded run's origin (the technique's own problem and plan) back as a ``PlanOrigin``, and the
prediction a replay draws from it: the same ghosts the live run drew.

Why here: ``core.sessions`` stores the origin as JSON it cannot decode (it sits below the
techniques); each technique names its types (``Technique.problem_type``/``plan_type``), and only
this layer may ask the registry for them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from core.errors import EdgeShardError, StoreError
from core.runs.prediction import PlanOrigin, predict_origin_run, predict_run
from core.sessions.origin import RecordedOrigin
from core.sessions.store import RunInfo, SessionStore
from core.techniques import technique_named


def recorded_origin(origin: PlanOrigin) -> RecordedOrigin | None:
    """What the workspace keeps of ``origin``; None for a technique that does not name its types."""
    t = origin.technique
    if getattr(t, "problem_type", None) is None or getattr(t, "plan_type", None) is None:
        return None
    return RecordedOrigin.of(t.name, origin.problem, origin.plan)


def stored_origin(store: SessionStore, run_id: int) -> tuple[RecordedOrigin | None, str]:
    """(``run_id``'s stored origin, "") or (None, "No prediction: <why>") when the store cannot read it:
    a damaged origin costs a replay its prediction, not the replay."""
    try:
        return store.origin_of(run_id), ""
    except StoreError as err:
        return None, f"No prediction: {err}"


def plan_origin(recorded: RecordedOrigin) -> PlanOrigin:
    """The stored origin decoded with its technique's types; ``EdgeShardError`` (an unknown technique)
    or ``ValueError`` (a document its types refuse) say why it cannot predict."""
    technique = technique_named(recorded.technique)
    if technique.problem_type is None or technique.plan_type is None:
        raise ValueError(f"{technique.title} does not say how to read its recorded problem")
    try:
        problem = msgspec.json.decode(recorded.problem, type=technique.problem_type)
        plan = msgspec.json.decode(recorded.plan, type=technique.plan_type)
    except msgspec.DecodeError as err:
        raise ValueError(f"the recorded {technique.title} problem or plan is unreadable ({err})") from None
    return PlanOrigin(technique, problem, plan)


def replay_prediction(info: RunInfo, problem, plan, origin: RecordedOrigin | None) -> tuple[tuple, str]:
    """The predicted events of a recorded run and a note, or ((), why not): what the Sessions screen's
    "Show predicted" draws under the replay. With an origin: what the live Run screen predicted from it
    (``predict_origin_run`` with the run's plan, mode, prompts, their width, micro-batch override and tokens), or the
    technique's ``simulate`` of it for a run without a shard plan (spatial, EPD); without one, layer
    sharding's prediction of the stored plan and problem (runs recorded before schema v3)."""
    s = info.settings
    # a live run stores its prompts and max_new_tokens; a simulated one its batch and token counts
    micro_batches = int(s.get("micro_batches") or 1)
    prompts = len(s.get("prompts") or ()) or micro_batches * int(s.get("micro_batch_size") or 1)
    tokens = int(s.get("max_new_tokens") or s.get("generated_tokens") or 1)
    override: Any = s["micro_batches_override"] if "micro_batches_override" in s else micro_batches
    try:
        if origin is not None:
            source = plan_origin(origin)
            if plan is None:
                t = source.technique
                return tuple(t.simulate(source.problem, source.plan, info.mode if info.mode in t.modes else None)
                             .events), ""
            prediction = predict_origin_run(source, plan, info.mode, prompts, override, tokens,
                                            prompt_tokens=s.get("prompt_tokens"))
            return tuple(prediction.result.events), prediction.note
        if problem is None or plan is None:
            return (), "No prediction: the run has no stored plan and profile."
        if info.kind == "simulated":  # re-simulate with the recorded batching, as it was made
            from core.runs.simulator import simulate

            return tuple(simulate(problem, plan, info.mode, micro_batches=micro_batches,
                                  micro_batch_size=int(s.get("micro_batch_size") or 1),
                                  generated_tokens=tokens).events), ""
        prediction = predict_run(problem, plan, info.mode, prompts, micro_batches, tokens)
    except (EdgeShardError, ValueError) as exc:
        return (), f"No prediction: {exc}"
    return tuple(prediction.result.events), prediction.note
