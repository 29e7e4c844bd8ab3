"""A discrete-event simulator of the encode, prefill and decode pools.

Per request (``PoolConfig.disaggregation``):
- **epd**: when its prefill worker's incoming multimodal cache can hold all its multimodal
  tokens (a block reservation, freed when its prefill ends), its tiles are split over
  ``irp_degree`` encode workers (intra-request parallelism). Each worker encodes a batch of
  shares once its own outgoing cache has room for their tokens (back-pressure: a full cache
  stalls the worker, it never queues unboundedly), then sends each share on its link (E→P)
  while it encodes the next. The request prefills (batched, on its prefill worker) when every
  share has arrived; its KV cache moves P→D once a decode worker has room for it, and decode
  runs continuous batching (sequences join and leave between steps).
- **pd** (DistServe-style): the request encodes on its prefill worker, then prefills there;
  KV moves P→D as above.
- **aggregated**: one device encodes, prefills and decodes the request; it runs waiting
  prefills and encodes before its next decode step (prefill-first, as vLLM), so new requests
  stall the running ones' decode.

A request reaches the pools ``PhaseCosts.dispatch_delay_s`` after its arrival (the coordinator
releasing it; measured by profiling). Each device computes at its own speeds when the costs carry
them (``PhaseCosts.devices``), else at the top-level ones. Sends go over the sender's one link (FIFO, ``PhaseCosts.transfer_s``); compute and sends
overlap. The result is per-request ``RequestMetrics`` and, when asked, the shared
``TimelineEvent``s (stage 0 encode, 1 prefill, 2 decode; sends on a ``<device>:link`` lane)
and one ``TokenEvent`` per generated token, as a real run records them.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from agents.protocol import TimelineEvent, TokenEvent
from core.runs.metrics import RunFigures, compute_figures
from core.techniques.phase_disaggregation.types import (
    SLO, EpdInputError, PhaseCosts, PoolConfig, Request, RequestMetrics, Workload,
)

STAGE_ENCODE, STAGE_PREFILL, STAGE_DECODE = 0, 1, 2
STAGE_NAMES = ("encode", "prefill", "decode")


def link_lane(device: str) -> str:
    """The timeline lane of a device's sends (they overlap its compute)."""
    return f"{device}:link"


class CachePeak(msgspec.Struct, frozen=True, kw_only=True):
    device: str
    side: str
    """``encode-out`` (tokens encoded, not yet sent) or ``prefill-in`` (reserved for requests to prefill)."""
    peak_tokens: int
    capacity_tokens: int


class EpdSimulation(msgspec.Struct, frozen=True, kw_only=True):
    metrics: tuple[RequestMetrics, ...]
    """Per request, in request-id order."""
    caches: tuple[CachePeak, ...]
    events: tuple[TimelineEvent, ...] = ()
    tokens: tuple[TokenEvent, ...] = ()
    figures: RunFigures = RunFigures()


@dataclass(eq=False)
class _Req:
    r: Request
    mm_tokens: int
    prefill_tokens: int
    shares_left: int = 0
    prefill: _Worker | None = None
    decode: _Worker | None = None
    encode_devices: list[str] = field(default_factory=list)
    encode_start: float | None = None
    encode_end: float = 0.0
    ep_end: float = 0.0
    prefill_start: float = 0.0
    prefill_end: float = 0.0
    pd_end: float = 0.0
    decode_end: float = 0.0
    generated: int = 0
    token_times: list[float] = field(default_factory=list)


@dataclass(eq=False)
class _Share:
    req: _Req
    tiles: int
    tokens: int


@dataclass(eq=False)
class _Worker:
    name: str
    encode_q: list[_Share] = field(default_factory=list)
    prefill_q: list[_Req] = field(default_factory=list)
    decode_wait: list[_Req] = field(default_factory=list)
    decode_run: list[_Req] = field(default_factory=list)
    busy: bool = False
    link_free: float = 0.0
    out_used: int = 0
    out_peak: int = 0
    in_used: int = 0
    in_peak: int = 0
    kv_used: int = 0
    steps: int = 0

    def queued_tiles(self) -> int:
        """Tiles waiting here, plus one for a batch running (so an idle encoder is preferred)."""
        return sum(s.tiles for s in self.encode_q) + (1 if self.busy else 0)

    def load(self) -> int:
        return len(self.prefill_q) + len(self.encode_q) + len(self.decode_wait) + len(self.decode_run)


def _pick(items: list, policy: str, size: Callable[[object], int], limit: int,
          fits: Callable[[object], bool] | None = None) -> list:
    """Up to ``limit`` items in policy order (oldest first, or least work first), stopping at the first
    that does not fit (no overtaking past a blocked one, so nothing starves)."""
    order = items if policy == "fcfs" else [x for _, _, x in sorted((size(x), i, x) for i, x in enumerate(items))]
    out = []
    for it in order:
        if len(out) == limit or (fits is not None and not fits(it)):
            break
        out.append(it)
    return out


def _split(tiles: int, parts: int) -> list[int]:
    base, extra = divmod(tiles, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def check_fits(costs: PhaseCosts, workload: Workload, config: PoolConfig) -> None:
    """A request that could never fit a cache would wait forever: refuse it up front, saying what to raise."""
    for r in workload.requests:
        mm = costs.mm_tokens(r)
        if config.disaggregation == "epd" and mm > config.mm_cache_tokens:
            raise EpdInputError(f"request {r.id} has {mm} multimodal tokens, more than the multimodal cache "
                                f"({config.mm_cache_tokens} tokens): raise mm_cache_tokens")
        kv = costs.prefill_tokens(r) + r.output_tokens
        if config.disaggregation != "aggregated" and r.output_tokens > 1 and kv > config.kv_cache_tokens:
            raise EpdInputError(f"request {r.id} needs {kv} KV tokens, more than a decode worker's KV cache "
                                f"({config.kv_cache_tokens} tokens): raise kv_cache_tokens")


class _Sim:
    def __init__(self, costs: PhaseCosts, workload: Workload, config: PoolConfig, record: bool):
        self.c, self.w, self.cfg, self.record = costs, workload, config, record
        self.mode = config.disaggregation
        self.workers: dict[str, _Worker] = {d: _Worker(d) for d in config.devices}
        self.E = [self.workers[d] for d in config.encode]
        self.P = [self.workers[d] for d in config.prefill]
        self.D = [self.workers[d] for d in config.decode]
        self.heap: list[tuple[float, int, Callable, tuple]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.dispatch_q: list[_Req] = []
        self.kv_q: list[_Req] = []
        self.events: list[TimelineEvent] = []
        self.reqs = [_Req(r, costs.mm_tokens(r), costs.prefill_tokens(r)) for r in workload.requests]

    # -- the event loop ---------------------------------------------------------------
    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), fn, args))

    def run(self) -> None:
        for q in self.reqs:  # the coordinator's dispatch: the pools see a request that late
            self.at(q.r.arrival_s + self.c.dispatch_delay_s, self.arrive, q)
        while self.heap:
            self.now, _, fn, args = heapq.heappop(self.heap)
            fn(*args)

    def event(self, device: str, stage: int, kind: str, start: float, end: float, mb: int, *, step: int = 0,
              nbytes: int = 0, peer: str = "") -> None:
        if self.record and end > start:
            self.events.append(TimelineEvent(device=device, stage=stage, kind=kind,
                                             phase="decode" if stage == STAGE_DECODE else "prefill", step=step,
                                             micro_batch=mb, start_s=start, end_s=end, nbytes=nbytes, peer=peer))

    # -- arrival and dispatch ---------------------------------------------------------
    def arrive(self, q: _Req) -> None:
        q.encode_start = None
        if self.mode == "epd":
            if q.r.images == 0:
                q.encode_start = q.encode_end = q.ep_end = self.now
                q.prefill = min(self.P, key=lambda w: (w.load(), self.P.index(w)))
                q.prefill.prefill_q.append(q)
                self.try_start(q.prefill)
            else:
                self.dispatch_q.append(q)
                self.try_dispatch()
            return
        # pd / aggregated: the request's encode and prefill run on one prefill worker
        w = min(self.P, key=lambda w: (w.load(), self.P.index(w)))
        q.prefill = w
        if self.mode == "aggregated":
            q.decode = w
        if q.r.images == 0:
            q.encode_start = q.encode_end = q.ep_end = self.now
            w.prefill_q.append(q)
        else:
            q.shares_left = 1
            q.encode_devices = [w.name]
            w.encode_q.append(_Share(q, q.r.tiles, q.mm_tokens))
        self.try_start(w)

    def try_dispatch(self) -> None:
        """EPD: reserve a prefill worker's incoming cache for a whole request, then split its tiles
        over the encode workers; the head waits while no prefill worker has room (back-pressure)."""
        cap = self.cfg.mm_cache_tokens
        while self.dispatch_q:
            q = _pick(self.dispatch_q, self.cfg.policy, lambda x: x.r.tiles, 1)[0]
            room = [w for w in self.P if w.in_used + q.mm_tokens <= cap]
            if not room:
                return
            self.dispatch_q.remove(q)
            p = min(room, key=lambda w: (w.in_used + sum(x.prefill_tokens for x in w.prefill_q), self.P.index(w)))
            p.in_used += q.mm_tokens
            p.in_peak = max(p.in_peak, p.in_used)
            q.prefill = p
            parts = min(self.cfg.irp_degree, q.r.tiles)
            encoders = sorted(self.E, key=lambda w: (w.queued_tiles(), self.E.index(w)))[:parts]
            q.shares_left = parts
            q.encode_devices = [w.name for w in encoders]
            for w, tiles in zip(encoders, _split(q.r.tiles, parts)):
                w.encode_q.append(_Share(q, tiles, tiles * self.c.mm_tokens_per_tile))
            for w in encoders:
                self.try_start(w)

    # -- workers ----------------------------------------------------------------------
    def try_start(self, w: _Worker) -> None:
        if w.busy:
            return
        cfg = self.cfg
        if w.prefill_q:
            batch = _pick(w.prefill_q, cfg.policy, lambda x: x.prefill_tokens, cfg.prefill_batch)
            for q in batch:
                w.prefill_q.remove(q)
                q.prefill_start = self.now
            end = self.now + self.c.prefill_s(sum(q.prefill_tokens for q in batch), w.name)
            self.event(w.name, STAGE_PREFILL, "compute", self.now, end, batch[0].r.id)
            w.busy = True
            self.at(end, self.prefill_done, w, batch)
            return
        if w.encode_q:
            free = cfg.mm_cache_tokens - w.out_used
            used = [0]

            def fits(s: _Share) -> bool:
                if self.mode != "epd":
                    return True
                if used[0] + s.tokens > free:
                    return False
                used[0] += s.tokens
                return True

            batch = _pick(w.encode_q, cfg.policy, lambda s: s.tiles, cfg.encode_batch, fits)
            if batch:
                tiles = sum(s.tiles for s in batch)
                # the worker is busy from now, but computes once the tiles are there (the agent's span)
                start = self.now + self.c.encode_input_s(tiles, w.name)
                for s in batch:
                    w.encode_q.remove(s)
                    if s.req.encode_start is None:
                        s.req.encode_start = start
                if self.mode == "epd":
                    w.out_used += sum(s.tokens for s in batch)
                    w.out_peak = max(w.out_peak, w.out_used)
                end = self.now + self.c.encode_s(tiles, w.name)
                self.event(w.name, STAGE_ENCODE, "compute", start, end, batch[0].req.r.id)
                w.busy = True
                self.at(end, self.encode_done, w, batch)
                return
        if w.decode_wait or w.decode_run:
            room = cfg.decode_batch - len(w.decode_run)
            if room > 0 and w.decode_wait:
                for q in _pick(w.decode_wait, cfg.policy, lambda x: x.r.output_tokens - x.generated, room):
                    w.decode_wait.remove(q)
                    w.decode_run.append(q)
            if w.decode_run:
                w.steps += 1
                end = self.now + self.c.decode_step_seconds(len(w.decode_run), w.name)
                self.event(w.name, STAGE_DECODE, "compute", self.now, end, w.decode_run[0].r.id, step=w.steps)
                w.busy = True
                self.at(end, self.step_done, w, list(w.decode_run))

    def encode_done(self, w: _Worker, batch: list[_Share]) -> None:
        w.busy = False
        for s in batch:
            q = s.req
            q.encode_end = max(q.encode_end, self.now)
            if self.mode != "epd":
                q.ep_end = self.now
                q.shares_left = 0
                w.prefill_q.append(q)
                continue
            start = max(self.now, w.link_free)
            nbytes = s.tokens * self.c.mm_token_bytes
            end = start + self.c.transfer_s(nbytes)
            w.link_free = end
            self.event(link_lane(w.name), STAGE_ENCODE, "send", start, end, q.r.id, nbytes=nbytes, peer=q.prefill.name)
            self.at(end, self.share_arrived, w, s)
        self.try_start(w)

    def share_arrived(self, w: _Worker, s: _Share) -> None:
        w.out_used -= s.tokens
        q = s.req
        q.ep_end = max(q.ep_end, self.now)
        q.shares_left -= 1
        if q.shares_left == 0:
            q.prefill.prefill_q.append(q)
            self.try_start(q.prefill)
        self.try_start(w)

    def prefill_done(self, w: _Worker, batch: list[_Req]) -> None:
        w.busy = False
        for q in batch:
            q.prefill_end = self.now
            q.generated = 1
            q.token_times.append(self.now)
            if self.mode == "epd":
                w.in_used -= q.mm_tokens
            if q.r.output_tokens == 1:
                q.pd_end = q.decode_end = self.now
            elif self.mode == "aggregated":
                q.pd_end = self.now
                w.decode_wait.append(q)
            else:
                self.kv_q.append(q)
        if self.mode == "epd":
            self.try_dispatch()
        self.try_kv()
        self.try_start(w)

    def try_kv(self) -> None:
        """Move waiting KV caches P→D, oldest first, while some decode worker has room for the head."""
        cap = self.cfg.kv_cache_tokens
        while self.kv_q:
            q = self.kv_q[0]
            need = q.prefill_tokens + q.r.output_tokens
            room = [d for d in self.D if d.kv_used + need <= cap]
            if not room:
                return
            self.kv_q.pop(0)
            d = min(room, key=lambda d: (d.load(), self.D.index(d)))
            d.kv_used += need
            q.decode = d
            p = q.prefill
            start = max(self.now, p.link_free)
            nbytes = q.prefill_tokens * self.c.kv_token_bytes
            end = start + self.c.transfer_s(nbytes)
            p.link_free = end
            self.event(link_lane(p.name), STAGE_PREFILL, "send", start, end, q.r.id, nbytes=nbytes, peer=d.name)
            self.at(end, self.kv_arrived, q)

    def kv_arrived(self, q: _Req) -> None:
        q.pd_end = self.now
        q.decode.decode_wait.append(q)
        self.try_start(q.decode)

    def step_done(self, w: _Worker, batch: list[_Req]) -> None:
        w.busy = False
        freed = False
        for q in batch:
            q.generated += 1
            q.token_times.append(self.now)
            if q.generated >= q.r.output_tokens:
                q.decode_end = self.now
                w.decode_run.remove(q)
                if self.mode != "aggregated":
                    w.kv_used -= q.prefill_tokens + q.r.output_tokens
                    freed = True
        if freed:
            self.try_kv()
        self.try_start(w)

    # -- results ----------------------------------------------------------------------
    def metrics(self) -> tuple[RequestMetrics, ...]:
        out = []
        for q in sorted(self.reqs, key=lambda q: q.r.id):
            if q.generated < q.r.output_tokens:
                raise RuntimeError(f"simulator bug: request {q.r.id} never finished")
            out.append(RequestMetrics(
                request_id=q.r.id, arrival_s=q.r.arrival_s, encode_start_s=q.encode_start, encode_end_s=q.encode_end,
                ep_transfer_end_s=q.ep_end, prefill_start_s=q.prefill_start, prefill_end_s=q.prefill_end,
                pd_transfer_end_s=q.pd_end, decode_end_s=q.decode_end, output_tokens=q.r.output_tokens,
                encode_devices=tuple(q.encode_devices), prefill_device=q.prefill.name,
                decode_device=q.decode.name if q.decode else q.prefill.name))
        return tuple(out)

    def tokens(self) -> list[TokenEvent]:
        return [TokenEvent(micro_batch=q.r.id, step=k, sequence_ids=(q.r.id,), token_ids=(0,), t_s=t)
                for q in self.reqs for k, t in enumerate(q.token_times)]

    def caches(self) -> tuple[CachePeak, ...]:
        if self.mode != "epd":
            return ()
        cap = self.cfg.mm_cache_tokens
        return tuple([CachePeak(device=w.name, side="encode-out", peak_tokens=w.out_peak, capacity_tokens=cap)
                      for w in self.E] +
                     [CachePeak(device=w.name, side="prefill-in", peak_tokens=w.in_peak, capacity_tokens=cap)
                      for w in self.P])


def simulate_pools(costs: PhaseCosts, workload: Workload, config: PoolConfig, *,
                   record: bool = False) -> EpdSimulation:
    """The workload through the pools: per-request metrics always; timeline events, tokens and
    figures with ``record`` (the search leaves them out: it simulates thousands of times)."""
    check_fits(costs, workload, config)
    sim = _Sim(costs, workload, config, record)
    sim.run()
    metrics = sim.metrics()
    if not record:
        return EpdSimulation(metrics=metrics, caches=sim.caches())
    tokens = sim.tokens()
    events = sorted(sim.events, key=lambda e: (e.start_s, e.device))
    return EpdSimulation(metrics=metrics, caches=sim.caches(), events=tuple(events), tokens=tuple(tokens),
                         figures=compute_figures(events, tokens))


def record_pools_run(store, session_id: int, *, kind: str, model: str, workload: Workload, pools: PoolConfig,
                     metrics: tuple[RequestMetrics, ...], events: tuple[TimelineEvent, ...],
                     token_events: tuple[TokenEvent, ...], figures: RunFigures,
                     tokens: dict[int, tuple[int, ...]] | None = None, slo: SLO | None = None) -> int:
    """The one way an EPD run is stored, measured (``runtime.run_epd``, with its ``tokens``) or
    ``predicted`` (a simulation): events, tokens, figures, and per-request metrics in its settings,
    so the studio's Sessions screen replays, exports and compares either like any run (``slo``: the
    objective its requests were held to, so a replay shows its SLO figures); returns its id."""
    from core.sessions.recording import append_predicted

    if not events:
        raise EpdInputError("the run has no timeline to store (simulate with record=True)")
    settings = {"technique": "phase-disaggregation", "pools": msgspec.to_builtins(pools),
                "workload": msgspec.to_builtins(workload), "metrics": msgspec.to_builtins(metrics)}
    if slo is not None:
        settings["slo"] = msgspec.to_builtins(slo)
    if tokens is not None:
        settings["tokens"] = {str(k): list(v) for k, v in tokens.items()}
    run_id = store.create_run(session_id, model=model, mode="pools", kind=kind, settings=settings)
    append_predicted(store, run_id, events, token_events)
    store.finish_run(run_id, "completed", figures)
    return run_id


def record_simulation(store, session_id: int, sim: EpdSimulation, *, model: str, workload: Workload,
                      pools: PoolConfig, slo: SLO | None = None) -> int:
    """A recorded simulation (``record=True``) as a ``predicted`` run (``record_pools_run``)."""
    return record_pools_run(store, session_id, kind="predicted", model=model, workload=workload, pools=pools,
                            metrics=sim.metrics, events=sim.events, token_events=sim.tokens, figures=sim.figures,
                            slo=slo)


__all__ = ["CachePeak", "EpdSimulation", "STAGE_DECODE", "STAGE_ENCODE", "STAGE_NAMES", "STAGE_PREFILL",
           "check_fits", "link_lane", "record_pools_run", "record_simulation", "simulate_pools"]
