"""An open run: one run of the loaded plan that micro-batches join and leave between steps
(continuous batching across the pipeline; the agents' side is ``agents.techniques.open_run``).

``OpenRun.start`` runs ``Coordinator.run`` on its own thread with the open-run options (every
stage's ``StartRun`` carries them), so the run state machine, the agents' stream onto the
coordinator's clock and a lost agent's detection are the same as any run's. ``join`` sends a
``JoinRun`` to the last stage (its sampling), then to the source (the prompts), and returns the
sequence ids the tokens will carry; ``leave`` sends a ``LeaveRun`` (the source retires a micro-batch
whose every sequence is done, and every stage drops its KV cache at once). The caller owns the
micro-batch indices (``free_slot`` / ``release``): an index may be joined again as soon as its
requests are done; the source waits for the old micro-batch's retire itself.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence

from agents.protocol import ErrorReply, SamplingSpec
from agents.techniques.open_run.messages import JoinRun, LeaveRun, OpenRunOptions
from core.errors import EdgeShardError, RunFailed
from core.planning.plan import ShardPlan
from core.runs import run_state
from core.runs.coordinator import Coordinator, RunRequest, RunSink

MAX_OPEN_TOKENS = 1 << 20


def left_padded(rows: Sequence[Sequence[int]], pad: int) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """(input_ids, attention_mask) of ``rows``, left-padded to the longest, as HF's batches are."""
    width = max(len(r) for r in rows)
    ids = tuple((pad,) * (width - len(r)) + tuple(r) for r in rows)
    mask = tuple((0,) * (width - len(r)) + (1,) * len(r) for r in rows)
    return ids, mask


class OpenRun:
    """One open run over ``plan`` (loaded on ``coordinator``) until ``close`` or a failure."""

    def __init__(self, coordinator: Coordinator, plan: ShardPlan, sink: RunSink, *, slots: int, mode: str,
                 eos_token_ids: tuple[int, ...], pad_token_id: int, on_end=None, on_busy=None) -> None:
        self.coordinator, self.plan, self.sink = coordinator, plan, sink
        self.slots, self.mode, self.pad = slots, mode, pad_token_id
        self.eos = eos_token_ids
        self.devices = [s.device for s in plan.stages]
        self.run_id = ""
        self.t0 = 0.0
        """The run's clock origin (coordinator ``time.time()``): event and token times count from it."""
        self.failure: Exception | None = None
        self.on_end = on_end or (lambda run: None)
        """Told (on the run's thread) once the run ended after it had started: a failure or a stop."""
        self.ended = threading.Event()
        self.on_busy = on_busy or (lambda in_flight: None)
        """Told the micro-batches in flight whenever a join or a release changed them, before the join is
        sent (e.g. ``core.devices.cpu_placement.CpuPlacer.on_busy`` places a local cluster's agents)."""
        self._busy: set[int] = set()
        self._telling_busy = threading.Lock()  # the last to tell reads the count last: no stale count wins
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ its life
    def start(self, timeout_s: float = 30.0) -> None:
        """Start the run on every stage; returns once they all run it (``RunFailed`` if they do not)."""
        request = RunRequest(input_ids=(), attention_mask=(), max_new_tokens=MAX_OPEN_TOKENS, mode=self.mode,
                             eos_token_ids=self.eos, pad_token_id=self.pad, options=OpenRunOptions(slots=self.slots))
        self._thread = threading.Thread(target=self._serve, args=(request,), name="edgeshard-open-run", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.ended.is_set():
            run = self.coordinator.active_run
            if run is not None and not isinstance(run.state, (run_state.Starting, run_state.Loading)):
                self.run_id, self.t0 = run.run_id, run.t0
                run.retain = False  # its stream goes to the sink; kept, every token served would stay in memory
                return
            time.sleep(0.002)
        raise RunFailed(f"the open run did not start: {self.failure or 'no answer'}")

    def _serve(self, request: RunRequest) -> None:
        try:
            self.coordinator.run(self.plan, request, self.sink)
        except Exception as err:  # a stop (close) or a failure: the caller reads ``failure``
            self.failure = err
        finally:
            self.ended.set()
        if self.run_id:
            self.on_end(self)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the run (its stages drop every KV cache) and wait for its thread."""
        if self._thread is None:
            return
        if not self.ended.is_set():
            self.coordinator.stop()
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and not self.ended.is_set()

    def seconds(self) -> float:
        """Now on the run's clock (what its events and tokens count from)."""
        return time.time() - self.t0

    # ------------------------------------------------------------------ slots
    def free_slot(self) -> int | None:
        """The lowest micro-batch index not in use (None: every slot is busy)."""
        with self._lock:
            return next((i for i in range(self.slots) if i not in self._busy), None)

    def release(self, slot: int) -> None:
        """Every request of ``slot`` is done: the index may be joined again."""
        with self._lock:
            changed = slot in self._busy
            self._busy.discard(slot)
        if changed:
            self._tell_busy()

    def _tell_busy(self) -> None:
        with self._telling_busy:
            self.on_busy(self.busy)

    @property
    def busy(self) -> int:
        with self._lock:
            return len(self._busy)

    # ------------------------------------------------------------------ joins and leaves
    def join(self, slot: int, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
             sampling: SamplingSpec, *, first_step: int = 0, key: int = 0, on_ids=None,
             grow: bool = False, on_refused=None, on_accepted=None) -> tuple[int, ...]:
        """Join ``prompts`` as micro-batch ``slot``; the sequence ids their tokens will carry (``on_ids`` is
        told them before the join is sent, so no token can arrive before its caller knows whose it is).
        ``grow``: ``slot`` is running and the rows join it at its next step, one batched forward with its rows
        (a free ``slot`` is taken as a fresh join); any sampling may join any micro-batch: the last stage
        samples each row by its own join's sampling, seed and step count (``agents.techniques.open_run``).
        ``on_refused``: not waited for; told ``RunFailed`` (on the coordinator's IO thread) if a stage refuses
        the join. The prefill starts as soon as the source has it, where waiting for each stage's reply in
        turn cost two round trips of a request's TTFT; the source's join goes out first, and the last stage
        waits for its own should the prefill overtake it (``agents.techniques.open_run.session``). Without
        ``on_refused`` both replies are awaited, the last stage's first. ``on_accepted``: with ``on_refused``,
        told (on the IO thread) once every stage has accepted it: the join is out, the prefill under way."""
        if not self.alive:
            raise RunFailed(f"the open run ended: {self.failure or 'stopped'}")
        with self._lock:
            if not 0 <= slot < self.slots or (slot in self._busy and not grow):
                raise ValueError(f"slot {slot} is busy or out of range")
            added = slot not in self._busy
            self._busy.add(slot)
            seq = tuple(next(self._ids) for _ in prompts)
        if added:
            self._tell_busy()
        if on_ids is not None:
            on_ids(seq)
        ids, mask = left_padded(prompts, self.pad)
        msg = JoinRun(run_id=self.run_id, micro_batch=slot, sequence_ids=seq, max_new_tokens=tuple(max_new_tokens),
                      input_ids=ids, attention_mask=mask, sampling=sampling, first_step=first_step, key=key, grow=grow)
        asks = [(self.devices[0], msg)]
        if len(self.devices) > 1:  # the last stage's sampler first: the prefill reaches it after this
            history = sampling.uses_history
            asks.insert(0, (self.devices[-1], JoinRun(
                run_id=self.run_id, micro_batch=slot, sequence_ids=seq, max_new_tokens=tuple(max_new_tokens),
                input_ids=ids if history else (), attention_mask=mask if history else (), sampling=sampling,
                first_step=first_step, key=key, grow=grow)))
        if on_refused is not None:
            replies = _JoinReplies(len(asks), on_refused, on_accepted or (lambda: None))
            for device, m in reversed(asks):  # the source's first: its prefill starts the request's first token
                self.coordinator.request_async(device, m).add_done_callback(
                    lambda fut, device=device: replies.reply(device, fut))
            return seq
        try:
            for device, m in asks:
                self._ask(device, m)
        except EdgeShardError:
            if not grow:
                self.release(slot)
            raise
        return seq

    def leave(self, sequence_ids: Sequence[int]) -> None:
        """The sequences' clients left: the source feeds them no more (not waited for)."""
        if self.alive and sequence_ids:
            self.coordinator.request_async(self.devices[0], LeaveRun(run_id=self.run_id,
                                                                     sequence_ids=tuple(sequence_ids)))

    def _ask(self, device: str, msg) -> None:
        reply = self.coordinator.link.await_reply(device, self.coordinator.request_async(device, msg),
                                                  self.coordinator.request_timeout_s, "joining the open run")
        if isinstance(reply, ErrorReply):
            raise RunFailed(f"{device} refused the join ({reply.code}): {reply.message}", device)


class _JoinReplies:
    """The stages' replies to a join not waited for: ``on_refused`` is told once if any stage refused it,
    else ``on_accepted`` once every stage has accepted it (on the coordinator's IO thread)."""

    def __init__(self, stages: int, on_refused, on_accepted) -> None:
        self.left, self.on_refused, self.on_accepted = stages, on_refused, on_accepted
        self.refused = False
        self._lock = threading.Lock()

    def reply(self, device: str, fut) -> None:
        try:
            reply = fut.result()
        except Exception as err:  # no reply (the link closed): the run's end tells the requests
            reply = ErrorReply(code="no_reply", message=str(err))
        with self._lock:
            self.left -= 1
            refused = isinstance(reply, ErrorReply) and not self.refused
            self.refused = self.refused or refused
            accepted = self.left == 0 and not self.refused
        if refused:
            self.on_refused(RunFailed(f"{device} refused the join ({reply.code}): {reply.message}", device))
        elif accepted:
            self.on_accepted()
