"""The schedule of a run: which micro-batch step starts when, and what each stage does for it.

Written once, used twice: the agents execute it (``agents.agent``) and the simulator times
it (``core.runs.simulator``), so a predicted timeline and a real one do the same work in the
same order. Pure: no torch, no sockets, no clock.

Two parts:

- **the source's schedule** (``begin`` / ``on_returned``): the source (stage 0) starts each
  micro-batch's steps according to the run mode and learns that a step is done when its
  sampled tokens come back from the last stage. Step 0 is the prefill, steps 1.. decode.
  A micro-batch is finished after ``steps`` steps or earlier (every sequence hit EOS).

  - ``sequential``: one micro-batch at a time, start to finish: micro-batch m+1's prefill
    starts when micro-batch m is finished. Exactly one step is in flight in the pipeline.
  - ``bubbles``: every micro-batch starts its step s+1 only when all unfinished
    micro-batches have their step-s tokens back (a barrier per step: the bubbles).
  - ``no-bubbles``: a micro-batch starts its next step as soon as its own tokens are back.

  Sequential with more than one micro-batch: the agents ran micro-batch-major (each one
  to completion) while the simulator ran step-major (step s of every micro-batch, one at a
  time, then step s+1). Micro-batch-major is kept: it is what the agents did (the
  reference), it is what "sequential" means to an operator (requests served one after
  another, the first one's answer complete as early as possible), and it keeps exactly one
  micro-batch's KV cache growing at a time. Step-major would just be a slower way of
  running one big batch.

- **a stage's operations per step** (``step_operations``): a stage other than the source
  receives the hidden states, computes its units and sends the result on (the last stage
  samples and sends the tokens back to the source); the source computes and sends. Stages
  take steps first come, first served, and links are FIFO, so every stage performs the
  steps in the order the source started them, whatever the timing; ``stage_operations``
  lists that whole order per stage for a run where no micro-batch finishes early.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal, Sequence, Union

from agents.protocol import RUN_MODES

Payload = Literal["hidden", "tokens"]


def phase_of(step: int) -> str:
    return "prefill" if step == 0 else "decode"


@dataclass(frozen=True, slots=True)
class Step:
    """One micro-batch's step through the whole pipeline."""

    micro_batch: int
    step: int

    @property
    def phase(self) -> str:
        return phase_of(self.step)


@dataclass(frozen=True, slots=True)
class Receive:
    """Wait for a micro-batch step's data from ``from_stage``."""

    micro_batch: int
    step: int
    from_stage: int
    payload: Payload

    @property
    def phase(self) -> str:
        return phase_of(self.step)


@dataclass(frozen=True, slots=True)
class Compute:
    """Run units ``[units[0], units[1])`` on a micro-batch step; the last stage also samples."""

    micro_batch: int
    step: int
    units: tuple[int, int]
    samples: bool

    @property
    def phase(self) -> str:
        return phase_of(self.step)


@dataclass(frozen=True, slots=True)
class Send:
    """Hand a micro-batch step's output to ``to_stage`` (tokens go back to the source)."""

    micro_batch: int
    step: int
    to_stage: int
    payload: Payload

    @property
    def phase(self) -> str:
        return phase_of(self.step)


Operation = Union[Receive, Compute, Send]


def step_operations(stage: int, n_stages: int, units: tuple[int, int], step: Step) -> tuple[Operation, ...]:
    """What ``stage`` (of ``n_stages``, holding ``units``) does for ``step``, in order.

    A one-stage plan neither receives nor sends: its sampled tokens are already at the source.
    """
    mb, k = step.micro_batch, step.step
    last = stage == n_stages - 1
    ops: list[Operation] = []
    if stage > 0:
        ops.append(Receive(mb, k, stage - 1, "hidden"))
    ops.append(Compute(mb, k, (units[0], units[1]), last))
    if n_stages > 1:
        ops.append(Send(mb, k, (stage + 1) % n_stages, "tokens" if last else "hidden"))
    return tuple(ops)


# ------------------------------------------------------------------ the source's schedule
@dataclass(frozen=True, slots=True)
class SourceState:
    """What the source knows of a run's progress: per micro-batch, the last step started,
    the last step whose tokens came back, and whether it is finished."""

    mode: str
    steps: int
    started: tuple[int, ...]
    returned: tuple[int, ...]
    finished: tuple[bool, ...]

    @property
    def all_finished(self) -> bool:
        return all(self.finished)


def begin(mode: str, micro_batches: int, steps: int) -> tuple[SourceState, tuple[Step, ...]]:
    """The run's initial state and the steps the source starts at once.

    ``steps``: the most steps a micro-batch takes (max new tokens); 0 starts nothing.
    """
    if mode not in RUN_MODES:
        raise ValueError(f"unknown run mode {mode!r}; expected one of {', '.join(RUN_MODES)}")
    if micro_batches < 0:
        raise ValueError(f"a run needs a non-negative number of micro-batches, got {micro_batches}")
    idle = SourceState(mode, steps, (-1,) * micro_batches, (-1,) * micro_batches, (steps <= 0,) * micro_batches)
    if steps <= 0 or micro_batches == 0:
        return idle, ()
    first = (0,) if mode == "sequential" else tuple(range(micro_batches))
    return _started(idle, tuple(Step(mb, 0) for mb in first))


def on_returned(state: SourceState, micro_batch: int, step: int,
                finished_early: bool = False) -> tuple[SourceState, tuple[Step, ...]]:
    """``micro_batch``'s tokens of ``step`` are back: the new state and the steps to start now.

    ``finished_early``: every sequence of the micro-batch is done before ``state.steps``
    (EOS). Starting order within one call is by micro-batch index.
    """
    returned = list(state.returned)
    finished = list(state.finished)
    returned[micro_batch] = step
    finished[micro_batch] = finished[micro_batch] or finished_early or step + 1 >= state.steps
    state = SourceState(state.mode, state.steps, state.started, tuple(returned), tuple(finished))
    if state.mode == "no-bubbles":
        nxt = () if finished[micro_batch] else (Step(micro_batch, step + 1),)
    elif state.mode == "sequential":
        if not finished[micro_batch]:
            nxt = (Step(micro_batch, step + 1),)
        else:
            fresh = next((mb for mb, s in enumerate(state.started) if s < 0 and not finished[mb]), None)
            nxt = () if fresh is None else (Step(fresh, 0),)
    else:  # bubbles: only when every micro-batch in flight is back (a barrier), joined ones with them
        if any(s > r for s, r in zip(state.started, returned)):
            nxt = ()
        else:
            nxt = tuple(Step(mb, s + 1 if s >= 0 else 0) for mb, s in enumerate(state.started) if not finished[mb])
    return _started(state, nxt)


def join(state: SourceState, micro_batch: int) -> tuple[SourceState, tuple[Step, ...]]:
    """A micro-batch joins a running (open) run between steps: the new state and the steps to start now.

    ``micro_batch`` is a new index or a finished one's, reused: links are FIFO, so every stage sees
    the old group's last step before the new prefill. A new index past the next one leaves the
    indices below it idle (finished, never started) until they join: the caller owns its indices
    and may take any free one. ``no-bubbles`` starts its prefill at once; ``bubbles`` at the next
    barrier (with the others' next step), at once when nothing is in flight; ``sequential`` when no
    other micro-batch is unfinished (``on_returned`` starts it after the one running). An open
    run's micro-batches end by ``finished_early``."""
    n = len(state.started)
    if micro_batch < 0 or (micro_batch < n and not state.finished[micro_batch]):
        raise ValueError(f"micro-batch {micro_batch} cannot join: it is running or a negative index")
    if micro_batch > n:  # idle indices below it: never started, nothing in flight, free to join
        gap = micro_batch - n
        state = SourceState(state.mode, state.steps, state.started + (-1,) * gap, state.returned + (-1,) * gap,
                            state.finished + (True,) * gap)

    def put(values: tuple, value) -> tuple:
        return values[:micro_batch] + (value,) + values[micro_batch + 1:]

    state = SourceState(state.mode, state.steps, put(state.started, -1), put(state.returned, -1),
                        put(state.finished, False))
    others = [mb for mb in range(len(state.started)) if mb != micro_batch]
    if state.mode == "no-bubbles":
        now = True
    elif state.mode == "sequential":
        now = all(state.finished[mb] for mb in others)
    else:
        now = all(state.started[mb] <= state.returned[mb] for mb in others)
        if now:  # nothing in flight: the barrier is now, for the others' next step too
            return _started(state, tuple(Step(mb, state.started[mb] + 1 if mb != micro_batch else 0)
                                         for mb in range(len(state.started))
                                         if not state.finished[mb] and (mb == micro_batch or state.started[mb] >= 0)))
    return _started(state, (Step(micro_batch, 0),) if now else ())


def _started(state: SourceState, steps: tuple[Step, ...]) -> tuple[SourceState, tuple[Step, ...]]:
    if not steps:
        return state, steps
    started = list(state.started)
    for s in steps:
        started[s.micro_batch] = s.step
    return SourceState(state.mode, state.steps, tuple(started), state.returned, state.finished), steps


# -------------------------------------------------------------------- the whole order
def source_order(mode: str, micro_batches: int, steps: int) -> tuple[Step, ...]:
    """Every step in the order the source starts it, when no micro-batch finishes early."""
    return tuple(s for s in _trace(mode, micro_batches, steps) if isinstance(s, Step))


def stage_operations(units: Sequence[tuple[int, int]], mode: str, micro_batches: int,
                     steps: int) -> tuple[tuple[Operation, ...], ...]:
    """Per stage (holding ``units[j]``), every operation of a run in order, when no
    micro-batch finishes early. The source's token receipts sit where it handles them:
    after the steps it started before, before the steps they release."""
    n = len(units)
    out: list[list[Operation]] = [[] for _ in range(n)]
    for item in _trace(mode, micro_batches, steps):
        if isinstance(item, Step):
            for j in range(n):
                out[j].extend(step_operations(j, n, units[j], item))
        elif n > 1:
            out[0].append(Receive(item[0].micro_batch, item[0].step, n - 1, "tokens"))
    return tuple(tuple(ops) for ops in out)


def _trace(mode: str, micro_batches: int, steps: int):
    """Started steps and (returned step,) markers in the source's order: started steps go
    round the ring first in, first out, so their tokens come back in the order they started."""
    state, first = begin(mode, micro_batches, steps)
    in_flight = deque(first)
    yield from first
    while in_flight:
        done = in_flight.popleft()
        yield (done,)
        state, nxt = on_returned(state, done.micro_batch, done.step)
        in_flight.extend(nxt)
        yield from nxt
