"""The predicted timeline of a run the operator is about to start (the Run screen).

Why not ``core.runs.simulator.simulate`` directly: the prediction must batch the prompts the
way the real run will (``core.runs.batching``: 5 prompts in 2
micro-batches are 3 + 2, not 3 + 3), and it must stay small enough to redraw on every
settings change: a 70B plan with 64 micro-batches × 4096 tokens is millions of events,
so only the first steps are predicted and ``note`` says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.runs.batching import run_micro_batches
from core.planning.plan import ShardPlan
from core.planning.problem import PlanningProblem
from core.reporting import Cancelled, Reporter
from core.runs.simulator import SimulationResult, simulate, simulate_speculative

MAX_STAGE_STEPS = 4096
"""At most this many (stage, micro-batch, step) computations are simulated: about three
timeline events each (receive wait, compute, send), so the GUI thread draws ~12k boxes at most."""


@dataclass(frozen=True)
class RunPrediction:
    result: SimulationResult
    group_sizes: tuple[int, ...]
    """Sequences per micro-batch, as the real run splits them."""
    steps_predicted: int
    steps_requested: int
    note: str = ""
    """Non-empty when only the first steps were predicted."""


@dataclass(frozen=True)
class PlanOrigin:
    """The technique's own problem and plan a run's ``ShardPlan`` was made from (``Technique.run_plan``):
    the Run screen predicts that run with the technique's own simulator (``Technique.simulate``), so an
    expert-offload run's ghosts are EdgeMoE's schedule with its storage reads, not layer sharding's."""

    technique: Any
    """The ``core.techniques.Technique`` (its ``simulate``, ``modes``, ``title``; core.runs never imports it)."""
    problem: Any
    plan: Any


def run_group_sizes(n_prompts: int, plan: ShardPlan, micro_batches: int | None = None) -> tuple[int, ...]:
    """Sequences per micro-batch of a real run of ``plan`` (``micro_batches``: the operator's
    override of the plan's count), in every mode."""
    return tuple(len(g) for g in run_micro_batches(max(1, n_prompts), plan, micro_batches))


def predict_run(problem: PlanningProblem, plan: ShardPlan, mode: str, n_prompts: int, micro_batches: int | None,
                max_new_tokens: int, max_stage_steps: int = MAX_STAGE_STEPS, speculation=None) -> RunPrediction:
    """Simulate the run's first steps (prefill included) with the real run's micro-batch split.
    ``speculation``: (``DraftFigures``, k) of a speculative run (one sequence): its trips are played
    (``simulate_speculative``), and ``note`` says so. ValueError: a stage of another technique's kind
    (its own simulator predicts it: ``predict_origin_run``; a replay whose technique's problem was not
    recorded has none)."""
    kinds = {getattr(s, "kind", "layers") for s in plan.stages} - {"layers"}
    if kinds:
        raise ValueError(f"the run's technique's own problem is not recorded with it (stages of kind "
                         f"{', '.join(sorted(kinds))}; the Run screen predicts it)")
    sizes = run_group_sizes(n_prompts, plan, micro_batches)
    steps = max(1, min(max_new_tokens, max_stage_steps // (len(sizes) * len(plan.stages))))
    if speculation is not None and speculation[1] > 0:
        draft, k = speculation
        result = simulate_speculative(problem, plan, draft, k, generated_tokens=steps)
        how = "timed" if draft.measured else "by proxy"
        return RunPrediction(result=result, group_sizes=(1,), steps_predicted=steps, steps_requested=max_new_tokens,
                             note=f"Predicted: speculative, k {k}, {len(result.tokens) - 1} tokens in "
                                  f"{sum(1 for e in result.events if e.kind == 'draft')} trips "
                                  f"(acceptance {draft.acceptance_rate:.2f}, draft {draft.token_s * 1e3:.1f} ms a token, {how}).")
    result = simulate(problem, plan, mode, micro_batch_sizes=sizes, generated_tokens=steps)
    note = ""
    if steps < max_new_tokens:
        note = (f"Predicted: the first {steps} of {max_new_tokens} steps "
                f"({len(sizes)} micro-batches; the rest repeats the decode step).")
    return RunPrediction(result=result, group_sizes=sizes, steps_predicted=steps,
                         steps_requested=max_new_tokens, note=note)


def run_prompt_tokens(model_dir: str, prompts) -> int | None:
    """Tokens per sequence of the run's prefill: its longest prompt's (a run pads its prompts to one
    width, ``core.runs.run_tokenizer``); None without a checkpoint whose tokenizer loads (the
    technique's problem then says)."""
    from core.errors import EdgeShardError
    from core.runs.run_tokenizer import encode_left_padded, load_run_tokenizer

    if not model_dir or not prompts:
        return None
    try:
        return encode_left_padded(load_run_tokenizer(model_dir), list(prompts)).width or None
    except (OSError, ValueError, EdgeShardError):
        return None


def predict_origin_run(origin: PlanOrigin, run_plan: ShardPlan, mode: str, n_prompts: int,
                       micro_batches: int | None, max_new_tokens: int, max_stage_steps: int = MAX_STAGE_STEPS,
                       speculation=None, prompt_tokens: int | None = None) -> RunPrediction:
    """The predicted timeline of ``run_plan``, made from ``origin``: a shard plan that is its technique's
    own plan (layer sharding) is simulated with the run's micro-batch split (``predict_run``); another
    technique's plan by its ``Technique.simulate`` for the tokens asked (the first ``max_stage_steps``
    at most), in ``mode`` when the technique has that mode, else its plan's own. ``prompt_tokens``: the
    run's prompt width (``run_prompt_tokens``), which that technique's prefill takes in place of its
    problem's (a profile's 16 tokens; None: the problem's)."""
    if origin.plan is run_plan or origin.plan == run_plan:
        return predict_run(origin.problem, run_plan, mode, n_prompts, micro_batches, max_new_tokens,
                           max_stage_steps, speculation)
    technique = origin.technique
    steps = max(1, min(max_new_tokens, max_stage_steps // max(1, len(run_plan.stages))))
    sizes = run_group_sizes(n_prompts, run_plan, micro_batches)  # the run's batches (a technique may take them)
    width = {} if prompt_tokens is None else {"prompt_tokens": prompt_tokens}
    result = technique.simulate(origin.problem, origin.plan, mode if mode in technique.modes else None,
                                generated_tokens=steps, micro_batch_sizes=sizes, **width)
    note = (f"Predicted: the first {steps} of {max_new_tokens} steps ({technique.title}'s schedule)."
            if steps < max_new_tokens else "")
    return RunPrediction(result=result, group_sizes=sizes, steps_predicted=steps, steps_requested=max_new_tokens,
                         note=note)


def predict_run_task(reporter: Reporter, *args, prompts_of: tuple[str, tuple[str, ...]] | None = None,
                     **kwargs) -> RunPrediction:
    """``predict_origin_run`` as long work for a worker (``fn(reporter, ...)``); ``prompts_of``: the run's
    (model_dir, prompts), whose width (``run_prompt_tokens``, a tokenizer: off the GUI thread) it predicts."""
    if reporter.cancel_requested():
        raise Cancelled()
    if prompts_of is not None:
        kwargs["prompt_tokens"] = run_prompt_tokens(*prompts_of)
    return predict_origin_run(*args, **kwargs)
