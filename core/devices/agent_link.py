"""The coordinator's connections to its agents: control sockets, requests, heartbeats.

One IO thread owns every control socket (zmq sockets are not thread-safe): callers on
any thread submit requests and wait on futures; the IO thread also pings every agent
every ``heartbeat_interval_s`` (the pings double as clock probes, ``core.devices.clock_sync``)
and hands what agents send unasked (a run's events and tokens) to ``on_stream``.

Failure detection: an agent whose pongs stop for ``heartbeat_timeout_s`` (default 2 s,
pinged every 0.5 s, so noticed within 2.5 s) is declared lost: its pending requests fail
and the lost listeners are told. Silence is judged against pings that were really sent,
after draining what already arrived, so a link whose own IO thread was held up (a slow
sink, the GIL held by an import in the GUI process) does not declare healthy agents lost.
An agent that answers again after being declared lost is told to stop and unload (back to
idle). An agent whose frames carry another protocol version (other code on the device) is
declared lost at once, and every request to it fails with ``AgentVersionMismatch`` naming both
versions and ``edgeshard agents upgrade``. Profiling replies are checked to hold the result
type the request asked for. Nothing here touches Qt: callbacks are plain callables run on the
IO thread.

The devices wing uses this link directly (deploy, profiling, the local cluster); the
runs wing's ``Coordinator`` loads and runs plans over it.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import overload

import msgspec
import zmq

import agents.techniques  # noqa: F401  (registers the built-in techniques' wire: their replies decode here)
from agents.protocol import (
    PROTOCOL_VERSION,
    RESULT_OF,
    UPGRADE_HINT,
    AgentStatus,
    ComputeOptions,
    ComputeProfile,
    ConvSweepOptions,
    ConvTimings,
    ErrorReply,
    GetLogs,
    GetStatus,
    LinkOptions,
    LinkResult,
    Logs,
    MeasureLink,
    PeerSpec,
    Ping,
    Pong,
    ProfileCompute,
    ProfileResult,
    ProtocolError,
    StopRun,
    Unload,
    VersionMismatch,
    decode_control,
    encode_control,
)
from agents.transport import CurveKeys, curve_client, harden
from core.devices.clock_sync import ClockEstimate, ClockSample, best_estimate, clock_sample, keep_recent
from core.errors import AgentBusy, AgentVersionMismatch, RunFailed, ShardOverBudget

log = logging.getLogger("edgeshard.coordinator")

MAX_REPLY_FRAME = 64 << 20
"""Largest control frame the coordinator decodes (event batches of long runs are big)."""


@dataclass(frozen=True)
class AgentEndpoint:
    """How the coordinator reaches one agent's control socket."""

    device: str
    control_address: str
    """``tcp://host:port``"""
    public_key: str
    """The agent's CurveZMQ public key (Z85)."""


@dataclass
class _Conn:
    endpoint: AgentEndpoint
    sock: zmq.Socket
    last_pong: float = 0.0
    connected_at: float = 0.0
    clock: ClockEstimate | None = None
    samples: tuple[ClockSample, ...] = ()
    lost: bool = False
    unanswered_since: float | None = None
    """When the oldest ping not yet followed by a pong was sent (monotonic)."""
    mismatch: object = None
    """The protocol version of a frame the agent sent that was not ours (None: none seen): every
    request then fails with ``AgentVersionMismatch``."""

    def version_error(self) -> AgentVersionMismatch:
        return AgentVersionMismatch(self.endpoint.device, self.mismatch, PROTOCOL_VERSION, UPGRADE_HINT)


StreamHandler = Callable[[str, object], None]
"""``(device, message)`` for each unsolicited message (``req == 0``) an agent sends."""
LostHandler = Callable[[str, str], None]
"""``(device, why)`` when an agent is declared lost."""


ANSWER_WITHIN_S = 3.0
"""How long a command waits for an agent's first status before it fails naming the agent: a live
agent answers in milliseconds (also while it loads), a dead one never (was 30 s of silence)."""


REFUSED_AFTER_S = 0.3
"""How long ``AgentLink.answering`` waits for an agent's status before it asks whether anything
listens at the agent's port (a live agent answers in milliseconds)."""


def refuses_connections(address: str, timeout_s: float = 0.5) -> bool:
    """Whether ``tcp://HOST:PORT`` actively refuses a TCP connection (nothing listens there); False when
    it accepts, when the host does not answer within ``timeout_s`` or for another transport."""
    import socket

    if not address.startswith("tcp://"):
        return False
    host, _, port = address[len("tcp://"):].rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False


class AgentLink:
    """Live control connections to a set of agents. Use as a context manager."""

    def __init__(
        self,
        endpoints: Sequence[AgentEndpoint],
        keys: CurveKeys,
        *,
        heartbeat_interval_s: float = 0.5,
        heartbeat_timeout_s: float = 2.0,
        request_timeout_s: float = 10.0,
        on_stream: StreamHandler | None = None,
    ) -> None:
        if len({e.device for e in endpoints}) != len(endpoints):
            raise ValueError("two endpoints share a device name")
        self.endpoints = {e.device: e for e in endpoints}
        self.keys = keys
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.request_timeout_s = request_timeout_s
        self.on_stream = on_stream
        self.on_lost: Callable[[str], None] | None = None
        """Told the device's name when an agent is declared lost (after the lost listeners)."""
        self._lost_listeners: list[LostHandler] = []
        self._ctx = zmq.Context()
        self._conns: dict[str, _Conn] = {}
        self._pending: dict[int, tuple[str, cf.Future]] = {}
        self._submit: queue.Queue = queue.Queue()
        self._ids = itertools.count(1)
        self._wake_r, self._wake_w = os.pipe()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "AgentLink":
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

    def add_lost_listener(self, listener: LostHandler) -> None:
        """Also call ``listener(device, why)`` (on the IO thread) when an agent is declared lost."""
        self._lost_listeners.append(listener)

    def is_lost(self, device: str) -> bool:
        conn = self._conns.get(device)
        return conn is not None and conn.lost

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
            self.forget(fut)
            raise RunFailed(f"no reply to {type(msg).__name__} within {timeout_s or self.request_timeout_s:g} s",
                            device) from None
        if isinstance(reply, ErrorReply):
            raise refusal(reply, f"{type(msg).__name__} refused", device)
        return reply

    def request_async(self, device: str, msg) -> cf.Future:
        if device not in self.endpoints:
            raise RunFailed("no agent address is known for this device (add it to the agents list)", device)
        fut: cf.Future = cf.Future()
        conn = self._conns.get(device)
        if conn is not None and conn.mismatch is not None:  # it cannot read what we would send
            fut.set_exception(conn.version_error())
            return fut
        req = next(self._ids)
        msg = msgspec.structs.replace(msg, req=req)
        self._pending[req] = (device, fut)
        self._submit.put((device, encode_control(msg)))
        self._wake()
        return fut

    def forget(self, fut: cf.Future) -> None:
        """Drop a request nobody waits for any more (a reply arriving later is ignored)."""
        for req, (_, f) in list(self._pending.items()):
            if f is fut:
                self._pending.pop(req, None)

    def await_reply(self, device: str, fut: cf.Future, timeout_s: float, what: str, *, peers: Sequence[str] = ()):
        """The reply in ``fut``; ``RunFailed`` as soon as ``device`` or one of ``peers`` (agents it
        waits on over the data plane) is lost, or after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return fut.result(timeout=0.2)
            except cf.TimeoutError:
                for d in (device, *peers):
                    if self.is_lost(d):
                        raise RunFailed(f"agent lost while {what}", d) from None
                if time.monotonic() > deadline:
                    raise RunFailed(f"no answer while {what} after {timeout_s:.0f} s", device) from None

    # ------------------------------------------------------------------ IO thread
    def _io_loop(self) -> None:
        poller = zmq.Poller()
        for c in self._conns.values():
            poller.register(c.sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        by_sock = {c.sock: c for c in self._conns.values()}
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
        """Handle every message already received from ``c`` (IO thread). The socket is asked whether one is
        there before each read: a read that finds none raises ``zmq.Again``, ~35 µs of this thread's CPU under
        a server's load (the exception, and the GIL the read lets go of), where the question costs ~3."""
        while c.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
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
        (so a link that itself sent no pings for a while cannot blame the agent)."""
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
            self._declare_lost(c, f"no heartbeat for {now - c.last_pong:.1f} s")

    def _declare_lost(self, c: _Conn, why: str, error: Callable[[], RunFailed] | None = None) -> None:
        dev = c.endpoint.device
        c.lost = True
        self._fail_pending_of(dev, why, error)
        for listener in self._lost_listeners:
            listener(dev, why)
        if self.on_lost:
            self.on_lost(dev)

    def _fail_pending_of(self, device: str, why: str, error: Callable[[], RunFailed] | None = None) -> None:
        """Fail ``device``'s pending requests with ``RunFailed(why)`` (or a fresh ``error()`` each)."""
        for req, (dev, fut) in list(self._pending.items()):
            if dev == device and not fut.done():
                self._pending.pop(req, None)
                fut.set_exception(error() if error is not None else RunFailed(why, device))

    def _on_version_mismatch(self, c: _Conn, err: VersionMismatch) -> None:
        """A frame of another protocol version is the agent's own code speaking (Curve vouches for
        the sender): it cannot be used. An older agent answers every request so (with no request
        id), and never pongs, so it is declared lost at once with the reason, not after the
        heartbeat timeout with a timed-out request."""
        if c.mismatch is not None:  # a request sent just before the first refusal was seen
            self._fail_pending_of(c.endpoint.device, "", c.version_error)
            return
        got = err.received
        c.mismatch = got if type(got) is int else "none" if got is None else repr(got)[:40]
        error = c.version_error()
        log.warning("%s", error)
        self._declare_lost(c, error.reason, c.version_error)

    def _on_message(self, c: _Conn, frame: bytes) -> None:
        try:
            msg = decode_control(frame, max_size=MAX_REPLY_FRAME)
        except VersionMismatch as err:
            self._on_version_mismatch(c, err)
            return
        except ProtocolError as err:  # any bytes: dropped with the reason, the IO thread goes on
            log.warning("dropped a control frame from %s: %s: %s", c.endpoint.device, err.code, err)
            entry = self._pending.get(err.req) if err.req else None
            if entry is not None and entry[0] == c.endpoint.device:  # the request it answers fails now, with why
                self._pending.pop(err.req, None)
                if not entry[1].done():
                    entry[1].set_exception(RunFailed(f"its reply does not decode ({err.code}): {err}", entry[0]))
            return
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
            c.samples = keep_recent(c.samples, clock_sample(msg.t0, msg.t1, msg.t2, t3))
            c.clock = best_estimate(c.samples)
            if not msg.req:
                return
        if msg.req:
            entry = self._pending.pop(msg.req, None)
            if entry is not None and not entry[1].done():
                entry[1].set_result(msg)
            return
        if self.on_stream is not None and not isinstance(msg, ErrorReply):
            self.on_stream(c.endpoint.device, msg)

    # ---------------------------------------------------------------- operations
    def status(self, timeout_s: float = 5.0, devices: Sequence[str] | None = None) -> dict[str, AgentStatus]:
        """Every agent's status (or ``devices``'), ``RunFailed`` naming the first silent for ``timeout_s``."""
        futs = {d: self.request_async(d, GetStatus()) for d in (self.endpoints if devices is None else devices)}
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
        return {d: self.await_reply(d, f, timeout_s, "reporting its status") for d, f in futs.items()}

    def not_answering(self, devices: Sequence[str], timeout_s: float) -> tuple[str, ...]:
        """Those of ``devices`` lost now (``unreachable``, without the reasons)."""
        return tuple(self.unreachable(devices, timeout_s))

    def unreachable(self, devices: Sequence[str], timeout_s: float) -> dict[str, str]:
        """Those of ``devices`` lost now, each with why: declared lost, silent while its port refuses connections
        (killed: named after ``REFUSED_AFTER_S``, not the whole wait; a live peer may notice before the heartbeats
        run out), or silent for ``timeout_s`` (a host that does not answer). Answers once every live one has."""
        deadline = time.monotonic() + timeout_s
        futs = {d: self.request_async(d, GetStatus()) for d in devices if not self.is_lost(d)}
        why = {d: "declared lost: its heartbeats stopped" for d in devices if d not in futs}
        cf.wait(list(futs.values()), timeout=min(REFUSED_AFTER_S, timeout_s))
        for d, f in futs.items():
            if not f.done() and self._not_listening(d, f):
                why[d] = f"nothing listens at {self.endpoints[d].control_address}: its agent is not running"
        cf.wait([f for d, f in futs.items() if d not in why], timeout=max(0.0, deadline - time.monotonic()))
        for d, f in futs.items():
            self.forget(f)
            if d in why:
                continue
            if not f.done():
                why[d] = f"no answer within {timeout_s:g} s: its host is down or cut off, or the key is wrong"
            elif f.exception() is not None or isinstance(f.result(), ErrorReply):
                why[d] = str(f.exception() or f.result().message)
        return {d: why[d] for d in devices if d in why}

    def wait_ready(self, timeout_s: float = 10.0, devices: Sequence[str] | None = None) -> dict[str, AgentStatus]:
        """Status of every agent (or ``devices``), waiting (up to ``timeout_s``) for them to come up."""
        return self.status(timeout_s, devices)

    def answering(self, devices: Sequence[str] | None = None, timeout_s: float = ANSWER_WITHIN_S) -> dict[str, AgentStatus]:
        """Every agent's (or ``devices``') status, or ``RunFailed`` naming the first that is not there: a
        command's first contact, before its heavy imports. An agent silent after ``REFUSED_AFTER_S`` whose
        port refuses a TCP connection is not running (killed, crashed: its host answers for it) and is named
        at once; one whose host does not answer (down, unplugged) waits out ``timeout_s``."""
        wanted = list(self.endpoints if devices is None else devices)
        futs = {d: self.request_async(d, GetStatus()) for d in wanted}
        deadline = time.monotonic() + timeout_s
        cf.wait(list(futs.values()), timeout=min(REFUSED_AFTER_S, timeout_s))
        for d, f in futs.items():
            if not f.done() and self._not_listening(d, f):
                for other in futs.values():
                    self.forget(other)
                raise RunFailed(f"no answer and nothing listens at {self.endpoints[d].control_address}: is its agent "
                                "running? (start it, or leave it out of the agents file)", d)
        out = {}
        for d, f in futs.items():
            try:
                out[d] = f.result(timeout=max(0.0, deadline - time.monotonic()))
            except cf.TimeoutError:
                raise RunFailed(f"agent did not answer within {timeout_s:.0f} s (is it running, is the key right?)",
                                d) from None
        return out

    def _not_listening(self, device: str, fut: cf.Future) -> bool:
        """Whether ``device``'s port refused two connections ``REFUSED_AFTER_S`` apart while its status stayed
        unanswered: one refusal alone was seen to name a live agent that answered late (load 10-13)."""
        address = self.endpoints[device].control_address
        if not refuses_connections(address):
            return False
        cf.wait([fut], timeout=REFUSED_AFTER_S)
        return not fut.done() and refuses_connections(address)

    def sync_clocks(self, samples: int = 8, timeout_s: float = 5.0) -> dict[str, ClockEstimate]:
        """Probe every agent ``samples`` times; keep the minimum-RTT estimate."""
        for _ in range(samples):
            futs = [(d, self.request_async(d, Ping(t0=time.time()))) for d in self.endpoints]
            for d, f in futs:
                try:
                    f.result(timeout=timeout_s)
                except cf.TimeoutError:
                    for _, other in futs:
                        self.forget(other)
                    raise RunFailed(f"no answer to a clock probe within {timeout_s:g} s", d) from None
        return self.clocks()

    def clocks(self) -> dict[str, ClockEstimate]:
        return {d: c.clock for d, c in self._conns.items() if c.clock is not None}

    def clock_of(self, device: str) -> ClockEstimate | None:
        conn = self._conns.get(device)
        return conn.clock if conn is not None else None

    def logs(self, device: str, lines: int = 200) -> tuple[str, ...]:
        reply = self.request(device, GetLogs(lines=lines))
        return reply.lines if isinstance(reply, Logs) else ()

    @overload
    def profile_compute(self, device: str, options: ComputeOptions, timeout_s: float = 600) -> ComputeProfile: ...

    @overload
    def profile_compute(self, device: str, options: ConvSweepOptions, timeout_s: float = 600) -> ConvTimings: ...

    def profile_compute(self, device, options, timeout_s=600):
        """The device's measurement of ``options``: unit timings or convolution timings."""
        reply = self.request(device, ProfileCompute(options=options), timeout_s)
        return profile_outcome(device, reply, RESULT_OF[type(options)])

    def measure_link(self, src: str, peer: PeerSpec, options: LinkOptions, timeout_s: float = 120) -> LinkResult:
        reply = self.request(src, MeasureLink(peer=peer, options=options), timeout_s)
        return profile_outcome(src, reply, LinkResult)


HOLDER_POLL_SLACK_S = 0.05
"""How much two status round trips may disagree with each other on this clock."""


def holder_heard_between_polls(silent_s: float, since_last_poll_s: float | None) -> bool:
    """Whether the coordinator holding an agent was heard between two of our status polls
    ``since_last_poll_s`` apart (None: this is the first poll): a silent holder's silence grows by
    at least the time between the polls; one heard meanwhile restarted it below that. (Comparing
    two sampled silences missed a holder that heartbeats at nearly the polls' own period: the
    sampled silence crept upward for 20 s before it wrapped.)"""
    return since_last_poll_s is not None and silent_s + HOLDER_POLL_SLACK_S < since_last_poll_s


def refusal(reply: ErrorReply, what: str, device: str) -> RunFailed:
    """The typed error of an agent's ``ErrorReply`` to ``what``: ``AgentBusy`` when it serves other
    work (its message says which and whose), ``ShardOverBudget`` when it would exceed its memory
    budget (the message names the need and the budget), else ``RunFailed`` with the agent's code."""
    if reply.code == "busy":
        return AgentBusy(f"{what}: {reply.message}", device)
    if reply.code == "over_budget":
        return ShardOverBudget(f"{what} (over_budget): {reply.message}", device)
    return RunFailed(f"{what} ({reply.code}): {reply.message}", device)


def unexpected_profile_reply(reply, expected: type) -> str:
    """Why ``reply`` does not answer a profiling request whose result is ``expected`` ("" if it does)."""
    if not isinstance(reply, ProfileResult):
        return f"unexpected reply {type(reply).__name__}, wanted a {expected.__name__}"
    if not isinstance(reply.result, expected):
        return f"the agent answered with a {type(reply.result).__name__}, wanted a {expected.__name__}"
    return ""


def profile_outcome(device: str, reply, expected: type):
    """The result a profiling request asked for, or ``RunFailed`` naming what came instead."""
    problem = unexpected_profile_reply(reply, expected)
    if problem:
        raise RunFailed(problem, device)
    return reply.result


def unanswering_agents(endpoints: Sequence[AgentEndpoint], keys: CurveKeys, timeout_s: float = 3.0) -> dict[str, str]:
    """The devices whose agent does not answer a status request (asked all at once), each with why: the
    offline ones a solver must leave out (``core.planning.problem.without_offline``). One whose port refuses
    connections is named at once; only a silent host waits out ``timeout_s`` (``AgentLink.unreachable``)."""
    with AgentLink(endpoints, keys, heartbeat_timeout_s=max(2.0, timeout_s)) as link:
        return link.unreachable([e.device for e in endpoints], timeout_s)
