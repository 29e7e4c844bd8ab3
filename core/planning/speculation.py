"""What speculative decoding buys a plan: predicted tokens/s from ``k``, the draft's cost and its
acceptance rate, and the choice of ``k`` (or none).

Why a model of its own: a plain decode step pays every stage and every hop for one token
(``core.planning.cost``: L = Σ C_j + Σ T_j). A speculative trip pays the draft ``k`` times on the
source, then every stage once for ``k + 1`` positions (a short prefill over the cache) and every
hop once with ``k + 1`` positions' activations, and commits on average

    E(k) = (1 − α^(k+1)) / (1 − α)     tokens  (k + 1 at α = 1)

with α the draft's per-token acceptance rate (measured on held-out text, stored with the draft:
``core.models.draft_distillation``). Speculation pays when E(k) / trip(k) > 1 / L; the choice of
``k`` is the argmax over 1..``MAX_AUTO_K``, or 0 (plain decoding) when no ``k`` beats it.

The draft runs on the source, or on another stage's device the run names (two more hops
a trip: the committed tokens to it, its proposals back: ``draft_hops_s``; ``choose_draft`` picks the
device). The draft's cost is what profiling timed on that device (``Profile.draft_times``: ``edgeshard profile
--draft``), else a proxy: its units are the target's kinds (the embedding, ``layers``
decoder blocks, the head) at the same widths when it is a cut-down copy, so one draft token costs
what those units cost on the draft's device in the target's profile (``draft_token_s``); a draft of
another shape can pass its own measured figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from core.planning.cost import _factors, _times, next_device, stage_compute_s, stage_output_bytes, step_time_s, transfer_s
from core.devices.profile import interpolate
from core.planning.plan import ShardPlan
from core.planning.problem import PlanningProblem

MAX_AUTO_K = 8
"""``--speculate auto`` looks at k in 1..8: beyond, E(k) barely grows at the α of useful drafts."""


@dataclass(frozen=True)
class DraftFigures:
    """A draft as the cost model sees it: its acceptance rate and one proposed token's time where it runs."""

    acceptance_rate: float
    token_s: float
    measured: bool = False
    """``token_s`` was timed on the draft's device (``Profile.draft_times``); False: ``draft_token_s``'s proxy."""
    device: str = ""
    """The plan's stage device that drafts ("": the source). Another one adds two hops a trip
    (``draft_hops_s``) and ``token_s`` is its own."""

    def __post_init__(self) -> None:
        if not (0.0 <= self.acceptance_rate <= 1.0 and math.isfinite(self.token_s) and self.token_s >= 0):
            raise ValueError(f"acceptance rate in [0, 1] and a finite cost >= 0, got {self.acceptance_rate}, {self.token_s}")


@dataclass(frozen=True)
class SpeculationChoice:
    """The planner's answer for one plan: ``k`` (0: plain decoding) and both predictions."""

    k: int
    plain_tokens_s: float
    speculative_tokens_s: float
    """At ``k`` (equal to plain when ``k`` is 0)."""
    tokens_per_trip: float

    @property
    def speedup(self) -> float:
        return self.speculative_tokens_s / self.plain_tokens_s if self.plain_tokens_s > 0 else 0.0


def expected_tokens_per_trip(alpha: float, k: int) -> float:
    """E(k): the tokens one trip commits (the accepted proposals and the target's own token)."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def draft_token_s(problem: PlanningProblem, plan: ShardPlan, layers: int, device: str = "") -> float:
    """One draft token on ``device`` ("": the source), by proxy: the target's embedding, ``layers``
    decoder blocks (their mean time) and head there, plus the device's once-per-step overhead."""
    times = _times(problem, device or plan.stages[0].device)
    n = problem.profile.model.num_units
    blocks = [times.decode_time(u, 1) for u in range(1, n - 1)]
    mean_block = sum(blocks) / len(blocks) if blocks else 0.0
    return (times.decode_time(0, 1) + layers * mean_block + times.decode_time(n - 1, 1)
            + times.stage_overhead_time("decode", 0, n))


def measured_draft_token_s(problem: PlanningProblem, device: str, draft: str) -> float | None:
    """Draft ``draft``'s token as timed on ``device`` by profiling (``Profile.draft_times``), or None."""
    for t in problem.profile.draft_times:
        if t.device == device and t.draft == draft:
            return t.token_s
    return None


def positions_s(times, stage, positions: int, factors=None) -> float:
    """A stage's compute for ``positions`` new tokens at once over its cache: one decode step at 1,
    the profiled prefill at its token counts, linear between (a verify of a few positions is
    dominated by the per-call cost a decode step pays; the profile's own rule below its smallest
    prefill sample, proportional scaling, would call 4 positions half of 8)."""
    decode = stage_compute_s(times, stage, "decode", 1, factors)
    counts = [c for c in times.prefill_token_counts if c > 1]
    if positions <= 1 or not counts:
        return decode * max(1, positions)
    xs = (1, *counts)
    ys = (decode, *(stage_compute_s(times, stage, "prefill", c, factors) for c in counts))
    return interpolate(xs, ys, positions)


def verify_trip_s(problem: PlanningProblem, plan: ShardPlan, positions: int) -> float:
    """One trip of ``positions`` tokens through every stage (``positions_s``) and every hop
    (``positions`` tokens' activations; the last stage returns ``positions`` token ids)."""
    total = 0.0
    for j, st in enumerate(plan.stages):
        total += positions_s(_times(problem, st.device), st, positions, _factors(problem, st, "prefill"))
        total += transfer_s(problem, st.device, next_device(plan, j), stage_output_bytes(problem, st, positions))
    return total


TOKEN_BYTES = 8
"""A token id on the wire (int64)."""


def draft_hops_s(problem: PlanningProblem, plan: ShardPlan, draft: DraftFigures, k: int) -> float:
    """A draft on another device than the source: per trip, the tokens committed since the last ask
    (E(k) on average) go to it and its ``k`` proposals come back (0 for a draft on the source)."""
    source = plan.stages[0].device
    if not draft.device or draft.device == source:
        return 0.0
    committed = expected_tokens_per_trip(draft.acceptance_rate, k)
    return (transfer_s(problem, source, draft.device, committed * TOKEN_BYTES)
            + transfer_s(problem, draft.device, source, k * TOKEN_BYTES))


def trip_s(problem: PlanningProblem, plan: ShardPlan, draft: DraftFigures, k: int) -> float:
    """A whole trip: ``k`` draft tokens where the draft runs (and the hops to it and back), then the
    verify of ``k + 1`` positions."""
    return k * draft.token_s + draft_hops_s(problem, plan, draft, k) + verify_trip_s(problem, plan, k + 1)


def speculative_tokens_s(problem: PlanningProblem, plan: ShardPlan, draft: DraftFigures, k: int) -> float:
    """Predicted decode tokens/s of one sequence with ``k`` proposals a trip (k = 0: plain decoding)."""
    if k == 0:
        return 1.0 / step_time_s(problem, plan, "decode", 1)
    return expected_tokens_per_trip(draft.acceptance_rate, k) / trip_s(problem, plan, draft, k)


def predicted_run_s(problem: PlanningProblem, plan: ShardPlan, draft: DraftFigures, k: int, new_tokens: int) -> float:
    """Predicted wall time of a run generating ``new_tokens``: the prefill (its first token), then
    the rest at the decode rate of ``k`` (0: plain)."""
    prefill = step_time_s(problem, plan, "prefill", 1)
    return prefill + max(0, new_tokens - 1) / speculative_tokens_s(problem, plan, draft, k)


def choose_k(problem: PlanningProblem, plan: ShardPlan, draft: DraftFigures, max_k: int = MAX_AUTO_K) -> SpeculationChoice:
    """The ``k`` in 1..``max_k`` with the most predicted tokens/s, or 0 when plain decoding is faster."""
    plain = speculative_tokens_s(problem, plan, draft, 0)
    best_k, best = 0, plain
    for k in range(1, max_k + 1):
        rate = speculative_tokens_s(problem, plan, draft, k)
        if rate > best:
            best_k, best = k, rate
    return SpeculationChoice(k=best_k, plain_tokens_s=plain, speculative_tokens_s=best,
                             tokens_per_trip=expected_tokens_per_trip(draft.acceptance_rate, best_k))


def choose_draft(problem: PlanningProblem, plan: ShardPlan, drafts: list[DraftFigures],
                 max_k: int = MAX_AUTO_K) -> tuple[DraftFigures, SpeculationChoice]:
    """Of the same draft's figures on several devices, the one with the most predicted tokens/s at
    its own best ``k`` (the first on a tie: list the source first to keep it when nothing gains)."""
    if not drafts:
        raise ValueError("no device to draft on")
    best = None
    for d in drafts:
        choice = choose_k(problem, plan, d, max_k)
        if best is None or choice.speculative_tokens_s > best[1].speculative_tokens_s:
            best = (d, choice)
    return best


__all__ = ["MAX_AUTO_K", "DraftFigures", "SpeculationChoice", "choose_draft", "choose_k", "draft_hops_s", "draft_token_s",
           "expected_tokens_per_trip",
           "measured_draft_token_s", "predicted_run_s", "speculative_tokens_s", "trip_s", "verify_trip_s"]
