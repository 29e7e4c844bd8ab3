"""EPD for real: a workload of multimodal requests over three pools of agents.

Encode agents (``epd-encode``) run the vision tower over tiles, prefill agents
(``epd-prefill``) build the KV cache and the first token, decode agents (``epd-decode``)
generate the rest (agents.techniques.phase_disaggregation.phases). The coordinator's process is the scheduler: it releases each
request at its arrival time, picks the prefill device whose multimodal cache has room for it,
splits its tiles over ``irp_degree`` encode agents, each of which pushes its piece's tokens to
that prefill agent's data socket as soon as it is encoded (``transfers="data-plane"``, the
default: CurveZMQ, raw frames, emulated links); once every piece is on its way the prefill agent
is asked to prefill, starts when the last piece arrives and pushes the KV cache (with the first token
and the sampler state) to the decode device whose KV cache was reserved; that agent, asked to decode
together with the prefill, starts as soon as they arrive. Every request
is asynchronous (``AgentLink.request_async``): the pools work on different requests at once.
``transfers="relay"`` moves the tensors through the coordinator's control channel instead (one
control frame each).

The layout is the pools: PD-only and aggregated run on the same runtime (a device in several pools
loads one stage serving them all; a request encodes as one piece on its prefill device, aggregated
decodes there too, and a hand-off between phases on one agent stays on it).

Bounded, not queued: an agent holds at most one encode and one prefill at a time and up to
``decode_batch`` decodes (its continuous batch; the next waits here, in the pool's queue, ordered
by the policy); ``mm_cache_tokens`` per prefill device are reserved when a
request's first piece starts encoding and freed when its prefill ends (encode waits when no
prefill device has room), ``kv_cache_tokens`` per decode device when its prefill starts, freed
when its decode ends (prefill waits); an agent keeps what arrives before its request in a store
of at most ``agents.techniques.phase_disaggregation.phases.MAX_HELD_BYTES``. What differs from the paper: encode and prefill batch
sizes are 1.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec

from agents.techniques.phase_disaggregation.kinds import kind_for
from agents.techniques.phase_disaggregation.phases import MAX_DECODE_BATCH, to_bytes
from agents.protocol import (
    MAX_CONTROL_FRAME,
    ErrorReply,
    LoadShard,
    PeerSpec,
    SamplingSpec,
    TimelineEvent,
    TokenEvent,
)
from agents.techniques.phase_disaggregation.messages import (
    DecodeTokens,
    EncodeTiles,
    PrefillPrompt,
    PromptPrefilled,
    TilesEncoded,
    TokensDecoded,
)
from core.devices.agent_link import refusal
from core.devices.clock_sync import ClockEstimate
from core.errors import RunFailed
from core.reporting import NullReporter, Reporter
from core.runs.metrics import RunFigures, compute_figures
from core.runs.run_stream import NullSink
from core.techniques.phase_disaggregation.simulator import link_lane
from core.techniques.phase_disaggregation.types import EpdInputError, PoolConfig, RequestMetrics, Workload

Transfers = Literal["data-plane", "relay"]
TRANSFERS: tuple[str, ...] = ("data-plane", "relay")
"""data-plane: multimodal tokens and KV caches go agent to agent (CurveZMQ data sockets, emulated
links); relay: through the coordinator's control channel (one control frame each)."""

FRAME_SLACK = 1024
"""Bytes of a phase message besides its tensor, kept free under the control-frame limit."""

STAGES = {"encode": 0, "prefill": 1, "decode": 2}
"""A phase's ``TimelineEvent.stage`` (its lane group); encode and prefill events carry phase
"prefill" (the request's first token is their product), decode events phase "decode"."""


@dataclass(frozen=True)
class PreparedRequest:
    """One request's real inputs: its tiles (N×3×T×T) and its prompt's token ids."""

    id: int
    tiles: object
    input_ids: tuple[int, ...]
    output_tokens: int


class EpdRun(msgspec.Struct, frozen=True, kw_only=True):
    tokens: dict[int, tuple[int, ...]]
    """Generated tokens per request id (the first one included)."""
    metrics: tuple[RequestMetrics, ...]
    events: tuple[TimelineEvent, ...]
    token_events: tuple[TokenEvent, ...]
    figures: RunFigures


def prepare_requests(model_dir: str | Path, workload: Workload, images: list[Path] | None = None
                     ) -> list[PreparedRequest]:
    """Real inputs for ``workload``: request i's k-th image is ``images[(i + k) % len]`` (the shipped
    synthetic set by default) cut into its ``tiles_per_image`` tiles; its prompt is ``<bos>``, the
    image tokens, then ``prompt_tokens - 1`` tokens of the shipped text."""
    import torch
    from transformers import AutoTokenizer

    from core.models.checkpoints import corpus_lines
    from core.models.multimodal import check_multimodal_dir, load_image, synthetic_images

    info = check_multimodal_dir(model_dir)
    images = list(images) if images else synthetic_images()
    if not images:
        raise EpdInputError("no images to run: pass image files (resources/images holds the shipped set)")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    text = tokenizer(" ".join(corpus_lines()[:12]), add_special_tokens=False)["input_ids"]
    text = [t for t in text if t != info.image_token_id]
    out = []
    for i, r in enumerate(workload.requests):
        if r.prompt_tokens - 1 > len(text):
            raise EpdInputError(f"request {r.id}: {r.prompt_tokens} prompt tokens is more than the shipped text holds "
                                f"({len(text) + 1})")
        tiles = [load_image(images[(i + k) % len(images)], info.tile, r.tiles_per_image) for k in range(r.images)]
        tiles = torch.cat(tiles) if tiles else torch.empty(0, 3, info.tile, info.tile)
        ids = (1,) + (info.image_token_id,) * (tiles.shape[0] * info.tokens_per_tile) + tuple(text[:r.prompt_tokens - 1])
        out.append(PreparedRequest(id=r.id, tiles=tiles, input_ids=ids, output_tokens=r.output_tokens))
    return out


def reference_tokens(model_dir: str | Path, prepared: list[PreparedRequest],
                     sampling: SamplingSpec = SamplingSpec()) -> dict[int, tuple[int, ...]]:
    """What the single-process model's ``generate()`` gives for each request (eos not stopping,
    like the run): the figure EPD's tokens are checked against."""
    import torch
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(str(model_dir), local_files_only=True).eval()
    out = {}
    for p in prepared:
        kwargs = dict(max_new_tokens=p.output_tokens, eos_token_id=None, pad_token_id=0)
        if sampling.temperature > 0:
            torch.manual_seed(sampling.seed)
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
        else:
            kwargs.update(do_sample=False)
        model.generation_config.eos_token_id = None
        ids = torch.tensor([p.input_ids])
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, pixel_values=p.tiles if p.tiles.shape[0] else None, **kwargs)
        out[p.id] = tuple(gen[0, ids.shape[1]:].tolist())
    return out


def load_pools(link, model_dir: str | Path, pools: PoolConfig, *, dtype: str = "float32", timeout_s: float = 120.0
               ) -> None:
    """Load each pool device's phase executor (``LoadShard`` of kind ``epd-<phase>``)."""
    check_real_pools(pools)
    statuses = link.status_of(list(pools.devices))
    peers = tuple(PeerSpec(device=d, stage=i, data_address=statuses[d].data_address,
                           public_key=statuses[d].public_key) for i, d in enumerate(pools.devices))
    futs = []
    for i, device in enumerate(pools.devices):
        phases = [p for p in ("encode", "prefill", "decode") if device in getattr(pools, p)]
        msg = LoadShard(model_dir=str(model_dir), stage=i, start=0, end=1, peers=peers, dtype=dtype,
                        kind=kind_for(phases))
        futs.append((device, link.request_async(device, msg)))
    for device, fut in futs:
        reply = link.await_reply(device, fut, timeout_s, "loading its phase")
        if isinstance(reply, ErrorReply):
            raise refusal(reply, "loading its phase: refused", device)


def check_real_pools(pools: PoolConfig) -> None:
    """What the real run serves: every layout (EPD's disjoint pools, PD-only's encode coupled to
    prefill, aggregated), one encode and one prefill per agent at a time, up to ``decode_batch``
    decodes in an agent's continuous batch."""
    if pools.encode_batch != 1 or pools.prefill_batch != 1:
        raise EpdInputError("the real run encodes and prefills one request per agent at a time: set encode_batch "
                            "and prefill_batch to 1 (larger ones are simulated only)")
    if pools.decode_batch > MAX_DECODE_BATCH:
        raise EpdInputError(f"decode_batch {pools.decode_batch} is more than a decode agent runs at once "
                            f"({MAX_DECODE_BATCH})")


@dataclass
class _State:
    """One request's progress through the pools (coordinator clock, seconds from the run's start)."""

    prepared: PreparedRequest
    arrival_s: float
    pieces: list[tuple[int, ...]]
    waiting_pieces: list[int] = field(default_factory=list)
    encoded: dict[int, object] = field(default_factory=dict)
    encode_devices: list[str] = field(default_factory=list)
    encode_start_s: float | None = None
    encode_end_s: float = 0.0
    ep_end_s: float = 0.0
    mm_reserved: bool = False
    prefill_start_s: float = 0.0
    prefill_end_s: float = 0.0
    prefill_device: str = ""
    prefilled: PromptPrefilled | None = None
    pd_end_s: float = 0.0
    decode_end_s: float = 0.0
    decode_device: str = ""
    tokens: tuple[int, ...] = ()
    mm: int = 0
    """Multimodal tokens the request's tiles become (its reservation in the multimodal cache)."""
    sends: list = field(default_factory=list)
    """Data plane: (encode device, its compute end, bytes) of each piece pushed to the prefill agent."""
    kv_sent: tuple = ()
    early_decode: tuple | None = None
    """Data plane: a decode answer that came before its prefill's (it is taken once that is in)."""


def _split(n: int, parts: int) -> list[tuple[int, ...]]:
    """Tiles 0..n-1 in ``parts`` contiguous pieces as even as can be (IRP), none empty."""
    parts = max(1, min(parts, n))
    bounds = [round(k * n / parts) for k in range(parts + 1)]
    return [tuple(range(a, b)) for a, b in zip(bounds, bounds[1:]) if b > a]


def run_epd(link, model_dir: str | Path, workload: Workload, pools: PoolConfig, *,
            prepared: list[PreparedRequest] | None = None, images: list[Path] | None = None,
            sampling: SamplingSpec = SamplingSpec(), timeout_s: float = 120.0, load: bool = True,
            transfers: Transfers = "data-plane", reporter: Reporter | None = None, sink=None) -> EpdRun:
    """Serve ``workload`` on the agents of ``pools`` (named as the link's devices), each request
    released at its arrival time; ``sink`` (a ``RunSink``) gets each event and token as it is known. ``RunFailed`` names a device that failed or went silent;
    ``EpdInputError`` what cannot run (before anything is sent)."""
    if transfers not in TRANSFERS:
        raise EpdInputError(f"transfers must be one of {', '.join(TRANSFERS)}, got {transfers!r}")
    from core.models.multimodal import check_multimodal_dir

    reporter = reporter or NullReporter()
    check_real_pools(pools)
    info = check_multimodal_dir(model_dir)
    prepared = prepared if prepared is not None else prepare_requests(model_dir, workload, images)
    if [p.id for p in prepared] != [r.id for r in workload.requests]:
        raise EpdInputError("prepared requests must be the workload's, in its order")
    kv_token_bytes = info.layers * 2 * info.kv_heads * info.head_dim * 4
    mm_capacity, kv_capacity = pools.mm_cache_tokens, pools.kv_cache_tokens
    for p in prepared:
        prompt = len(p.input_ids)
        mm = p.tiles.shape[0] * info.tokens_per_tile
        if transfers == "relay" and (prompt * kv_token_bytes + FRAME_SLACK > MAX_CONTROL_FRAME or
                                     mm * info.hidden * 4 + prompt * 8 + FRAME_SLACK > MAX_CONTROL_FRAME):
            raise EpdInputError(f"request {p.id}: its KV cache ({prompt} tokens × {kv_token_bytes} B) or multimodal "
                                f"tokens do not fit one control frame ({MAX_CONTROL_FRAME} B): fewer tiles or tokens")
        if mm > mm_capacity or prompt + p.output_tokens > kv_capacity:
            raise EpdInputError(f"request {p.id} needs {mm} multimodal and {prompt + p.output_tokens} KV tokens; the "
                                f"caches hold {mm_capacity} and {kv_capacity}: raise mm_cache_tokens / kv_cache_tokens")
    if load:
        load_pools(link, model_dir, pools, timeout_s=timeout_s)
    return _Scheduler(link, info, workload, pools, prepared, sampling, timeout_s, reporter, transfers, sink).run()


class _Scheduler:
    """The run's event loop: dispatch to free agents in policy order, take replies as they come."""

    def __init__(self, link, info, workload: Workload, pools: PoolConfig, prepared, sampling, timeout_s, reporter,
                 transfers: str = "data-plane", sink=None):
        self.link, self.info, self.pools, self.sampling = link, info, pools, sampling
        self.sink = sink or NullSink()
        self.direct = transfers == "data-plane"
        self.coupled = pools.disaggregation != "epd"
        """PD-only / aggregated: a request encodes (one piece, no IRP) on its prefill device, and
        aggregated decodes there too; on the data plane each hand-off stays on that agent."""
        self.timeout_s, self.reporter = timeout_s, reporter
        self.run_id = uuid.uuid4().hex[:12]
        """Unique per run, on every phase request and so on every data frame (agents drop other runs' pieces)."""
        self.requests = {r.id: r for r in workload.requests}
        self.prepared = {p.id: p for p in prepared}
        self.order = [r.id for r in workload.requests]
        self.free = {phase: list(getattr(pools, phase)) for phase in ("encode", "prefill")}
        self.free["decode"] = [d for d in pools.decode for _ in range(pools.decode_batch)]
        """Free slots per phase: an agent's one encode and one prefill, ``decode_batch`` decodes (its
        continuous batch); a device appears once per free slot."""
        self.mm_free = {d: pools.mm_cache_tokens for d in pools.prefill}
        """Per prefill device: multimodal tokens its cache has room for (reserved at a request's first encode)."""
        self.kv_free = {d: pools.kv_cache_tokens for d in pools.decode}
        """Per decode device: KV tokens its cache has room for (reserved when the request's prefill starts)."""
        self.states: dict[int, _State] = {}
        self.encode_queue: list[tuple[int, int]] = []
        self.prefill_queue: list[int] = []
        self.decode_queue: list[int] = []
        self.outstanding: dict[cf.Future, tuple] = {}
        self.events: list[TimelineEvent] = []
        self.token_events: list[TokenEvent] = []
        self.done: list[int] = []

    # -- time
    def now(self) -> float:
        return time.time() - self.t0

    def _local(self, clock: ClockEstimate | None, t_agent: float, lo: float, hi: float) -> float:
        """An agent-clock time as seconds from the run's start, clamped into [lo, hi] (when we sent,
        when the reply came): the offset estimate cannot move it outside what we saw. ``clock``: the one
        estimate read for the reply (heartbeats refine it meanwhile; its events carry its uncertainty)."""
        t = t_agent - (clock.offset_s if clock is not None else 0.0) - self.t0
        return min(max(t, lo), hi)

    def _event(self, device, phase, kind, request, start, end, clock: ClockEstimate | None, *, step=0, nbytes=0,
               peer=""):
        self.events.append(TimelineEvent(
            device=device, stage=STAGES[phase], kind=kind, phase="decode" if phase == "decode" else "prefill",
            step=step, micro_batch=request, start_s=start, end_s=max(end, start), nbytes=nbytes, peer=peer,
            clock_uncertainty_s=clock.uncertainty_s if clock is not None else 0.0))
        self.sink.on_event(self.events[-1])

    def _token(self, tokens: TokenEvent) -> None:
        self.token_events.append(tokens)
        self.sink.on_tokens(tokens)

    # -- the loop
    def run(self) -> EpdRun:
        self.t0 = time.time()
        arrivals = list(self.order)
        try:
            while len(self.done) < len(self.order):
                if self.reporter.cancel_requested():
                    raise RunFailed("cancelled by the operator", "coordinator")
                now = self.now()
                while arrivals and self.requests[arrivals[0]].arrival_s <= now:
                    self._admit(arrivals.pop(0))
                self._dispatch()
                wait = self.timeout_s if not arrivals else max(0.0, self.requests[arrivals[0]].arrival_s - self.now())
                if not self.outstanding:
                    if not arrivals:
                        raise RunFailed("the scheduler has nothing in flight and requests left (a cache too small?)",
                                        "coordinator")
                    time.sleep(wait)
                    continue
                finished, _ = cf.wait(list(self.outstanding), timeout=min(wait, 0.5), return_when=cf.FIRST_COMPLETED)
                for fut in finished:
                    self._on_reply(fut)
                self._check_deadlines()
        finally:
            for fut in self.outstanding:
                self.link.forget(fut)
        for rid in self.order:  # data plane: a piece's push ends when the prefill agent has it
            st = self.states[rid]
            for src, t_enc, nbytes, clock in st.sends:
                if src == st.prefill_device:
                    continue  # a coupled agent's hand-off to itself crosses no link
                self._event(link_lane(src), "encode", "send", rid, t_enc, max(st.ep_end_s, t_enc), clock,
                            nbytes=nbytes, peer=st.prefill_device)
        metrics = tuple(self._metrics(self.states[i]) for i in self.order)
        self.events.sort(key=lambda e: (e.start_s, e.device))
        self.token_events.sort(key=lambda t: (t.t_s, t.micro_batch))
        return EpdRun(tokens={i: self.states[i].tokens for i in self.order}, metrics=metrics,
                      events=tuple(self.events), token_events=tuple(self.token_events),
                      figures=compute_figures(self.events, self.token_events))

    def _admit(self, rid: int) -> None:
        p = self.prepared[rid]
        n = p.tiles.shape[0]
        st = _State(prepared=p, arrival_s=self.requests[rid].arrival_s,
                    pieces=_split(n, 1 if self.coupled else self.pools.irp_degree))
        st.mm = n * self.info.tokens_per_tile
        self.states[rid] = st
        if n:
            st.waiting_pieces = list(range(len(st.pieces)))
            self.encode_queue += [(rid, k) for k in st.waiting_pieces]
        else:
            st.encode_start_s = st.encode_end_s = st.ep_end_s = st.arrival_s
            self.prefill_queue.append(rid)

    def _ordered(self, queue: list, phase: str) -> list:
        """The queue in the pool's policy order: arrival (fcfs) or least work in this phase."""
        def arrival(item):
            rid = item[0] if isinstance(item, tuple) else item
            return (self.requests[rid].arrival_s, rid)

        if self.pools.policy == "fcfs":
            return sorted(queue, key=arrival)

        def work(item):
            if phase == "encode":
                rid, k = item
                return len(self.states[rid].pieces[k])
            if phase == "prefill":
                return len(self.prepared[item].input_ids)
            return self.prepared[item].output_tokens

        return sorted(queue, key=lambda it: (work(it), arrival(it)))

    @staticmethod
    def _roomiest(free: dict[str, int], need: int) -> str | None:
        """The device whose cache has the most room, if it has ``need`` (ties: pool order)."""
        device = max(free, key=lambda d: free[d])
        return device if free[device] >= need else None

    def _dispatch(self) -> None:
        for rid, k in self._ordered(self.encode_queue, "encode"):
            if not self.free["encode"]:
                break
            st = self.states[rid]
            if not st.mm_reserved:
                # coupled: the request's prefill device is the encoder it gets, so only free ones are candidates
                room = {d: n for d, n in self.mm_free.items() if not self.coupled or d in self.free["encode"]}
                device = self._roomiest(room, st.mm) if room else None
                if device is None:
                    if self.pools.policy == "fcfs":
                        break  # head of line waits for room: the prefill side's cache back-pressures encode
                    continue
                self.mm_free[device] -= st.mm
                st.mm_reserved, st.prefill_device = True, device
            self.encode_queue.remove((rid, k))
            if self.coupled:
                device = st.prefill_device
                self.free["encode"].remove(device)
            else:
                device = self.free["encode"].pop(0)
            # a slice (the pieces are contiguous ranges): a view, no torch kernel. An index kernel here woke
            # torch's thread pool, which on a loaded machine held each release up by tens of ms
            tiles = st.prepared.tiles[st.pieces[k][0]:st.pieces[k][-1] + 1]
            msg = EncodeTiles(request=rid, tiles=st.pieces[k], shape=tuple(tiles.shape), data=to_bytes(tiles),
                              send_to=st.prefill_device if self.direct else "", piece=k)
            self._send(device, msg, ("encode", rid, k, len(msg.data)))
            if self.direct and not any(r == rid for r, _ in self.encode_queue):
                # every piece is on its way to the prefill agent: ask for the prefill now, it starts
                # as soon as the last piece arrives (no round trip through here on the critical path)
                self.prefill_queue.append(rid)
        for rid in self._ordered(self.prefill_queue, "prefill"):
            st = self.states[rid]
            device = st.prefill_device or (self.free["prefill"][0] if self.free["prefill"] else "")
            if device not in self.free["prefill"]:
                continue
            p = self.prepared[rid]
            need = len(p.input_ids) + p.output_tokens
            # aggregated: the request decodes where it prefilled (its KV cache never leaves the device)
            decode = self._roomiest({device: self.kv_free[device]} if self.pools.disaggregation == "aggregated"
                                    else self.kv_free, need)
            if decode is None:
                if self.pools.policy == "fcfs":
                    break  # the decode side's KV caches are full: prefill waits
                continue
            self.kv_free[decode] -= need
            st.decode_device = decode
            self.prefill_queue.remove(rid)
            self.free["prefill"].remove(device)
            st.prefill_device = device
            mm_shape = (st.mm, self.info.hidden) if st.pieces else ()
            if self.direct:
                msg = PrefillPrompt(request=rid, input_ids=p.input_ids, sampling=self.sampling, mm_shape=mm_shape,
                                    mm_pieces=tuple(range(len(st.pieces))), send_to=decode)
            else:  # the pieces' raw float32 bytes in tile order are the whole request's (no torch op here)
                msg = PrefillPrompt(request=rid, input_ids=p.input_ids, sampling=self.sampling, mm_shape=mm_shape,
                                    mm=b"".join(st.encoded[k] for k in range(len(st.pieces))))
            st.encoded.clear()
            self._send(device, msg, ("prefill", rid, 0, len(msg.mm)))
            if self.direct:  # the decode agent starts when the KV cache (and the first token) arrive
                self.decode_queue.append(rid)
        for rid in self._ordered(self.decode_queue, "decode"):
            st = self.states[rid]
            if st.decode_device not in self.free["decode"]:
                continue
            self.decode_queue.remove(rid)
            self.free["decode"].remove(st.decode_device)
            if self.direct:  # first token, sampler state and KV cache come from the prefill agent
                kv_shape = (self.info.layers, 2, self.info.kv_heads, len(st.prepared.input_ids), self.info.head_dim)
                msg = DecodeTokens(request=rid, first_token=0, kv_shape=kv_shape, kv=b"",
                                   max_new_tokens=st.prepared.output_tokens, sampling=self.sampling,
                                   kv_from=st.prefill_device)
            else:
                pre = st.prefilled
                msg = DecodeTokens(request=rid, first_token=pre.token, kv_shape=pre.kv_shape, kv=pre.kv,
                                   max_new_tokens=st.prepared.output_tokens, sampling=self.sampling, rng=pre.rng)
                st.prefilled = None
            self._send(st.decode_device, msg, ("decode", rid, 0, len(msg.kv)))

    def _send(self, device: str, msg, what: tuple) -> None:
        msg = msgspec.structs.replace(msg, run=self.run_id)  # its data frames carry this run's id
        fut = self.link.request_async(device, msg)
        self.outstanding[fut] = (device, self.now(), time.monotonic() + self.timeout_s, *what)

    def _check_deadlines(self) -> None:
        for fut, (device, _, deadline, phase, rid, *_rest) in list(self.outstanding.items()):
            if self.link.is_lost(device):
                raise RunFailed(f"agent lost while serving {phase} of request {rid}", device)
            if time.monotonic() > deadline:
                raise RunFailed(f"no answer to {phase} of request {rid} after {self.timeout_s:.0f} s", device)

    def _on_reply(self, fut: cf.Future) -> None:
        device, t_sent, _, phase, rid, piece, nbytes = self.outstanding.pop(fut)
        t_back = self.now()
        try:
            reply = fut.result()
        except RunFailed:
            raise
        except Exception as err:  # the link's own failures (version mismatch, lost agent)
            raise RunFailed(f"{phase} of request {rid}: {err}", device) from None
        if isinstance(reply, ErrorReply):
            raise refusal(reply, f"{phase} of request {rid} refused", device)
        expected = {"encode": TilesEncoded, "prefill": PromptPrefilled, "decode": TokensDecoded}[phase]
        if not isinstance(reply, expected) or reply.request != rid:
            raise RunFailed(f"{phase} of request {rid}: unexpected answer {type(reply).__name__}", device)
        st = self.states[rid]
        clock = self.link.clock_of(device)
        ts = self._local(clock, reply.t_start, t_sent, t_back)
        te = self._local(clock, reply.t_end, ts, t_back)
        self.free[phase].append(device)
        self._event(device, phase, "recv_wait", rid, t_sent, ts, clock, nbytes=nbytes)
        self._event(device, phase, "compute", rid, ts, te, clock)
        if phase == "encode":
            if self.direct:  # its send ends when the prefill agent has it: drawn when that is known
                st.sends.append((device, te, math.prod(reply.shape) * 4, clock))
                st.encoded[piece] = None
            else:
                self._event(link_lane(device), phase, "send", rid, te, t_back, clock, nbytes=len(reply.data),
                            peer="coordinator")
                st.encoded[piece] = reply.data  # raw float32, its size checked at decode
            st.encode_devices.append(device)
            st.encode_start_s = ts if st.encode_start_s is None else min(st.encode_start_s, ts)
            st.encode_end_s = max(st.encode_end_s, te)
            if not self.direct:
                st.ep_end_s = max(st.ep_end_s, t_back)
                if len(st.encoded) == len(st.pieces):
                    self.prefill_queue.append(rid)
        elif phase == "prefill":
            if self.direct:
                if reply.mm_received:
                    st.ep_end_s = self._local(clock, reply.mm_received, 0.0, ts)
                st.kv_sent = (device, te, math.prod(reply.kv_shape) * 4, clock)
            else:
                self._event(link_lane(device), phase, "send", rid, te, t_back, clock, nbytes=len(reply.kv),
                            peer="coordinator")
            if st.mm_reserved:
                self.mm_free[device] += st.mm
            st.prefill_start_s, st.prefill_end_s, st.prefill_device, st.prefilled = ts, te, device, reply
            st.tokens = (reply.token,)
            self._token(TokenEvent(micro_batch=rid, step=0, sequence_ids=(rid,), token_ids=(reply.token,), t_s=te))
            if not self.direct:
                self.decode_queue.append(rid)
            elif st.early_decode is not None:
                self._decoded(st, *st.early_decode)
        elif self.direct and st.prefilled is None:  # the decode answered first: its prefill's figures are needed
            st.early_decode = (device, ts, te, reply, clock)
        else:
            self._decoded(st, device, ts, te, reply, clock)

    def _decoded(self, st: _State, device: str, ts: float, te: float, reply: TokensDecoded,
                 clock: ClockEstimate | None) -> None:
        """A decode's answer, once its request's prefill answer is in (the first token, the KV's send)."""
        rid = st.prepared.id
        st.pd_end_s, st.decode_device = max(ts, st.prefill_end_s), device
        if self.direct and reply.kv_received:
            st.pd_end_s = max(self._local(clock, reply.kv_received, 0.0, ts), st.prefill_end_s)
            src, t_pre, nbytes, sent_clock = st.kv_sent
            if src != device:  # aggregated keeps the KV cache on the agent: no send
                self._event(link_lane(src), "prefill", "send", rid, t_pre, st.pd_end_s, sent_clock, nbytes=nbytes,
                            peer=device)
        prev = ts
        for step, (token, t_end) in enumerate(zip(reply.tokens, reply.step_ends), start=1):
            t = self._local(clock, t_end, prev, te)
            self._token(TokenEvent(micro_batch=rid, step=step, sequence_ids=(rid,), token_ids=(token,), t_s=t))
            prev = t
        st.decode_end_s = max(te, st.pd_end_s)
        st.tokens = st.tokens + tuple(reply.tokens)
        p = st.prepared
        self.kv_free[device] += len(p.input_ids) + p.output_tokens
        self.done.append(rid)
        self.reporter.progress(len(self.done), len(self.order))

    def _metrics(self, st: _State) -> RequestMetrics:
        enc_start = st.encode_start_s if st.encode_start_s is not None else st.arrival_s
        return RequestMetrics(
            request_id=st.prepared.id, arrival_s=st.arrival_s, encode_start_s=max(enc_start, st.arrival_s),
            encode_end_s=max(st.encode_end_s, enc_start, st.arrival_s),
            ep_transfer_end_s=max(st.ep_end_s, st.encode_end_s, enc_start, st.arrival_s),
            prefill_start_s=max(st.prefill_start_s, st.ep_end_s, st.encode_end_s, st.arrival_s),
            prefill_end_s=max(st.prefill_end_s, st.prefill_start_s, st.ep_end_s, st.encode_end_s, st.arrival_s),
            pd_transfer_end_s=max(st.pd_end_s, st.prefill_end_s), decode_end_s=st.decode_end_s,
            output_tokens=len(st.tokens), encode_devices=tuple(dict.fromkeys(st.encode_devices)),
            prefill_device=st.prefill_device, decode_device=st.decode_device)


def record_epd_run(store, session_id: int, run: EpdRun, *, model: str, workload: Workload, pools: PoolConfig,
                   slo=None) -> int:
    """A real run as a ``measured`` run, through the simulator's ``record_pools_run`` (one recording path)."""
    from core.techniques.phase_disaggregation.simulator import record_pools_run

    return record_pools_run(store, session_id, kind="measured", model=model, workload=workload, pools=pools,
                            metrics=run.metrics, events=run.events, token_events=run.token_events,
                            figures=run.figures, tokens=run.tokens, slo=slo)
