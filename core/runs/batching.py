"""Micro-batching of a run, decided in one place.

The plan says how many micro-batches its cost and memory were computed for
(``ShardPlan.micro_batches`` of ``micro_batch_size`` sequences). A run takes its count from
the plan unless the operator overrides it (``edgeshard run --micro-batches``, the Run
screen's Micro-batches control); the coordinator sends the resulting groups of sequences
to the source agent in ``StartRun.micro_batches``, the prediction simulates the same
groups, and the Run screen records the override with the run. Every mode, sequential
included, uses the same count: sequential runs the micro-batches one after another.
"""

from __future__ import annotations

from agents.protocol import KvReservation
from core.errors import FormatError
from core.planning.plan import ShardPlan


def micro_batch_count(plan: ShardPlan, override: int | None = None) -> int:
    """The run's number of micro-batches: the operator's ``override``, else the plan's."""
    if override is None:
        return max(1, plan.micro_batches)
    if override < 1:
        raise FormatError("micro-batches", f"must be at least 1, got {override} (leave it unset to use the plan's "
                          f"{plan.micro_batches})")
    return override


def split_micro_batches(n_sequences: int, k: int) -> tuple[tuple[int, ...], ...]:
    """Sequences 0..n-1 into k contiguous, near-equal micro-batches (no empty ones)."""
    if n_sequences < 1:
        raise FormatError("run request", f"needs at least one sequence, got {n_sequences}", "input_ids")
    k = max(1, min(k, n_sequences))
    base, extra = divmod(n_sequences, k)
    out, start = [], 0
    for i in range(k):
        size = base + (1 if i < extra else 0)
        out.append(tuple(range(start, start + size)))
        start += size
    return tuple(out)


def run_micro_batches(n_sequences: int, plan: ShardPlan, override: int | None = None) -> tuple[tuple[int, ...], ...]:
    """The groups of sequences a run of ``plan`` uses (what the source agent schedules)."""
    return split_micro_batches(n_sequences, micro_batch_count(plan, override))


def kv_reservation(groups: tuple[tuple[int, ...], ...], context_tokens: int) -> KvReservation:
    """The KV cache each stage reserves at load (``LoadShard.kv``) for a run of these groups of
    sequences up to ``context_tokens`` (padded prompt + generated) tokens."""
    if not groups or context_tokens < 1:
        raise FormatError("run request", f"needs sequences and context tokens (got {len(groups)} groups, "
                          f"{context_tokens} tokens)")
    return KvReservation(groups=len(groups), sequences=max(len(g) for g in groups), context_tokens=context_tokens)


def kv_covers(loaded: KvReservation, needed: KvReservation) -> bool:
    """Whether stages loaded with ``loaded`` can run what ``needed`` describes (nothing reserved:
    the cache grows, anything fits)."""
    if loaded.groups == 0:
        return True
    return (0 < needed.groups <= loaded.groups and needed.sequences <= loaded.sequences
            and needed.context_tokens <= loaded.context_tokens)


def batching_settings(plan: ShardPlan | None, override: int | None) -> dict:
    """What a recorded run keeps about its micro-batching: the count used, the plan's, and
    the operator's override (None: the plan's count was used)."""
    out: dict = {"micro_batches_override": override}
    if plan is not None:
        out.update(micro_batches=micro_batch_count(plan, override), plan_micro_batches=plan.micro_batches,
                   plan_micro_batch_size=plan.micro_batch_size)
    elif override is not None:
        out["micro_batches"] = override
    return out
