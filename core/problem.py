"""A planning problem: a profile plus who holds the prompt and what is to be served."""

from __future__ import annotations

from typing import Literal

import msgspec

from core.profile import Profile

PROBLEM_FORMAT = "edgeshard.problem"
PROBLEM_VERSION = 1


class Workload(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    prompt_tokens: int
    generated_tokens: int
    batch_size: int = 1
    """Sequences served together (for throughput: micro_batch_size × micro_batches)."""
    micro_batch_size: int | None = None
    """Fixed micro-batch size; None lets the throughput solver choose it."""
    micro_batches: int | None = None
    """Fixed number of micro-batches in flight; None lets the throughput solver choose."""

    @property
    def context_tokens(self) -> int:
        """Tokens a KV cache must hold per sequence at the end of generation."""
        return self.prompt_tokens + self.generated_tokens


class PlanningProblem(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    format: Literal["edgeshard.problem"] = PROBLEM_FORMAT
    version: int = PROBLEM_VERSION
    name: str = ""
    profile: Profile
    source: str
    """Device that holds the prompt: stage 0 (with the embedding) must run there."""
    workload: Workload
    excluded_devices: tuple[str, ...] = ()
    """Devices the operator does not want used (privacy, maintenance)."""
    memory_headroom: float = 0.0
    """Fraction of every device's budget kept free (0.1 = plan within 90 %)."""


def problem_errors(problem: PlanningProblem) -> list[str]:
    """Every inconsistency of a problem beyond its types (see ``profile_errors``)."""
    from core.profile import profile_errors

    out = [e.replace("$.", "$.profile.", 1) for e in profile_errors(problem.profile)]
    ids = set(problem.profile.cluster.device_ids())
    if problem.source not in ids:
        out.append(f"$.source: {problem.source!r} is not a device of the cluster")
    elif problem.source not in {t.device for t in problem.profile.times}:
        out.append(f"$.source: no compute times for {problem.source!r}")
    wl = problem.workload
    if wl.prompt_tokens < 1:
        out.append("$.workload.prompt_tokens: must be at least 1")
    if wl.generated_tokens < 0:
        out.append("$.workload.generated_tokens: must not be negative")
    if wl.batch_size < 1:
        out.append("$.workload.batch_size: must be at least 1")
    for name in ("micro_batch_size", "micro_batches"):
        v = getattr(wl, name)
        if v is not None and not 1 <= v <= wl.batch_size:
            out.append(f"$.workload.{name}: must be between 1 and the batch size ({wl.batch_size})")
    if wl.micro_batch_size and wl.micro_batches and wl.micro_batch_size * wl.micro_batches > wl.batch_size:
        out.append("$.workload: micro_batch_size × micro_batches exceeds batch_size")
    if not 0.0 <= problem.memory_headroom < 1.0:
        out.append("$.memory_headroom: must be in [0, 1)")
    return out


def check_problem(problem: PlanningProblem, source: str = "<problem>") -> PlanningProblem:
    """Raise ``FormatError`` (file, field, problem) for the first inconsistency; return the problem."""
    from core.errors import FormatError

    errors = problem_errors(problem)
    if errors:
        field, _, msg = errors[0].partition(": ")
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        raise FormatError(source, msg + more, field)
    return problem
