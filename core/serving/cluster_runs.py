"""Requests become micro-batches of the cluster's open run: the same coordinator, stage run and
recording as ``edgeshard run``, with the plan loaded once and one run kept open.

``ServedModel`` owns what a server keeps between requests: the coordinator (its agents hold
the loaded plan), the open run (``core.runs.open_run``: requests join it between steps and leave
it when done, their KV caches dropped at once), the tokenizer, the stop tokens, the run settings
the server was started with, and the workspace session its requests are recorded in. ``admit``
turns a parsed body into a ``ServedRequest`` (the chat template applied, the prompt tokenized,
its length checked against the model's context: 413); ``start_batch`` joins a group of them as
one micro-batch; tokens are routed to their request by sequence id. Each request is recorded as
its own run (``core.serving.request_records``), listed by ``edgeshard sessions`` and replayable like
any run. A lost agent
fails the requests in the run with 503, or, with ``--on-failure replan``, re-plans over the survivors, loads the new plan and joins every request again where its tokens
stopped (prompt plus tokens so far, its sampler's key and step kept: the same tokens).
"""

from __future__ import annotations

import itertools
import json
import logging
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import msgspec

from agents.protocol import TimelineEvent, TokenEvent
from core.errors import EdgeShardError, RunFailed
from core.planning.plan import ShardPlan
from core.runs.batching import batching_settings, micro_batch_count
from core.runs.coordinator import Coordinator
from core.runs.generation import GenerationSettings, load_plan, sampling_spec, stop_token_ids
from core.runs.open_run import OpenRun
from core.runs.recovery import Replanner
from core.serving.model_config import full_attention_only, model_context
from core.serving.openai_api import ApiError, ParsedRequest, check_logit_bias, plain_chat_prompt, unavailable
from core.serving.scheduler import growable, join_groups
from core.serving.request_records import KeptEvents, RequestRecords, retried
from core.serving.served import ServedRequest
from core.sessions.store import SessionStore

log = logging.getLogger(__name__)


class _Stream:
    """One open run's stream to the model (a ``RunSink``): which run it came from sets its clock. Its
    recorded events are one stream in the workspace (``id``), shared by the runs of the requests in it."""

    def __init__(self, model: "ServedModel") -> None:
        self.model = model
        self.run: OpenRun | None = None
        self.id: int | None = None
        """Its event stream in the workspace (None: not recorded)."""
        self.t0 = time.monotonic()
        """Its events' arrival clock (``recv_s``) counts from here."""
        self.seq = itertools.count()
        self.kept = KeptEvents()

    def on_event(self, event: TimelineEvent) -> None:
        self.model.records.on_stream_events(self, [event])
        if self.model.observer is not None:
            self.model.observer.on_event(event)

    def on_events(self, events: list[TimelineEvent]) -> None:
        """An agent's batch of events (``RunSink``): stored in one hand-over to the workspace's writer."""
        with self.model.records.batched():
            self.model.records.on_stream_events(self, events)
        if self.model.observer is not None:
            for event in events:
                self.model.observer.on_event(event)

    def on_tokens(self, tokens: TokenEvent) -> None:
        self.model._on_tokens(self.run, tokens)
        if self.model.observer is not None:
            self.model.observer.on_tokens(tokens)


@dataclass(frozen=True)
class ServeSettings:
    """How the server runs every request (``edgeshard serve``'s run options)."""

    generation: GenerationSettings
    """mode, micro-batches, dtype, threads, links, send_weights (its sampling fields are per request)."""
    max_tokens: int = 32
    """A request's max_tokens when it gives none (capped by the context left after its prompt)."""


class ServedModel:
    """The loaded plan and everything a request needs; one run on the cluster at a time."""

    def __init__(self, coordinator: Coordinator, plan: ShardPlan, model_dir: str, name: str, tokenizer,
                 settings: ServeSettings, *, replan: Replanner | None = None, store: SessionStore | None = None,
                 session_id: int | None = None) -> None:
        self.coordinator, self.plan, self.model_dir, self.name = coordinator, plan, model_dir, name
        self.tokenizer = tokenizer
        self.settings = settings
        self.replan = replan
        self.store, self.session_id = store, session_id
        self.plan_id = store.add_plan(session_id, plan) if store is not None else None
        self.stop_ids = stop_token_ids(model_dir, tokenizer)
        self.context = model_context(model_dir)
        config = json.loads(Path(model_dir, "config.json").read_text())  # the ids ``logit_bias`` may name:
        self.vocab = int(config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size") or 0)
        self.rows_join = full_attention_only(config)
        """Whether requests may join a running micro-batch as rows (``_growable``)."""
        self.chat_template = getattr(tokenizer, "chat_template", None)
        self.loaded = False
        self.slots = max(2, len(plan.stages), micro_batch_count(plan, settings.generation.micro_batches))
        """Micro-batches the open run holds at once (each a group of requests that joined together)."""
        self.max_rows = 16
        """Rows a running micro-batch takes before later requests stop joining it (``--max-batch``)."""
        self.open: OpenRun | None = None
        self.on_slot_free = lambda: None
        """Told when a micro-batch is free again (the queue's ``wake``), outside any lock here."""
        self.on_busy = lambda in_flight: None
        """Told the open run's micro-batches in flight when they change, before a join goes out (``serve
        --local``'s ``CpuPlacer``)."""
        self._lock = threading.RLock()
        self._loading = threading.RLock()  # held to load or re-plan and start the open run: joins wait for a recovery
        self._slots: dict[int, list[ServedRequest]] = {}
        self._by_seq: dict[int, ServedRequest] = {}
        self.observer = None
        """Also told the open run's stream as it comes (``on_event``/``on_tokens``, the run's clock and
        sequence ids; e.g. the studio's timeline), on the coordinator's IO thread."""
        self.recent: deque[ServedRequest] = deque(maxlen=500)
        """The requests admitted last, oldest first (what a live view lists)."""
        self.admitted = 0
        self.tokens_out = 0
        """Requests admitted and tokens handed to requests since the start (a live view's rates)."""
        self.records = RequestRecords(self)

    # ------------------------------------------------------------------ loading
    def load(self, reporter=None) -> None:
        """Load the plan on its agents once (no KV reservation: stages grow their cache to each run)."""
        load_plan(self.coordinator, self.plan, self.model_dir, self.settings.generation, reporter=reporter)
        self.coordinator.sync_clocks()  # later runs keep the estimates fresh from the heartbeats' own samples
        self.records.mark_wire()
        self.loaded = True

    def unload(self) -> None:
        self._close_open()
        self.records.close()
        if self.loaded:
            try:
                self.coordinator.unload()
            except EdgeShardError as err:
                log.warning("unloading: %s", err)
            self.loaded = False

    def _ready(self) -> str | None:
        """None when the plan is loaded (loading it again after a failure unloaded it), else why not. An agent of the
        plan lost while no request ran (nothing to recover then) is re-planned around here with ``--on-failure replan``."""
        lost = [d for d in self.plan.devices() if self.coordinator.link.is_lost(d)]
        if lost and self.replan is not None:
            try:
                self._replanned(tuple(lost))
            except EdgeShardError as err:
                return f"agent {lost[0]} is not answering and no plan without it could be loaded ({err}); restart it"
        elif lost:
            return f"agent {lost[0]} is not answering; restart it (the plan is loaded again on the next request)"
        if not self.loaded:
            try:
                self.load()
            except EdgeShardError as err:
                return f"the plan could not be loaded again ({err}); restart the lost agent"
        return None

    # ------------------------------------------------------------------ admission
    def admit(self, parsed: ParsedRequest, deliver) -> ServedRequest:
        """A ``ServedRequest`` for ``parsed``: prompt rendered and tokenized, its length checked (413)."""
        if parsed.model != self.name:
            raise ApiError(404, f"the model {parsed.model!r} does not exist; this server serves {self.name!r}",
                           param="model", code="model_not_found")
        tok = self.tokenizer
        if parsed.kind == "chat" and self.chat_template:
            try:
                text = tok.apply_chat_template([{"role": r, "content": c} for r, c in parsed.messages],
                                               add_generation_prompt=True, tokenize=False)
            except Exception as err:  # the template's own rules (e.g. alternating roles) refused them
                raise ApiError(400, f"the model's chat template refused these messages: {err}",
                               param="messages", code="invalid_value") from None
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            text = parsed.prompt if parsed.kind == "completion" else plain_chat_prompt(parsed.messages)
            ids = tok(text)["input_ids"]
        if not ids:
            raise ApiError(400, "the prompt encodes to no tokens", param="prompt", code="invalid_value")
        room = self.context - len(ids)
        asked = parsed.sampling.max_tokens
        if room < 1 or (asked is not None and asked > room):
            raise ApiError(413, f"the prompt has {len(ids)} tokens and asks for {asked or 1} more; the model's "
                                f"context is {self.context} tokens", param="messages" if parsed.kind == "chat"
                           else "prompt", code="context_length_exceeded")
        check_logit_bias(parsed.sampling, self.vocab)
        max_tokens = asked if asked is not None else min(self.settings.max_tokens, room)
        seed = parsed.sampling.seed if parsed.sampling.seed is not None else secrets.randbelow(1 << 62)
        prefix = "cmpl-" if parsed.kind == "completion" else "chatcmpl-"
        request = ServedRequest(prefix + secrets.token_hex(12), parsed, text, tuple(ids), max_tokens, seed, tok,
                                self.stop_ids, deliver)
        self.recent.append(request)
        self.admitted += 1
        return request

    # ------------------------------------------------------------------ the open run
    def capacity(self) -> int:
        """Groups of requests (of any ``batch_key``) the run can take now: its free micro-batches, and one more
        when a running micro-batch may take them as rows (``_growable``)."""
        with self._lock:
            return self.slots - len(self._slots) + (self._growable() is not None)

    def _growable(self, rows: int = 1) -> int | None:
        """The running micro-batch ``rows`` requests may join while it runs (``growable``)."""
        if not self.rows_join:
            return None
        running = {slot: (sum(not m.done for m in members), any(m.resumed for m in members))
                   for slot, members in self._slots.items() if members}
        return growable(running, rows, self.max_rows)

    def _open_run(self) -> OpenRun:
        """The open run, started (after loading the plan again when a failure unloaded it)."""
        run = self.open
        if self.loaded and run is not None and run.alive:
            return run
        with self._loading:
            return self._open_run_locked()

    def _open_run_locked(self) -> OpenRun:
        why = self._ready()
        if why is not None:
            raise unavailable(why)
        if self.open is None or not self.open.alive:
            g = self.settings.generation
            stream = _Stream(self)
            run = stream.run = OpenRun(self.coordinator, self.plan, stream, slots=self.slots, mode=g.mode,
                                       eos_token_ids=self.stop_ids,
                                       pad_token_id=int(self.tokenizer.pad_token_id or 0), on_end=self._run_ended,
                                       on_busy=lambda in_flight: self.on_busy(in_flight))
            try:
                run.start()
            except RunFailed as err:
                self.loaded = self.coordinator.is_loaded(self.plan, self.model_dir)
                raise unavailable(str(err)) from None
            if self.store is not None:
                try:
                    stream.id = retried(lambda: self.store.create_event_stream(self.session_id))
                except Exception:  # its requests are recorded without their timelines; the log says so
                    log.exception("recording the open run's events failed")
            self.open = run
        return self.open

    def join_now(self, batch: list[ServedRequest]) -> bool:
        """``start_batch`` on the caller's thread (the event loop), if that cannot block: the plan is loaded and the
        open run runs (else joining may load the plan or start the run first; False: the queue's worker does)."""
        run = self.open
        if not (self.loaded and run is not None and run.alive):
            return False
        self.start_batch(batch)
        return True

    def start_batch(self, batch: list[ServedRequest], *, resumed: bool = False, into: int | None = None) -> None:
        """Join ``batch`` (requests that may share a join: ``batch_key``) to the open run: as rows of a running
        micro-batch, else as a new one. ``into``: a resumed micro-batch's slot its other requests joined first."""
        started = time.perf_counter()
        for r in batch:
            r.started_s = r.started_s or started
        live = [r for r in batch if not r.done]
        if not live:
            return
        try:
            run = self._open_run()
            with self._lock:  # rows first: a free micro-batch only when no running one may take them
                slot = into if resumed else self._growable(len(live))
                grow = slot is not None
                if not grow:
                    slot = next((i for i in range(self.slots) if i not in self._slots), None)
                if slot is None and not resumed:  # no free one: the running one with room, even if not for all
                    slot = self._growable()
                    grow = slot is not None
                if slot is None:
                    raise unavailable("every micro-batch of the run is busy")
                self._slots.setdefault(slot, []).extend(live)
                for r in live:
                    r.resumed = resumed
        except ApiError as err:
            for r in live:
                r.fail(err)
            return
        spec = sampling_spec(live[0].parsed.sampling.applied_to(self.settings.generation, live[0].seed,
                                                                live[0].max_tokens))
        # A resumed request's tokens so far are its sampler's step (a sampled request joins alone; greedy rows
        # of one join may differ in count, and draw nothing).
        done = len(live[0].tokens)

        def route(seqs) -> None:
            with self._lock:
                for r, seq in zip(live, seqs):
                    r.sequence_id = seq
                    self._by_seq[seq] = r
        now = time.time()
        for r in live:  # before its record opens: its window on the run's events starts here
            r.joined_at = r.joined_at or now
        accepted = threading.Event()

        def on_accepted() -> None:  # the join is out, the prefill runs: the server has time for the rest
            accepted.set()
            for r in () if resumed else live:
                r.joined()
        try:
            self.records.open(live, run.sink, slot, run.t0, resumed=resumed, accepted=accepted)  # off the join's path
            prompts = [r.prompt_ids + tuple(r.tokens) for r in live]
            run.join(slot, prompts, [r.max_tokens - len(r.tokens) for r in live], spec, first_step=done, on_ids=route,
                     grow=grow, on_refused=lambda err: self._join_failed(run, slot, live, err), on_accepted=on_accepted)
        except Exception as err:
            accepted.set()
            self._join_failed(run, slot, live, err)

    def _join_failed(self, run: OpenRun, slot: int, live: list[ServedRequest], err: Exception) -> None:
        """The join failed (or a stage refused it): its requests fail and leave the micro-batch, which is
        given back once nobody else is in it (a leaked one would stall the queue)."""
        with self._lock:
            members = [m for m in self._slots.pop(slot, []) if m not in live]
            if members:
                self._slots[slot] = members
            for r in live:
                if r.sequence_id is not None:
                    self._by_seq.pop(r.sequence_id, None)
        if not members:
            run.release(slot)
        if not isinstance(err, (EdgeShardError, ValueError)):
            log.error("joining a micro-batch failed", exc_info=err)
        for r in live:
            r.fail(unavailable(str(err)) if isinstance(err, EdgeShardError)
                   else ApiError(500, f"internal error: {err}", type="server_error"))
            self.records.finish(r)
        self.on_slot_free()

    def leave(self, request: ServedRequest) -> None:
        """The client left: its sequence leaves the run (its micro-batch retires once all are done)."""
        self._request_done(request)

    # the open run's stream (``_Stream``), on the coordinator's IO thread; times onto each request's clock
    def _on_tokens(self, run: OpenRun, tokens: TokenEvent) -> None:
        with self.records.batched():  # a step's token rows: one hand-over to the workspace's writer
            self._take_tokens(run, tokens)

    def _take_tokens(self, run: OpenRun, tokens: TokenEvent) -> None:
        """A step's tokens to their requests (looked up together: one lock a step, not one a token); their rows
        recorded together (``RequestRecords.add_all``)."""
        with self._lock:
            owners = [self._by_seq.get(seq) for seq in tokens.sequence_ids]
        rows, done = [], []
        for r, token in zip(owners, tokens.token_ids):
            if r is None:
                continue
            text = r.take(token)
            if text is not None:
                rows.append((r, msgspec.structs.replace(tokens, sequence_ids=(0,), token_ids=(token,), text=(text,),
                                                        micro_batch=0, t_s=tokens.t_s + run.t0 - r.joined_at)))
            if r.done:
                done.append(r)
        self.tokens_out += len(rows)
        self.records.add_all(rows)
        for r in done:
            self._request_done(r)

    def _request_done(self, r: ServedRequest) -> None:
        """``r`` is done (finished, left, failed): out of the run, recorded, its micro-batch freed when all are."""
        with self._lock:
            seq = getattr(r, "sequence_id", None)
            if seq is None or self._by_seq.pop(seq, None) is None:
                return
            for slot, members in list(self._slots.items()):
                if r in members and all(m.done for m in members):
                    del self._slots[slot]
                    if self.open is not None:
                        self.open.release(slot)
        ran_out = r.tokens and (r.tokens[-1] in self.stop_ids or len(r.tokens) >= r.max_tokens)
        if self.open is not None and not ran_out:  # a stop string, a client gone: the source still feeds it
            self.open.leave([seq])
        self.records.finish(r)
        self.on_slot_free()  # a free micro-batch, or room in a running one

    def _run_ended(self, run: OpenRun) -> None:
        """The open run ended (a lost agent, a stop): its requests are recovered or fail with 503."""
        with self._loading:
            self._run_ended_locked(run)

    def _run_ended_locked(self, run: OpenRun) -> None:
        if run is not self.open:
            return
        with self._lock:
            slots = [[r for r in members if not r.done] for members in self._slots.values()]
            self._slots.clear()
            self._by_seq.clear()
        slots = [m for m in slots if m]
        self.loaded = False
        failure = run.failure
        lost = self.coordinator.lost_with(self.coordinator.latest_run_state, list(self.plan.devices())) \
            if slots and self.replan is not None else ()  # a live stage's error may name itself, not the lost
        if lost:
            try:
                self._recover(run, lost, slots)
                return
            except EdgeShardError as err:
                failure = err
        for members in slots:
            for r in members:
                r.fail(unavailable(str(failure or "the run stopped")))
                self.records.finish(r)
        self.on_slot_free()

    def _recover(self, run: OpenRun, lost: tuple[str, ...], slots: list[list[ServedRequest]]) -> None:
        """Re-plan without every ``lost`` agent (a stage's first), load the new plan, and join every live request
        again where it stopped."""
        t_failed, failed = time.time(), lost[0]
        old = [s.device for s in self.plan.stages]
        new_plan, t_planned = self._replanned(lost)
        t_loaded = time.time()
        marks = [("failure", failed, old.index(failed), t_failed, t_failed), ("replan", failed, old.index(failed),
                 t_failed, t_planned)] + [("reload", s.device, i, t_planned, t_loaded)
                                          for i, s in enumerate(new_plan.stages)]
        for members in slots:
            for r in members:
                for kind, device, stage, start, end in marks:
                    self.records.add(r, TimelineEvent(device=device, stage=stage, kind=kind, phase="decode",
                                                     step=len(r.tokens), micro_batch=0, start_s=start - r.joined_at,
                                                     end_s=end - r.joined_at))
        self.open = None
        for members in slots:  # each join again as it joined (its own sampling), into the first one's slot
            slot = None
            for group in join_groups(members):
                self.start_batch(group, resumed=True, into=slot)
                with self._lock:
                    slot = next((i for i, m in self._slots.items() if group[0] in m), None)

    def _replanned(self, lost: tuple[str, ...]) -> tuple[ShardPlan, float]:
        """The plan re-planned over the live agents without the ``lost`` ones, loaded; and when it was planned."""
        usable = tuple(d for d in self.coordinator.endpoints if d not in lost and not self.coordinator.link.is_lost(d))
        self.plan, planned = self.replan(self.plan, lost[0], usable), time.time()
        self.loaded = False
        load_plan(self.coordinator, self.plan, self.model_dir, self.settings.generation)  # no clock probe of the lost
        self.loaded = True
        return self.plan, planned

    def _close_open(self) -> None:
        run, self.open = self.open, None
        if run is not None:
            run.close()
