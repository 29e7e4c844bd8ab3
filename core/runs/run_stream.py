"""A run's values and its live stream: what a run is asked (``RunRequest``), what it gives
back (``RunResult``), where its stream goes while it runs (``RunSink``), and the run in
progress the stream is gathered into (``ActiveRun``).

Why apart from ``core.runs.coordinator``: the coordinator drives agents (load, start, stop,
recover); what arrives from them, and how it is mapped onto the coordinator's clock, is
the same whatever drove them. The public names are offered by ``core.runs.coordinator``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from agents.protocol import (
    RUN_MODES,
    EventBatch,
    Options,
    RunError,
    RunFinished,
    RunMode,
    SamplingSpec,
    TimelineEvent,
    TokenEvent,
    TokensProduced,
    storage_lane,
)
from core.devices.clock_sync import ClockEstimate, to_coordinator_clock
from core.planning.plan import ShardPlan
from core.runs import run_state
from core.runs.recovery import RecoveryRecord, Resume

Mode = RunMode
MODES = RUN_MODES
"""Re-exported from ``agents.protocol`` (the one definition of the run modes)."""


class RunSink(Protocol):
    """Where a run's live stream goes (the GUI bridge, the SessionStore, a JSONL file).

    Called on the coordinator's IO thread as batches arrive (about every 50 ms for
    events, at once for tokens); implementations must be quick and thread-safe. A sink with an
    ``on_events(events)`` is handed an agent's batch of events in one call instead (a server
    stores a batch in one hand-over to its writer thread).
    """

    def on_event(self, event: TimelineEvent) -> None: ...

    def on_tokens(self, tokens: TokenEvent) -> None: ...


class NullSink:
    def on_event(self, event: TimelineEvent) -> None:
        pass

    def on_tokens(self, tokens: TokenEvent) -> None:
        pass


class FanoutSink:
    """Forwards to several sinks (e.g. the store and the GUI)."""

    def __init__(self, *sinks: RunSink) -> None:
        self.sinks = [s for s in sinks if s is not None]

    def on_event(self, event: TimelineEvent) -> None:
        for s in self.sinks:
            s.on_event(event)

    def on_tokens(self, tokens: TokenEvent) -> None:
        for s in self.sinks:
            s.on_tokens(tokens)


class EventsFile:
    """A sink that appends every event of a run to a JSON-lines file (``--events`` of every technique's
    run verb): ``{"type": "timeline", "value": TimelineEvent}`` / ``{"type": "tokens", "value": TokenEvent}``
    (docs/formats.md), each line flushed as it is written. Thread-safe; ``close`` it (or use it as a context manager)."""

    def __init__(self, path) -> None:
        import msgspec

        self._file = open(path, "w")
        self._lock = threading.Lock()
        self._enc = msgspec.json.Encoder()

    def _write(self, kind: str, value) -> None:
        with self._lock:
            self._file.write(f'{{"type":"{kind}","value":{self._enc.encode(value).decode()}}}\n')
            self._file.flush()  # a reader (tail -f, the studio) sees each event as it happens

    def on_event(self, event: TimelineEvent) -> None:
        self._write("timeline", event)

    def on_tokens(self, tokens: TokenEvent) -> None:
        self._write("tokens", tokens)

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def __enter__(self) -> "EventsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class RunRequest:
    """Token-level input of one run (tokenization happens in ``core.runtime_session``)."""

    input_ids: tuple[tuple[int, ...], ...]
    """Left-padded, one row per sequence."""
    attention_mask: tuple[tuple[int, ...], ...]
    max_new_tokens: int
    mode: Mode = "sequential"
    micro_batches: int | None = None
    """An override of the plan's micro-batch count (``core.runs.batching``); None: the plan's."""
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    sampling: SamplingSpec = SamplingSpec()
    options: Options | None = None
    """A technique's run options, the source's ``StartRun.options`` (e.g. attention offloading's
    staggered pipelining, ``core.techniques.attention_offload.run.run_staggered``); None: none."""


@dataclass(frozen=True)
class RunResult:
    run_id: str
    tokens: tuple[tuple[int, ...], ...]
    """Generated ids per sequence (up to and including EOS)."""
    events: tuple[TimelineEvent, ...]
    token_events: tuple[TokenEvent, ...]
    clocks: dict[str, ClockEstimate]
    wall_s: float
    recoveries: tuple[RecoveryRecord, ...] = ()
    """Each lost device the run survived (``run(..., replan=)``), in order."""
    plan: ShardPlan | None = None
    """The plan the run finished on (the re-planned one after a recovery)."""


@dataclass
class ActiveRun:
    """A run in progress: its state machine, and the events and tokens its agents streamed,
    mapped onto the coordinator's clock. Fed from the link's IO thread and the run's own."""

    run_id: str
    t0: float
    """Coordinator clock (time.time()) at run start."""
    stages: dict[str, int]
    sink: RunSink
    state: run_state.RunState
    """Only ever replaced under ``lock`` (``advance``, ``apply``, a recovery's resume)."""
    ended: threading.Event = field(default_factory=threading.Event)
    """Set once ``state`` is terminal."""
    events: list[TimelineEvent] = field(default_factory=list)
    tokens: list[TokenEvent] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    helpers: frozenset[str] = frozenset()
    """Agents serving the run outside its stages (``Coordinator.run(helpers=)``): losing one ends it."""
    lost_helper: tuple[str, str] | None = None
    """(device, why) of the helper whose loss ended the run (``HelperLost``)."""
    resume: Resume | None = None
    """Set while a resumed segment runs: its micro-batches and steps map back onto the whole
    run's (``Resume.keys``, ``Resume.first_steps``)."""
    retain: bool = True
    """Keep its events and tokens (its ``RunResult``'s). An open run (``core.runs.open_run``), which serves for
    hours and whose result nobody reads, keeps none: every served token and event stayed in memory."""
    _last_end: dict[str, float] = field(default_factory=dict)
    """Per device, the end of its latest event (``last_heard``), kept either way."""

    def whole_run(self, micro_batch: int, step: int) -> tuple[int, int]:
        """(micro-batch, step) of the whole run for a segment's own numbering."""
        r = self.resume
        if r is None or micro_batch >= len(r.keys):
            return micro_batch, step
        return r.keys[micro_batch], r.first_steps[micro_batch] + step

    def advance(self, event: run_state.RunInput) -> None:
        """Feed ``event`` to the run's state machine (from any thread); ``ended`` once terminal."""
        with self.lock:
            self.state = run_state.apply(self.state, event)
            ended = run_state.is_terminal(self.state)
        if ended:
            self.ended.set()

    def apply(self, event: run_state.RunInput) -> None:
        """Feed ``event`` without ending the wait (a recovery's steps: the run goes on)."""
        with self.lock:
            self.state = run_state.apply(self.state, event)

    def emit(self, event: TimelineEvent) -> None:
        """Record an event the coordinator itself draws (a failure, a re-plan, a reload)."""
        with self.lock:
            self._heard([event])
        self.sink.on_event(event)

    def _heard(self, events: list[TimelineEvent]) -> None:
        """Under ``lock``: ``events`` kept (``retain``) and each device's latest end."""
        if self.retain:
            self.events.extend(events)
        for e in events:
            if e.device not in self._last_end or e.end_s > self._last_end[e.device]:
                self._last_end[e.device] = e.end_s

    def last_heard(self, device: str) -> float:
        """When the run last heard of ``device``'s work (its failure box starts there)."""
        with self.lock:
            return self._last_end.get(device, 0.0)

    def take_in(self, device: str, msg, clock_of: Callable[[str], ClockEstimate | None]) -> None:
        """What an agent streamed under this run's id: events and tokens onto the run's clock,
        recorded and passed to the sink; then the state machine hears of it."""
        if isinstance(msg, EventBatch) and msg.run_id == self.run_id:
            self._take_events(device, msg, clock_of)
        elif isinstance(msg, TokensProduced) and msg.run_id == self.run_id:
            mb, step = self.whole_run(msg.micro_batch, msg.step)
            ev = TokenEvent(
                micro_batch=mb,
                step=step,
                sequence_ids=msg.sequence_ids,
                token_ids=msg.token_ids,
                # no token precedes the run's start; an offset estimate (off by up to its
                # uncertainty) may place one there: kept at the start, as recv_wait starts are
                t_s=max(0.0, self._to_run_clock(clock_of(device), msg.t)),
            )
            if self.retain:
                with self.lock:
                    self.tokens.append(ev)
            self.sink.on_tokens(ev)
        if isinstance(msg, (EventBatch, TokensProduced, RunFinished, RunError)):
            self.advance(run_state.FromAgent(device, msg))

    def _take_events(self, device: str, msg: EventBatch, clock_of) -> None:
        # one estimate for the whole batch: heartbeats refine it meanwhile, and an event's
        # uncertainty must be the one its times were mapped with
        clock = clock_of(device)
        unc = clock.uncertainty_s if clock else 0.0
        events = []
        for e in msg.events:
            mb, step = self.whole_run(e.micro_batch, e.step)
            events.append(TimelineEvent(
                device=storage_lane(msg.device) if e.kind == "io" else msg.device,
                stage=msg.stage,
                kind=e.kind,
                phase=e.phase,
                step=step,
                micro_batch=mb,
                # a downstream stage starts waiting just before the source starts the run
                start_s=max(0.0, self._to_run_clock(clock, e.start)) if e.kind == "recv_wait"
                else self._to_run_clock(clock, e.start),
                end_s=self._to_run_clock(clock, e.end),
                nbytes=e.nbytes,
                peer=e.peer,
                clock_uncertainty_s=unc,
            ))
        with self.lock:
            self._heard(events)
        on_events = getattr(self.sink, "on_events", None)
        if on_events is not None:
            on_events(events)
        else:
            for ev in events:
                self.sink.on_event(ev)

    def _to_run_clock(self, clock: ClockEstimate | None, t_agent: float) -> float:
        return to_coordinator_clock(clock, t_agent) - self.t0
