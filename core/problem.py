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
