"""What a run on the Run screen is: its settings, the backend that runs it, and the worker job that
runs and records it (``run_and_record``). No widgets here: the Run screen (``gui.screens.run``)
builds settings from its controls and starts the job on its worker.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from agents.protocol import RUN_MODES
from core.errors import RunFailed, ShardOverBudget
from core.reporting import Cancelled, Reporter
from core.runs.coordinator import FanoutSink, RunSink

MODES = RUN_MODES
MODE_HELP = {
    "sequential": "One micro-batch at a time, start to finish (lowest latency per token)",
    "bubbles": "Micro-batches pipelined; every step waits for all micro-batches (bubbles)",
    "no-bubbles": "Each micro-batch starts its next step as soon as its token is back (highest throughput)",
}


@dataclass(frozen=True)
class RunSettings:
    """What the operator asked for on the Run screen."""

    model_dir: str
    prompts: tuple[str, ...]
    max_new_tokens: int
    mode: str
    micro_batches: int | None
    """The operator's override of the plan's micro-batch count; None: the plan's."""
    send_weights: bool = False
    """Send each agent its stage's weights (core.runs.weights) instead of loading from its disk."""
    on_failure: str = "replan"
    """When a device of the run is lost: "replan" (over the survivors, same tokens) or "stop"."""
    technique_options: dict = field(default_factory=dict)
    """The plan's technique's own run options (attention offloading: ``compute_replicas``,
    ``schedule``), handed to its ``run_generation``; recorded with the run."""
    repetition_penalty: float = 1.0
    """HF's repetition_penalty for the greedy text (1 = off; core.runs.generation.GenerationSettings)."""
    no_repeat_ngram_size: int = 0
    """HF's no_repeat_ngram_size: no n-gram of this size is generated twice (0 = off; ``edgeshard run
    --no-repeat-ngram-size``)."""
    frequency_penalty: float = 0.0
    """OpenAI's frequency_penalty in [-2, 2] (0 = off; ``edgeshard run --frequency-penalty``)."""
    presence_penalty: float = 0.0
    """OpenAI's presence_penalty in [-2, 2] (0 = off; ``edgeshard run --presence-penalty``)."""
    presenter_pace: bool = False
    """Generate all ``max_new_tokens`` past EOS (``GenerationSettings.ignore_eos``): a run long enough to watch."""
    draft_dir: str = ""
    """Speculative decoding's draft checkpoint ("" = plain decoding; ``edgeshard run --draft``)."""
    speculate_k: int | None = None
    """Tokens the draft proposes a trip (1-8); None: auto, the cost model's k (``--speculate auto``)."""
    speculate_seed: int = 0
    """0: greedy; else speculative sampling at temperature 1 with this seed (``--temperature 1 --seed``)."""


REPETITION_PENALTY_RANGE = (1.0, 2.0)
"""What the Run screen offers (below 1 rewards repeating: not offered there; the CLI takes it)."""
NO_REPEAT_NGRAM_RANGE = (0, 64)
"""What the Run screen offers (the CLI's and ``GenerationSettings``' range; 0 = off)."""

DEFAULT_PROMPTS = ("The edge devices worked together to", "Once upon a time")
"""The Run screen's prompts until the operator (or the demo, with its own) changes them."""


class RunBackend(Protocol):
    """Runs the partitioned model for the Run screen (the demo cluster, or real agents).

    ``run`` blocks its (worker) thread until the generation ends, streaming into ``sink``;
    it raises an ``EdgeShardError`` for what the operator can fix and ``Cancelled`` (or
    ``RunFailed``) once ``reporter.cancel_requested()`` turns true. ``stop`` may be called
    from the GUI thread at any time to end the current run quickly.
    """

    def lanes(self) -> list[str]: ...

    def run(self, settings: RunSettings, sink: RunSink, reporter: Reporter) -> Any: ...

    def stop(self) -> None: ...


def lane_notes(backend: RunBackend, settings: RunSettings) -> dict[str, str]:
    """Each lane's role in a run of ``settings`` (a backend may say: ``lane_notes(settings)``;
    attention offloading's compute replicas and attention lanes), shown and recorded with it."""
    notes = getattr(backend, "lane_notes", None)
    return dict(notes(settings)) if notes is not None else {}


def run_and_record(reporter: Reporter, backend: RunBackend, settings: RunSettings, sink: RunSink,
                   workspace: str = "", session_id: int | None = None, plan=None, problem=None,
                   model_name: str = "", origin=None) -> dict:
    """Worker-thread job: run ``settings`` on ``backend`` and record it in ``workspace``.
    ``origin``: the ``PlanOrigin`` that predicted it, recorded so its replay is predicted the same way.

    Reports ``{"session_id", "run_id"}`` as a partial result as soon as the run row exists.
    The recorded status is completed / stopped / failed, whatever happens. Returns what the
    backend said of the run (its recoveries, the plan it ended on) with the recorded ids.
    """
    if not workspace:
        return _run_backend(reporter, backend, settings, sink)
    from core.runs.batching import batching_settings
    from core.runs.prediction import run_prompt_tokens
    from core.sessions.recording import record_run

    from core.techniques import technique_of_plan
    from core.techniques.run_origin import recorded_origin

    technique = technique_of_plan(plan) if plan is not None else "layer-sharding"
    # a technique with its own schedule (attention offloading's staggering) used no pipeline mode
    mode = settings.mode if technique == "layer-sharding" else "sequential"
    with record_run(workspace, model=model_name or Path(settings.model_dir).name or "?", mode=mode,
                    settings={**asdict(settings), "prompts": list(settings.prompts), "lanes": backend.lanes(),
                              "technique": technique, "mode": mode,
                              "lane_notes": lane_notes(backend, settings),
                              **batching_settings(plan, settings.micro_batches),
                              # the prompts' width its technique's prediction takes (the replay's too)
                              **({"prompt_tokens": run_prompt_tokens(settings.model_dir, settings.prompts)}
                                 if origin is not None else {})},
                    session_id=session_id, session_name=f"Studio {time.strftime('%Y-%m-%d %H:%M')}",
                    plan=plan, problem=problem,
                    origin=recorded_origin(origin) if origin is not None else None) as run:
        ids = {"session_id": run.session_id, "run_id": run.run_id}
        reporter.partial_result(ids)
        try:
            said = _run_backend(reporter, backend, settings, FanoutSink(sink, run.recorder))
        except Cancelled:
            run.status = "stopped" if reporter.cancel_requested() else "failed"
            raise
        run.status = "completed"
        run.final_plan = said.get("recovered_plan")  # the plan a lost device's re-plan finished the run on
    if said.get("wire") is not None:  # read from the agents once the run ended, as `edgeshard run` records it
        from core.sessions.recording import add_run_figures

        add_run_figures(workspace, ids["run_id"], {"wire": said["wire"]})
    return {**said, **ids}


AUTO_SOLVE_ADVICE = ("Auto-solve on the Plan screen (Ctrl+R) makes a plan within every device's budget "
                     "(Profile cluster first if the profile is older than the devices' limits)")


def start_refusals(problem, plan, offline: tuple[str, ...] = ()) -> list[str]:
    """Why Start must refuse ``plan`` before any work (empty: it may run): what the Plan screen
    flags for a layer-sharding plan (memory over budget, coverage, source: the cost model's
    violations) and, for any technique, a stage on an offline device. Each line says what to do."""
    from core.planning.plan import offline_problems
    from core.techniques import technique_of_plan

    if plan is None and problem is None:  # Auto-solve would only say to profile first
        return ["There is no plan yet: Profile cluster (Devices ▸ Profile cluster, Ctrl+P) measures the devices "
                "and makes one, or load a plan (File ▸ Load plan…)."]
    if plan is None:
        return ["There is no plan yet: Auto-solve on the Plan screen (Ctrl+R), or load one."]
    problems = []
    if (problem is not None and technique_of_plan(plan) == "layer-sharding"
            and plan.model == problem.profile.model.name):
        import msgspec

        from core.planning.cost import evaluate

        # the plan's placement for one sequence: the run batches its own prompts (its micro-batches
        # may differ from the planned workload's), and its agents check the KV cache at load
        one = msgspec.structs.replace(problem, workload=msgspec.structs.replace(problem.workload, batch_size=1))
        problems += evaluate(one, msgspec.structs.replace(plan, micro_batches=1, micro_batch_size=1)).violations
    problems += offline_problems(plan, offline)
    if problems:
        problems.append("The Plan screen flags this plan: " + AUTO_SOLVE_ADVICE + ", or edit it there.")
    return problems


def _run_backend(reporter: Reporter, backend: RunBackend, settings: RunSettings, sink: RunSink) -> dict:
    """Run to the end; a run ended by Stop (however the backend ended it) raises ``Cancelled``.
    An agent refusing a shard over its budget advises the studio's fix (the agent's own words are
    for the command line)."""
    try:
        said = backend.run(settings, sink, reporter)
    except ShardOverBudget as err:
        if reporter.cancel_requested():
            raise Cancelled() from None
        raise ShardOverBudget(f"{err.reason}. {AUTO_SOLVE_ADVICE}.", err.device) from None
    except RunFailed:
        if reporter.cancel_requested():
            raise Cancelled() from None
        raise
    if reporter.cancel_requested():
        raise Cancelled()
    return said if isinstance(said, dict) else {}
