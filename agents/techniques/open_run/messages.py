"""An open run's wire: the ``StartRun`` options that open it, the requests that join and leave it,
and the data kind that retires a finished micro-batch's KV caches down the ring."""

from __future__ import annotations

from typing import ClassVar

from agents.envelope import (
    MAX_NEW_TOKENS,
    MAX_ROWS,
    Message,
    Options,
    SamplingSpec,
    ints_problem,
    sampling_problem,
)

MAX_SLOTS = 1024
"""Micro-batch indices an open run may hold at once."""

RETIRE = "retire"
"""Data kind: the source's micro-batch ``DataHeader.micro_batch`` is finished; each stage drops its
KV cache for it and passes the frame on (the last stage drops and ends it there)."""

SHRINK = "shrink"
"""Data kind: the source's micro-batch ``DataHeader.micro_batch`` goes on with only the rows its one
int64 tensor lists (the others are done); each stage keeps those rows of its KV cache and passes the
frame on, before the micro-batch's next step."""


class OpenRunOptions(Options, frozen=True, tag="open_run"):
    """``StartRun.options`` of a run that starts with no micro-batch and does not end when its
    micro-batches finish: micro-batches join (``JoinRun``) and leave (``LeaveRun``) between steps
    until the run is stopped (``StopRun``)."""

    slots: int = 16
    every_stage: ClassVar[bool] = True
    """Every stage's ``StartRun`` carries them (each stage runs its part of the open run)."""
    """The most micro-batches in the run at once (a ``JoinRun`` beyond them is refused)."""

    def problem(self) -> str:
        return "" if 1 <= self.slots <= MAX_SLOTS else f"slots must be in [1, {MAX_SLOTS}], got {self.slots}"


class JoinRun(Message, frozen=True, tag="join_run"):
    """A micro-batch joins open run ``run_id`` as index ``micro_batch`` (a new one, or a finished
    one's). The source gets the prompts (left-padded) and starts the prefill as the run's mode says;
    the last stage gets the sampling (and the prompts when its sampler needs them), before the source.
    Sequence ids are the coordinator's, echoed in ``TokensProduced``."""

    run_id: str
    micro_batch: int
    sequence_ids: tuple[int, ...]
    max_new_tokens: tuple[int, ...]
    """Per sequence: it is finished after this many tokens (or an EOS token)."""
    input_ids: tuple[tuple[int, ...], ...] = ()
    attention_mask: tuple[tuple[int, ...], ...] = ()
    sampling: SamplingSpec = SamplingSpec()
    first_step: int = 0
    """The step of the whole generation this prefill's token is (a resumed request's tokens so far):
    the sampler's draws are keyed by it, so sampling continues where it stopped."""
    key: int = 0
    """The sampler's key (a row's draws depend on its seed, key, place in this join and its own step
    count only, not on its neighbours nor on when it joined)."""
    grow: bool = False
    """The rows join micro-batch ``micro_batch`` while it runs (with any sampling: the last stage samples
    each row by its own join's): the source prefills them within its next step, beside the running rows'
    next token; if that micro-batch has ended meanwhile they start it afresh. Sent to the last stage too
    (in order)."""

    def problem(self) -> str:
        n = len(self.sequence_ids)
        problem = (sampling_problem(self.sampling)
                   or ints_problem("sequence_ids", self.sequence_ids, 0, 1 << 40, MAX_ROWS)
                   or ints_problem("max_new_tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS, n, n))
        if problem:
            return problem
        if not 0 <= self.micro_batch < MAX_SLOTS or not 0 <= self.first_step <= MAX_NEW_TOKENS \
                or not 0 <= self.key < 1 << 31:
            return "micro_batch, first_step or key out of range"
        if self.input_ids:
            width = len(self.input_ids[0])
            if len(self.input_ids) != n or len(self.attention_mask) != n or width < 1 \
                    or any(len(r) != width for r in (*self.input_ids, *self.attention_mask)):
                return f"input_ids and attention_mask must be {n} rows of one width"
            if any(any(t < 0 for t in r) for r in self.input_ids) \
                    or any(any(m not in (0, 1) for m in r) for r in self.attention_mask):
                return "token ids must be >= 0 and the mask 0/1"
        return ""


class LeaveRun(Message, frozen=True, tag="leave_run"):
    """Sequences leave open run ``run_id`` (their clients went away): the source feeds them no more
    tokens, and a micro-batch whose every sequence is done is retired (its KV caches dropped on every
    stage) once its step in flight is back."""

    run_id: str
    sequence_ids: tuple[int, ...]

    def problem(self) -> str:
        return ints_problem("sequence_ids", self.sequence_ids, 0, 1 << 40, MAX_ROWS)


OPEN_RUN_MESSAGES = (JoinRun, LeaveRun)
