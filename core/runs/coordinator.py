"""Drives agents over their control sockets: status, clocks, loading a plan, runs.

One IO thread owns every control socket (zmq sockets are not thread-safe): callers on
any thread submit requests and wait on futures; the IO thread also pings every agent
every ``heartbeat_interval_s`` (the pings double as clock probes) and dispatches what
agents stream during a run — timeline events and tokens — to the run's ``RunSink``.

Clock offsets are estimated NTP-style: for a ping sent at t0 and answered at agent times
t1/t2 and received at t3, ``offset = ((t1 - t0) + (t2 - t3)) / 2`` with error at most
``(t3 - t0 - (t2 - t1)) / 2``; the sample with the smallest round trip wins. Agent times
map to the coordinator's clock as ``t - offset``.

Failure detection: an agent whose pongs stop for ``heartbeat_timeout_s`` (default 2 s,
pinged every 0.5 s, so noticed within 2.5 s) is declared lost; a run in progress ends
with ``RunFailed`` naming the device, and every other agent is told to stop and unload
(back to idle; the next run loads the plan again). Silence is judged against pings that
were really sent, after draining what already arrived, so a coordinator whose own IO
thread was held up (a slow sink, the GIL held by an import in the GUI process) does not
declare healthy agents lost. Nothing here touches Qt: sinks are plain callables that may
run on the IO thread.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import zmq

from agents.protocol import (
    RUN_MODES,
    AgentStatus,
    ErrorReply,
    EventBatch,
    GetLogs,
    GetStatus,
    KvReservation,
    LinkShape,
    LoadShard,
    Logs,
    MeasureLink,
    PeerSpec,
    Ping,
    Pong,
    ProfileCompute,
    ProfileResult,
    ProtocolError,
    RunError,
    RunFinished,
    RunMode,
    SamplingSpec,
    StartRun,
    StopRun,
    TimelineEvent,
    TokenEvent,
    TokensProduced,
    Unload,
    decode_control,
    encode_control,
)
from agents.transport import CurveKeys, curve_client, harden
from core.errors import FormatError, PlanInvalid, RunFailed, ShardOverBudget
from core.planning.plan import ShardPlan, layout_problems
from core.runs.batching import run_micro_batches, split_micro_batches  # noqa: F401  (split: public here too)
from core.reporting import NullReporter, Reporter

Mode = RunMode
MODES = RUN_MODES
"""Re-exported from ``agents.protocol`` (the one definition of the run modes)."""


log = logging.getLogger("edgeshard.coordinator")


@dataclass(frozen=True)
class AgentEndpoint:
    """How the coordinator reaches one agent's control socket."""

    device: str
    control_address: str
    """``tcp://host:port``"""
    public_key: str
    """The agent's CurveZMQ public key (Z85)."""


@dataclass(frozen=True)
class ClockEstimate:
    offset_s: float
    """Agent clock minus coordinator clock."""
    uncertainty_s: float
    rtt_s: float


class RunSink(Protocol):
    """Where a run's live stream goes (the GUI bridge, the SessionStore, a JSONL file).

    Called on the coordinator's IO thread as batches arrive (about every 50 ms for
    events, at once for tokens); implementations must be quick and thread-safe.
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


@dataclass(frozen=True)
class RunResult:
    run_id: str
    tokens: tuple[tuple[int, ...], ...]
    """Generated ids per sequence (up to and including EOS)."""
    events: tuple[TimelineEvent, ...]
    token_events: tuple[TokenEvent, ...]
    clocks: dict[str, ClockEstimate]
    wall_s: float


@dataclass
class _Conn:
    endpoint: AgentEndpoint
    sock: zmq.Socket
    last_pong: float = 0.0
    connected_at: float = 0.0
    clock: ClockEstimate | None = None
    samples: list[tuple[float, float, float]] = field(default_factory=list)
    lost: bool = False
    unanswered_since: float | None = None
    """When the oldest ping not yet followed by a pong was sent (monotonic)."""


@dataclass
class _ActiveRun:
    run_id: str
    t0: float
    """Coordinator clock (time.time()) at run start."""
    stages: dict[str, int]
    sink: RunSink
    done: cf.Future
    events: list[TimelineEvent] = field(default_factory=list)
    tokens: list[TokenEvent] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    operator_stop: bool = False
    """Ended by ``stop()`` or a cancelled reporter: the shards stay loaded for the next run."""


class Coordinator:
    """A live connection to a set of agents. Use as a context manager."""

    def __init__(
        self,
        endpoints: Sequence[AgentEndpoint],
        keys: CurveKeys,
        *,
        heartbeat_interval_s: float = 0.5,
        heartbeat_timeout_s: float = 2.0,
        request_timeout_s: float = 10.0,
        lease_s: float = 3.0,
    ) -> None:
        if len({e.device for e in endpoints}) != len(endpoints):
            raise ValueError("two endpoints share a device name")
        self.endpoints = {e.device: e for e in endpoints}
        self.keys = keys
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.request_timeout_s = request_timeout_s
        self.lease_s = max(lease_s, 2 * heartbeat_interval_s)
        """How long agents keep a run of this coordinator alive without hearing from it (its
        pings renew the lease); then they abort it, so a killed coordinator orphans nothing."""
        self._ctx = zmq.Context()
        self._conns: dict[str, _Conn] = {}
        self._pending: dict[int, tuple[str, cf.Future]] = {}
        self._submit: queue.Queue = queue.Queue()
        self._ids = itertools.count(1)
        self._wake_r, self._wake_w = os.pipe()
        self._closing = threading.Event()
        self._run: _ActiveRun | None = None
        self._run_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._by_sock: dict[zmq.Socket, _Conn] = {}
        self._loaded: tuple[ShardPlan, object] | None = None
        self._loaded_kv = KvReservation()
        self.on_lost: Callable[[str], None] | None = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Coordinator":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        now = time.monotonic()
        for dev, ep in self.endpoints.items():
            sock = self._ctx.socket(zmq.DEALER)
            harden(sock)
            curve_client(sock, self.keys, ep.public_key)
            sock.connect(ep.control_address)
            self._conns[dev] = _Conn(ep, sock, last_pong=now, connected_at=now)
        self._thread = threading.Thread(target=self._io_loop, name="edgeshard-coordinator", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closing.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        for fut in [f for _, f in self._pending.values()]:
            if not fut.done():
                fut.set_exception(RunFailed("coordinator closed"))
        self._ctx.destroy(linger=0)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    # -------------------------------------------------------------- requests
    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def request(self, device: str, msg, timeout_s: float | None = None):
        """Send ``msg`` to ``device`` and wait for its reply; raise ``RunFailed`` on error."""
        fut = self.request_async(device, msg)
        try:
            reply = fut.result(timeout=timeout_s or self.request_timeout_s)
        except cf.TimeoutError:
            self._forget(fut)
            raise RunFailed(f"no reply to {type(msg).__name__} within {timeout_s or self.request_timeout_s:.0f} s",
                            device) from None
        if isinstance(reply, ErrorReply):
            raise RunFailed(f"{type(msg).__name__} refused ({reply.code}): {reply.message}", device)
        return reply

    def request_async(self, device: str, msg) -> cf.Future:
        if device not in self.endpoints:
            raise RunFailed("no agent address is known for this device (add it to the agents list)", device)
        req = next(self._ids)
        msg = msgspec.structs.replace(msg, req=req)
        fut: cf.Future = cf.Future()
        self._pending[req] = (device, fut)
        self._submit.put((device, encode_control(msg)))
        self._wake()
        return fut

    def _forget(self, fut: cf.Future) -> None:
        """Drop a request nobody waits for any more (a reply arriving later is ignored)."""
        for req, (_, f) in list(self._pending.items()):
            if f is fut:
                self._pending.pop(req, None)

    # ------------------------------------------------------------------ IO thread
    def _io_loop(self) -> None:
        poller = zmq.Poller()
        for c in self._conns.values():
            poller.register(c.sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        by_sock = self._by_sock = {c.sock: c for c in self._conns.values()}
        next_ping = 0.0
        while not self._closing.is_set():
            now = time.monotonic()
            if now >= next_ping:
                self._check_heartbeats(now)
                for c in self._conns.values():
                    if not c.lost:
                        try:
                            c.sock.send(encode_control(Ping(t0=time.time())), zmq.NOBLOCK)
                            if c.unanswered_since is None:
                                c.unanswered_since = time.monotonic()
                        except zmq.Again:
                            pass
                next_ping = time.monotonic() + self.heartbeat_interval_s
            ready = dict(poller.poll(max(1, int((next_ping - time.monotonic()) * 1000))))
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
            while True:
                try:
                    device, payload = self._submit.get_nowait()
                except queue.Empty:
                    break
                try:
                    self._conns[device].sock.send(payload, zmq.NOBLOCK)
                except zmq.Again:
                    self._fail_pending_of(device, "control socket would block (agent unreachable)")
            for sock, c in by_sock.items():
                if sock in ready:
                    self._drain(c)

    def _drain(self, c: _Conn) -> None:
        """Handle every message already received from ``c`` (IO thread)."""
        while True:
            try:
                frame = c.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._on_message(c, frame)
            except Exception:  # the IO thread must outlive any message (and any sink's bug)
                log.exception("message from %s not handled", c.endpoint.device)

    def _silent(self, c: _Conn, now: float) -> bool:
        """No pong for the timeout, and a ping sent at least half the timeout ago is unanswered
        (so a coordinator that itself sent no pings for a while cannot blame the agent)."""
        return (
            now - c.last_pong > self.heartbeat_timeout_s
            and c.unanswered_since is not None
            and now - c.unanswered_since > self.heartbeat_timeout_s / 2
        )

    def _check_heartbeats(self, now: float) -> None:
        for dev, c in self._conns.items():
            if c.lost or not self._silent(c, now):
                continue
            self._drain(c)  # pongs may wait unread if this thread was held up
            now = time.monotonic()
            if not self._silent(c, now):
                continue
            c.lost = True
            if self._loaded is not None and dev in self._loaded[0].devices():
                self._loaded = None
            self._fail_pending_of(dev, f"no heartbeat for {now - c.last_pong:.1f} s")
            run = self._run
            if run is not None and dev in run.stages and not run.done.done():  # an idle agent's loss is only reported
                run.done.set_exception(
                    RunFailed(f"agent stopped answering (no heartbeat for {now - c.last_pong:.1f} s)", dev)
                )
            if self.on_lost:
                self.on_lost(dev)

    def _fail_pending_of(self, device: str, why: str) -> None:
        for req, (dev, fut) in list(self._pending.items()):
            if dev == device and not fut.done():
                self._pending.pop(req, None)
                fut.set_exception(RunFailed(why, device))

    def _on_message(self, c: _Conn, frame: bytes) -> None:
        try:
            msg = decode_control(frame, max_size=64 << 20)
        except ProtocolError as err:  # any bytes: dropped with the reason, the IO thread goes on
            log.warning("dropped a control frame from %s: %s: %s", c.endpoint.device, err.code, err)
            return
        dev = c.endpoint.device
        if isinstance(msg, Pong):
            t3 = time.time()
            c.last_pong = time.monotonic()
            c.unanswered_since = None
            if c.lost:  # back after being declared lost: end its run, drop its shard (back to idle)
                c.lost = False
                for back in (StopRun(), Unload()):
                    try:
                        c.sock.send(encode_control(back), zmq.NOBLOCK)
                    except zmq.Again:
                        pass
            self._add_clock_sample(c, msg.t0, msg.t1, msg.t2, t3)
            if not msg.req:
                return
        if msg.req:
            entry = self._pending.pop(msg.req, None)
            if entry is not None and not entry[1].done():
                entry[1].set_result(msg)
            return
        run = self._run
        if isinstance(msg, ErrorReply):
            return
        if run is None:
            return
        if isinstance(msg, EventBatch) and msg.run_id == run.run_id:
            self._on_events(run, c, msg)
        elif isinstance(msg, TokensProduced) and msg.run_id == run.run_id:
            t = self._to_run_clock(run, c, msg.t)
            ev = TokenEvent(
                micro_batch=msg.micro_batch,
                step=msg.step,
                sequence_ids=msg.sequence_ids,
                token_ids=msg.token_ids,
                t_s=t,
            )
            with run.lock:
                run.tokens.append(ev)
            run.sink.on_tokens(ev)
        elif isinstance(msg, RunFinished) and msg.run_id == run.run_id:
            if not run.done.done():
                run.done.set_result(msg.tokens)
        elif isinstance(msg, RunError) and msg.run_id == run.run_id:
            if not run.done.done():
                run.done.set_exception(RunFailed(msg.message, msg.device or dev))

    def _on_events(self, run: _ActiveRun, c: _Conn, msg: EventBatch) -> None:
        unc = c.clock.uncertainty_s if c.clock else 0.0
        for e in msg.events:
            ev = TimelineEvent(
                device=msg.device,
                stage=msg.stage,
                kind=e.kind,
                phase=e.phase,
                step=e.step,
                micro_batch=e.micro_batch,
                # a downstream stage starts waiting just before the source starts the run
                start_s=max(0.0, self._to_run_clock(run, c, e.start)) if e.kind == "recv_wait"
                else self._to_run_clock(run, c, e.start),
                end_s=self._to_run_clock(run, c, e.end),
                nbytes=e.nbytes,
                peer=e.peer,
                clock_uncertainty_s=unc,
            )
            with run.lock:
                run.events.append(ev)
            run.sink.on_event(ev)

    @staticmethod
    def _to_run_clock(run: _ActiveRun, c: _Conn, t_agent: float) -> float:
        off = c.clock.offset_s if c.clock else 0.0
        return (t_agent - off) - run.t0

    def _add_clock_sample(self, c: _Conn, t0: float, t1: float, t2: float, t3: float) -> None:
        rtt = max(0.0, (t3 - t0) - (t2 - t1))
        offset = ((t1 - t0) + (t2 - t3)) / 2
        c.samples.append((rtt, offset, t3))
        c.samples = c.samples[-32:]
        best = min(c.samples)
        c.clock = ClockEstimate(offset_s=best[1], uncertainty_s=best[0] / 2, rtt_s=best[0])

    # ---------------------------------------------------------------- operations
    def status(self, timeout_s: float = 5.0) -> dict[str, AgentStatus]:
        futs = {d: self.request_async(d, GetStatus()) for d in self.endpoints}
        out = {}
        for d, f in futs.items():
            try:
                out[d] = f.result(timeout=timeout_s)
            except cf.TimeoutError:
                raise RunFailed(f"agent did not answer within {timeout_s:.0f} s (is it running, is the key right?)",
                                d) from None
        return out

    def status_of(self, devices, timeout_s: float = 5.0) -> dict[str, AgentStatus]:
        futs = {d: self.request_async(d, GetStatus()) for d in devices}
        return {d: self._await(d, f, timeout_s, "reporting its status") for d, f in futs.items()}

    def wait_ready(self, timeout_s: float = 10.0) -> dict[str, AgentStatus]:
        """Status of every agent, waiting (up to ``timeout_s``) for them to come up."""
        return self.status(timeout_s)

    def sync_clocks(self, samples: int = 8, timeout_s: float = 5.0) -> dict[str, ClockEstimate]:
        """Probe every agent ``samples`` times; keep the minimum-RTT estimate."""
        for _ in range(samples):
            futs = [(d, self.request_async(d, Ping(t0=time.time()))) for d in self.endpoints]
            for d, f in futs:
                try:
                    f.result(timeout=timeout_s)
                except cf.TimeoutError:
                    for _, other in futs:
                        self._forget(other)
                    raise RunFailed(f"no answer to a clock probe within {timeout_s:g} s", d) from None
        return self.clocks()

    def clocks(self) -> dict[str, ClockEstimate]:
        return {d: c.clock for d, c in self._conns.items() if c.clock is not None}

    def logs(self, device: str, lines: int = 200) -> tuple[str, ...]:
        reply = self.request(device, GetLogs(lines=lines))
        return reply.lines if isinstance(reply, Logs) else ()

    def profile_compute(self, device: str, options: dict | None = None, timeout_s: float = 600) -> dict:
        reply = self.request(device, ProfileCompute(options=options or {}), timeout_s)
        return reply.result if isinstance(reply, ProfileResult) else {}

    def measure_link(self, src: str, peer: PeerSpec, options: dict | None = None, timeout_s: float = 120) -> dict:
        reply = self.request(src, MeasureLink(peer=peer, options=options or {}), timeout_s)
        return reply.result if isinstance(reply, ProfileResult) else {}

    def load(
        self,
        plan: ShardPlan,
        model_dir: str | dict[str, str],
        *,
        dtype: str = "float32",
        threads: int = 0,
        links: dict[str, LinkShape] | None = None,
        reporter: Reporter | None = None,
        timeout_s: float = 300,
        kv: KvReservation = KvReservation(),
        files: dict[str, tuple[tuple[str, str], ...]] | None = None,
    ) -> None:
        """Load every stage of ``plan`` on its agent (in parallel); ``model_dir`` may be per device.

        ``kv`` (``core.runs.batching.kv_reservation``): each stage allocates that KV cache at load, so an emulated
        budget it breaks refuses the load (``ShardOverBudget``) instead of failing mid-run.
        ``files``: per device, the (name, sha256) of weights sent to it (core.runs.weights)."""
        reporter = reporter or NullReporter()
        problems = layout_problems(plan)
        if problems:
            raise PlanInvalid(problems)
        missing = [s.device for s in plan.stages if s.device not in self.endpoints]
        if missing:
            raise RunFailed(f"plan uses devices without an agent: {', '.join(missing)}")
        self._loaded = None
        statuses = self.status()
        self._take_over(statuses)
        peers = tuple(
            PeerSpec(device=s.device, stage=i, data_address=statuses[s.device].data_address,
                     public_key=statuses[s.device].public_key)
            for i, s in enumerate(plan.stages)
        )
        for i, s in enumerate(plan.stages):
            if statuses[s.device].public_key != self.endpoints[s.device].public_key:
                raise RunFailed("agent reports a different public key than the one we connected with", s.device)
        links = links or {}
        futs = {}
        for i, s in enumerate(plan.stages):
            mdir = model_dir[s.device] if isinstance(model_dir, dict) else model_dir
            msg = LoadShard(model_dir=str(mdir), stage=i, start=s.start, end=s.end, peers=peers, dtype=dtype,
                            threads=threads, link=links.get(s.device, LinkShape()), kv=kv,
                            files=(files or {}).get(s.device, ()))
            futs[s.device] = self.request_async(s.device, msg)
        reporter.status(f"loading {len(futs)} stages")
        self._await_loads(futs, timeout_s, reporter)
        self._loaded = (plan, model_dir)
        self._loaded_kv = kv

    def _take_over(self, statuses: dict[str, AgentStatus]) -> None:
        """End runs this coordinator did not start (an earlier coordinator died or hangs):
        the explicit reset that lets a new coordinator always take over its agents. A stop
        is answered after the run it ends, so they are ready to load when this returns."""
        if self._run is not None:
            return
        orphans = [d for d, st in statuses.items() if st.state == "running"]
        futs = [(d, self.request_async(d, StopRun())) for d in orphans]
        for d, f in futs:
            self._await(d, f, self.request_timeout_s, "ending a run of an earlier coordinator")

    def _await_loads(self, futs: dict[str, cf.Future], timeout_s: float, reporter: Reporter) -> None:
        """Wait for every stage's load; report progress from the agents' statuses meanwhile
        (an agent answers ``get_status`` while it loads, with the fraction of blocks read)."""
        deadline = time.monotonic() + timeout_s
        pending = dict(futs)
        fractions = dict.fromkeys(futs, 0.0)
        polls: dict[str, cf.Future] = {}
        while pending:
            cf.wait(list(pending.values()), timeout=0.3, return_when=cf.FIRST_COMPLETED)
            for dev, f in list(pending.items()):
                if f.done():
                    reply = f.result()  # a lost agent's future holds its RunFailed
                    if isinstance(reply, ErrorReply):
                        error = ShardOverBudget if reply.code == "over_budget" else RunFailed
                        raise error(f"cannot load its shard: {reply.message}", dev)
                    del pending[dev]
                    fractions[dev] = 1.0
                elif self._conns[dev].lost:
                    raise RunFailed("agent lost while loading its shard", dev)
            if pending and time.monotonic() > deadline:
                raise RunFailed(f"no answer while loading its shard after {timeout_s:.0f} s", next(iter(pending)))
            for dev in pending:
                poll = polls.get(dev)
                if poll is not None and poll.done() and poll.exception() is None:
                    st = poll.result()
                    if isinstance(st, AgentStatus) and st.state == "loading":
                        fractions[dev] = max(fractions[dev], st.progress)
                if poll is None or poll.done():
                    polls[dev] = self.request_async(dev, GetStatus())
            reporter.progress(sum(fractions.values()), len(futs))

    @property
    def reserved_kv(self) -> KvReservation:
        """The KV cache the loaded stages reserved (none reserved: they grow theirs)."""
        return self._loaded_kv if self._loaded is not None else KvReservation()

    def is_loaded(self, plan: ShardPlan, model_dir) -> bool:
        """Whether ``plan`` of ``model_dir`` is loaded on live agents (false after a failure,
        which unloads every agent of the plan); ``reserved_kv`` says for which runs."""
        return self._loaded == (plan, model_dir) and not any(self._conns[d].lost for d in plan.devices())

    def unload(self) -> None:
        self._loaded = None
        for d in self.endpoints:
            if not self._conns[d].lost:
                self.request(d, Unload())

    def _unload_after_failure(self, devices: list[str]) -> None:
        """A failed run leaves no half-used plan behind: every live agent of it goes back to idle."""
        self._loaded = None
        futs = [(d, self.request_async(d, Unload())) for d in devices if not self._conns[d].lost]
        for d, f in futs:
            try:
                self._await(d, f, 10.0, "unloading after the failure")
            except RunFailed:
                pass

    def _await(self, device: str, fut: cf.Future, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return fut.result(timeout=0.2)
            except cf.TimeoutError:
                if self._conns[device].lost:
                    raise RunFailed(f"agent lost while {what}", device) from None
                if time.monotonic() > deadline:
                    raise RunFailed(f"no answer while {what} after {timeout_s:.0f} s", device) from None

    def run(
        self,
        plan: ShardPlan,
        request: RunRequest,
        sink: RunSink | None = None,
        reporter: Reporter | None = None,
    ) -> RunResult:
        """Run one generation over the loaded plan; blocks the calling thread (not the IO thread)."""
        if not self._run_lock.acquire(blocking=False):
            raise RunFailed("a run is already in progress on these agents")
        try:
            return self._run_locked(plan, request, sink, reporter)
        finally:
            self._run_lock.release()

    def _run_locked(self, plan, request, sink, reporter) -> RunResult:
        reporter = reporter or NullReporter()
        sink = sink or NullSink()
        if request.mode not in MODES:
            raise FormatError("run request", f"{request.mode!r} is not one of {', '.join(MODES)}", "mode")
        n = len(request.input_ids)
        groups = run_micro_batches(n, plan, request.micro_batches)
        run_id = uuid.uuid4().hex[:12]
        devices = [s.device for s in plan.stages]
        lost = [d for d in devices if self._conns[d].lost]
        if lost:
            raise RunFailed("agent is not answering", lost[0])
        run = _ActiveRun(run_id=run_id, t0=time.time(), stages={d: i for i, d in enumerate(devices)}, sink=sink,
                         done=cf.Future())
        self._run = run
        t_start = time.perf_counter()
        try:
            # downstream stages first, so they are waiting when the source's data arrives
            for i in reversed(range(len(devices))):
                d = devices[i]
                if i == 0:
                    run.t0 = time.time()
                    msg = StartRun(run_id=run_id, mode=request.mode, max_new_tokens=request.max_new_tokens,
                                   micro_batches=groups, input_ids=request.input_ids,
                                   attention_mask=request.attention_mask, eos_token_ids=request.eos_token_ids,
                                   pad_token_id=request.pad_token_id, sampling=request.sampling,
                                   lease_s=self.lease_s)
                else:
                    msg = StartRun(run_id=run_id, mode=request.mode, max_new_tokens=request.max_new_tokens,
                                   sampling=request.sampling, lease_s=self.lease_s)
                reply = self._await(d, self.request_async(d, msg), self.request_timeout_s, "starting the run")
                if isinstance(reply, ErrorReply):  # e.g. nothing loaded (a failure unloaded it): load the plan first
                    raise RunFailed(f"cannot start the run ({reply.code}): {reply.message}", d)
            reporter.status(f"running {request.mode} over {len(devices)} stages")
            while True:
                try:
                    tokens = run.done.result(timeout=0.1)
                    break
                except cf.TimeoutError:
                    if reporter.cancel_requested():
                        run.operator_stop = True
                        raise RunFailed("run cancelled") from None
                    with run.lock:
                        got = sum(1 for t in run.tokens)
                    reporter.progress(min(got, request.max_new_tokens * len(groups)),
                                      request.max_new_tokens * len(groups))
        except BaseException as err:
            self._stop_all(devices, run_id)
            if not run.operator_stop and not isinstance(err, KeyboardInterrupt):
                self._unload_after_failure(devices)
            self._run = None
            raise
        self._stop_all(devices, run_id)
        self._run = None
        with run.lock:
            events = tuple(sorted(run.events, key=lambda e: (e.start_s, e.stage)))
            toks = tuple(sorted(run.tokens, key=lambda t: t.t_s))
        return RunResult(run_id=run_id, tokens=tuple(tuple(t) for t in tokens), events=events, token_events=toks,
                         clocks=self.clocks(), wall_s=time.perf_counter() - t_start)

    def _stop_all(self, devices: list[str], run_id: str) -> None:
        """Tell every live agent to end ``run_id``; their replies come after their last events."""
        futs = [(d, self.request_async(d, StopRun(run_id=run_id))) for d in devices if not self._conns[d].lost]
        for d, f in futs:
            try:
                self._await(d, f, 5.0, "stopping")
            except RunFailed:
                pass

    def stop(self) -> None:
        """Abort the current run from another thread (the GUI's Stop button)."""
        run = self._run
        if run is not None and not run.done.done():
            run.operator_stop = True
            run.done.set_exception(RunFailed("run stopped by the operator"))
