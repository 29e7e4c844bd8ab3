"""Plugs a run's event and token callbacks into the SessionStore.

The coordinator (or anything else emitting ``TimelineEvent``/``TokenEvent``) takes
``recorder.on_event`` and ``recorder.on_tokens`` as callbacks; they may fire on any
thread and only queue rows (the store's writer commits them in batches). Each item gets
the next per-run ``seq`` and its arrival time ``recv_s`` on the recorder's clock, so a
replay delivers the same items in the same order at the same pace as the live view.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from agents.protocol import TimelineEvent, TokenEvent
from core.planning.plan import ShardPlan
from core.planning.problem import PlanningProblem
from core.runs.metrics import RunFigures, compute_figures
from core.sessions.store import SessionStore


class RunRecorder:
    """Records one run: ``on_event``, ``on_tokens``, ``on_log``, then ``finish``."""

    def __init__(self, store: SessionStore, run_id: int, clock: Callable[[], float] = time.monotonic):
        store.run(run_id)  # an unknown run is a StoreError now, not at the first event
        self.store, self.run_id, self._clock = store, run_id, clock
        self._t0 = clock()
        self._seq = 0
        self._lock = threading.Lock()
        self.finished = False

    def _next(self) -> tuple[int, float]:
        with self._lock:
            seq = self._seq
            self._seq += 1
            return seq, self._clock() - self._t0

    def on_event(self, ev: TimelineEvent) -> None:
        seq, recv = self._next()
        self.store.append_event(self.run_id, seq, recv, ev)

    def on_tokens(self, tok: TokenEvent) -> None:
        seq, recv = self._next()
        self.store.append_tokens(self.run_id, seq, recv, tok)

    def on_log(self, device: str, line: str, level: str = "info", t_s: float | None = None) -> None:
        self.store.append_log(self.run_id, device, self._clock() - self._t0 if t_s is None else t_s, level, line)

    def finish(self, status: str, figures: dict[str, Any] | msgspec.Struct | None = None) -> RunFigures:
        """Flush, then store the status and figures: the run's ``core.runs.metrics``
        figures, with the caller's ``figures`` (e.g. the coordinator's own) added on top."""
        self.store.flush()
        items = self.store.timeline(self.run_id)
        computed = compute_figures([i.event for i in items if i.event is not None],
                                   [i.tokens for i in items if i.tokens is not None])
        merged = msgspec.to_builtins(computed)
        if figures is not None:
            merged.update(msgspec.to_builtins(figures))
        self.store.finish_run(self.run_id, status, merged)
        self.finished = True
        return computed


def record_simulation(store: SessionStore, session_id: int, problem: PlanningProblem, plan: ShardPlan,
                      result, plan_name: str = "") -> int:
    """Store a ``core.runs.simulator.SimulationResult`` as a run of kind "simulated".

    Layer sharding's prediction with its plan and settings; the timeline itself goes
    through ``append_predicted``, which any technique's prediction uses.
    """
    plan_id = store.add_plan(session_id, plan, plan_name)
    profile_id = store.add_profile(session_id, problem.profile)
    run_id = store.create_run(
        session_id, model=problem.profile.model.name, mode=result.mode, kind="simulated",
        plan_id=plan_id, profile_id=profile_id, problem=problem,
        settings={"micro_batches": result.micro_batches, "micro_batch_size": result.micro_batch_size,
                  "generated_tokens": result.generated_tokens, "prompt_tokens": problem.workload.prompt_tokens},
    )
    append_predicted(store, run_id, result.events, result.tokens)
    extra = {"steady_tokens_per_s": result.steady_tokens_per_s, "link_wait_s": result.link_wait_s}
    store.finish_run(run_id, "completed", {**msgspec.to_builtins(result.figures), **extra})
    return run_id


def append_predicted(store: SessionStore, run_id: int, events: Iterable[TimelineEvent],
                     tokens: Iterable[TokenEvent]) -> None:
    """Store any technique's predicted events and tokens as a real run would have reported them.

    Each event 'arrives' when it ends and each token when it reaches the source, so a
    replay of a prediction paces like a replay of a measurement.
    """
    items: list[tuple[float, int, Any]] = [(e.end_s, 0, e) for e in events]
    items += [(t.t_s, 1, t) for t in tokens]
    items.sort(key=lambda x: (x[0], x[1]))
    for seq, (at, _, item) in enumerate(items):
        if isinstance(item, TimelineEvent):
            store.append_event(run_id, seq, at, item)
        else:
            store.append_tokens(run_id, seq, at, item)
    store.flush()
