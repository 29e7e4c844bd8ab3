"""Attention offloading's staggered pipelining schedule: which compute replica runs each slice of
a micro-batch's chain of steps and layers (Lamina). Pure: no torch, no sockets, no clock.

A micro-batch's chain is cut at every attention into slices (``steps · layers + 1``: the last is
the tail, the last step's head).
"""

from __future__ import annotations

from dataclasses import dataclass

from agents.schedule import phase_of

#
# Lamina's schedules: ``micro_batches`` batches share one pool of memory devices and
# ``replicas`` compute devices each hold the whole dense part. A batch's generation is a chain
# of *slices*: slice k (k < steps·layers) is the dense work up to the attention of layer
# k mod layers of step k // layers (the post-attention part of the layer before, or for a
# layer 0 of a decode step the head and sampling of the step before and the embedding, then the
# norm and q/k/v projections), followed by that attention on every memory device; the last
# slice (k = steps·layers, the *tail*) only finishes the last step (head, sampling).
# Slices are issued round-robin over the batches (global index g = k·n + b) and
#
# - ``fixed``: batch b always runs on replica b mod c (a replica with more batches than another
#   leaves that one idle: Lamina's bubbles);
# - ``rotational``: slice g runs on replica g mod c, so consecutive slices of one batch move from
#   replica to replica and the replicas take turns (Lamina's rotational staggering);
#
# and every tail runs on replica 0 (the source, which reports the run's tokens). Each replica
# performs its slices in global order; a slice waits for its batch's previous slice (its residual
# and attention outputs). The agents execute this order (this room's ``staggered``)
# and the simulator (core.techniques.attention_offload.simulator) times it.

STAGGERED_SCHEDULES: tuple[str, ...] = ("fixed", "rotational")


@dataclass(frozen=True, slots=True)
class Slice:
    """Slice ``index`` of ``micro_batch``'s chain, on replica ``replica``."""

    micro_batch: int
    index: int
    replica: int
    layers: int
    steps: int

    @property
    def is_tail(self) -> bool:
        return self.index == self.steps * self.layers

    @property
    def step(self) -> int:
        """The step the slice's attention belongs to (the tail: the last step, which it finishes)."""
        return self.steps - 1 if self.is_tail else self.index // self.layers

    @property
    def layer(self) -> int:
        """The layer whose attention follows the slice (the tail: ``layers``, none)."""
        return self.layers if self.is_tail else self.index % self.layers

    @property
    def phase(self) -> str:
        return phase_of(self.step)


def slice_replica(schedule: str, replicas: int, micro_batches: int, steps: int, layers: int,
                  micro_batch: int, index: int) -> int:
    """Which replica runs slice ``index`` of ``micro_batch`` (see above)."""
    if schedule not in STAGGERED_SCHEDULES:
        raise ValueError(f"unknown staggered schedule {schedule!r}: one of {', '.join(STAGGERED_SCHEDULES)}")
    if replicas < 1 or micro_batches < 1 or steps < 1 or layers < 1:
        raise ValueError("a staggered schedule needs replicas, micro-batches, steps and layers >= 1")
    if not (0 <= micro_batch < micro_batches and 0 <= index <= steps * layers):
        raise ValueError(f"slice {index} of micro-batch {micro_batch} is outside the schedule")
    if index == steps * layers:
        return 0
    if schedule == "fixed":
        return micro_batch % replicas
    return (index * micro_batches + micro_batch) % replicas


def staggered_slices(schedule: str, replicas: int, micro_batches: int, steps: int,
                     layers: int) -> tuple[Slice, ...]:
    """Every slice of the run in global (issue) order; a replica's own order is this one filtered."""
    return tuple(Slice(b, k, slice_replica(schedule, replicas, micro_batches, steps, layers, b, k), layers, steps)
                 for k in range(steps * layers + 1) for b in range(micro_batches))
