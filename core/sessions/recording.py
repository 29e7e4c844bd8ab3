"""Plugs a run's event and token callbacks into the SessionStore.

The coordinator (or anything else emitting ``TimelineEvent``/``TokenEvent``) takes
``recorder.on_event`` and ``recorder.on_tokens`` as callbacks; they may fire on any
thread and only queue rows (the store's writer commits them in batches). Each item gets
the next per-run ``seq`` and its arrival time ``recv_s`` on the recorder's clock, so a
replay delivers the same items in the same order at the same pace as the live view.

``record_run`` is the one way a measured run enters the workspace (the GUI's Run screen and
``edgeshard run`` both use it), so a run looks the same in ``edgeshard sessions`` and the
Sessions screen whichever started it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgspec

from agents.protocol import TimelineEvent, TokenEvent
from core.planning.plan import ShardPlan
from core.planning.problem import PlanningProblem
from core.runs.metrics import RunFigures, compute_figures
from core.sessions.origin import RecordedOrigin
from core.sessions.store import SessionStore


class RunRecorder:
    """Records one run: ``on_event``, ``on_tokens``, ``on_log``, then ``finish``."""

    def __init__(self, store: SessionStore, run_id: int, clock: Callable[[], float] = time.monotonic, *,
                 keep: bool = False):
        store.run(run_id)  # an unknown run is a StoreError now, not at the first event
        self.store, self.run_id, self._clock = store, run_id, clock
        self._t0 = clock()
        self._seq = 0
        self._lock = threading.Lock()
        self.finished = False
        self._kept: list[tuple[float, TimelineEvent | TokenEvent]] | None = [] if keep else None
        """With ``keep``: what it recorded, (arrival, item) in order, which ``finish`` computes the figures from
        instead of reading the run's timeline back (a server finishing a run per request)."""

    @property
    def t0(self) -> float:
        """Its clock's reading when it started: arrival times (``recv_s``) count from it."""
        return self._t0

    def _next(self, item: TimelineEvent | TokenEvent) -> tuple[int, float]:
        with self._lock:
            seq = self._seq
            self._seq += 1
            recv = self._clock() - self._t0
            if self._kept is not None:
                self._kept.append((recv, item))
            return seq, recv

    def on_event(self, ev: TimelineEvent) -> None:
        seq, recv = self._next(ev)
        self.store.append_event(self.run_id, seq, recv, ev)

    def on_tokens(self, tok: TokenEvent) -> None:
        seq, recv = self._next(tok)
        self.store.append_tokens(self.run_id, seq, recv, tok)

    def on_log(self, device: str, line: str, level: str = "info", t_s: float | None = None) -> None:
        self.store.append_log(self.run_id, device, self._clock() - self._t0 if t_s is None else t_s, level, line)

    def finish(self, status: str, figures: dict[str, Any] | msgspec.Struct | None = None, *,
               shared: Iterable[tuple[float, TimelineEvent]] = ()) -> RunFigures:
        """Flush, then store the status and figures: the run's ``core.runs.metrics``
        figures, with the caller's ``figures`` (e.g. the coordinator's own) added on top. With ``keep``
        they come from what it kept and ``shared`` (the events its windows on shared streams hold,
        (arrival, event) on its clocks), merged as its timeline would give them back, and the writer
        stores them after its rows, in its next batch (no flush and commits of its own: ~0.3 ms a run)."""
        if self._kept is None:
            self.store.flush()
            items = [(i.event, i.tokens) for i in self.store.timeline(self.run_id)]
        else:
            with self._lock:
                own = list(self._kept)
            items = [(i, None) if isinstance(i, TimelineEvent) else (None, i)
                     for _, i in sorted(own + list(shared), key=lambda x: x[0])]
        computed = compute_figures([e for e, _ in items if e is not None], [t for _, t in items if t is not None])
        merged = msgspec.to_builtins(computed)
        if figures is not None:
            merged.update(msgspec.to_builtins(figures))
        self.store.finish_run(self.run_id, status, merged, queued=self._kept is not None)
        self.finished = True
        return computed


@dataclass
class RecordedRun:
    """The run ``record_run`` is recording: feed ``recorder`` the run's callbacks and set
    ``status`` (completed / stopped) once known; it stays "failed" otherwise."""

    session_id: int
    run_id: int
    recorder: RunRecorder
    status: str = "failed"
    final_plan: ShardPlan | None = None
    """The plan the run finished on when a lost device re-planned it (``RunResult.plan``): recorded beside
    the one it started on (``RunInfo.final_plan_id``)."""


def check_workspace(workspace: str | os.PathLike | None) -> None:
    """Open (creating, migrating) the workspace and close it: an entrance calls this before it starts
    agents, so a path that cannot be a workspace fails in milliseconds, not after the run.
    None or "": the run is not recorded."""
    if workspace:
        SessionStore(workspace).close()


def add_run_figures(workspace: str | os.PathLike, run_id: int, figures: dict[str, Any]) -> None:
    """Merge figures measured once a run was recorded (its wire bytes, read from the agents after it
    ended) into its recorded figures."""
    with SessionStore(workspace) as store:
        store.add_figures(run_id, figures)


@contextmanager
def record_run(workspace: str | os.PathLike, *, model: str, mode: str, settings: dict[str, Any],
               session_id: int | None = None, session_name: str = "", plan: ShardPlan | None = None,
               problem: PlanningProblem | None = None, origin: RecordedOrigin | None = None) -> Iterator[RecordedRun]:
    """Record one measured run in the workspace file, whatever happens to it.

    Opens the store, adds a session (``session_name``) unless ``session_id`` is given, the
    plan and profile when known and the run row; yields a ``RecordedRun``. On leaving, even by
    an exception, the run is finished with its ``status``, its figures and its ``final_plan``, and the store closed.
    ``settings`` should hold ``prompts`` and ``lanes``: the replay draws from them. ``origin``: the
    technique's own problem and plan ``plan`` was made from (what predicts the replay).
    """
    store = SessionStore(workspace)
    try:
        if session_id is None:
            session_id = store.create_session(session_name or f"Run {time.strftime('%Y-%m-%d %H:%M')}")
        plan_id = store.add_plan(session_id, plan) if plan is not None else None
        profile_id = store.add_profile(session_id, problem.profile) if problem is not None else None
        run_id = store.create_run(session_id, model=model, mode=mode, kind="measured", plan_id=plan_id,
                                  profile_id=profile_id, problem=problem, settings=settings)
        if origin is not None:
            store.set_origin(run_id, origin)
        run = RecordedRun(session_id, run_id, RunRecorder(store, run_id))
    except BaseException:
        store.close()
        raise
    try:
        yield run
    finally:
        try:
            if run.final_plan is not None:
                store.set_final_plan(run.run_id, run.final_plan)
            run.recorder.finish(run.status)
        finally:
            store.close()


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
