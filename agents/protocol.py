"""The one definition of the wire format between coordinator and agents.

Messages are versioned ``msgspec.Struct``s decoded strictly; tensors travel as raw
frames beside a small header (dtype, shape), never pickled. ``TimelineEvent`` is also
what the simulator predicts and what the SessionStore records, so live, predicted and
replayed timelines are drawn from one type.
"""

from __future__ import annotations

from typing import Literal

import msgspec

PROTOCOL_VERSION = 1

EventKind = Literal["compute", "send", "recv_wait"]
"""compute: a stage running its units; send: putting an activation (or token ids) on a
link, ``peer`` is the receiver; recv_wait: a stage idle waiting for its input."""

Phase = Literal["prefill", "decode"]


class TimelineEvent(msgspec.Struct, frozen=True, kw_only=True, array_like=False):
    """One box on the pipeline timeline.

    Times are seconds on the coordinator's clock, relative to the run's start (agents'
    own clocks are mapped through the estimated offset before events are stored).
    ``step`` is 0 for prefill and k for the k-th decode step.
    """

    device: str
    stage: int
    kind: EventKind
    phase: Phase
    step: int
    micro_batch: int
    start_s: float
    end_s: float
    nbytes: int = 0
    peer: str = ""
    clock_uncertainty_s: float = 0.0

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


class TokenEvent(msgspec.Struct, frozen=True, kw_only=True):
    """Tokens produced at one step for one micro-batch, as the source received them."""

    micro_batch: int
    step: int
    sequence_ids: tuple[int, ...]
    """Global index of each sequence (prompt) in the run."""
    token_ids: tuple[int, ...]
    text: tuple[str, ...] = ()
    """Decoded text piece per sequence (filled by the coordinator, which has the tokenizer)."""
    t_s: float = 0.0
