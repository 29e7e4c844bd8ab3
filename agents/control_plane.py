"""The agent's control thread: the control socket, replies and streamed events (the ``Agent``'s
part that listens).

It blocks on a zmq Poller over the control ROUTER socket and a wake-up pipe, answers pings and
status at once (so heartbeats keep flowing while the stage computes), hands long work to the
worker, forwards what the worker produced (replies, tokens, run results) and flushes timeline
events about every 50 ms. It must never wait on the worker. A technique's message reaches its
``agents.registry.Handler``, found by the message's type.
"""

from __future__ import annotations

import os
import time

import zmq

from agents import AGENT_VERSION, registry
from agents.accelerators import unavailable_device
from agents.process_title import CONTROL_THREAD_NAME, name_this_thread
from agents.protocol import (
    PROTOCOL_VERSION,
    UPGRADE_HINT,
    Accelerator,
    AgentState,
    AgentStatus,
    ErrorReply,
    EventBatch,
    GetLogs,
    GetStatus,
    LoadShard,
    Logs,
    MeasureLink,
    Ok,
    Ping,
    Pong,
    ProfileCompute,
    ProtocolError,
    PutWeights,
    QueryWeights,
    StartRun,
    StopRun,
    Unload,
    VersionMismatch,
    WeightsHeld,
    decode_control,
    encode_control,
)
from agents.weights import WeightStoreError

EVENT_FLUSH_S = 0.05
LEASE_CHECK_MS = 250
"""The control thread's longest sleep: how late an expired run lease can be noticed."""


class ControlPlane:
    """Mixed into ``agents.agent.Agent``: its sockets and state fields are the agent's own."""

    def _status(self, req: int, identity: bytes | None = None) -> AgentStatus:
        loaded = self._loaded
        owner = self._owner()
        held_by = "" if owner is None else ("you" if owner == identity else "another coordinator")
        return AgentStatus(
            req=req,
            device=self.device,
            agent_version=AGENT_VERSION,
            state=self._state,
            public_key=self.keys.public,
            data_address=self.data_address,
            stage=loaded.msg.stage if loaded else -1,
            units=(loaded.msg.start, loaded.msg.end) if loaded else (0, 0),
            memory_bytes=int(loaded.executor.memory_bytes()) if loaded else 0,
            kv_reserved_bytes=int(getattr(loaded.executor, "kv_reserved_bytes", 0)) if loaded else 0,
            kv_bytes=int(loaded.executor.kv_bytes()) if loaded and hasattr(loaded.executor, "kv_bytes") else 0,
            error=self._error,
            pid=os.getpid(),
            activity=self._activity,
            progress=self._progress,
            held_by=held_by,
            holder_silent_s=self._silent_s(owner),
            wire_sent=self.wire.snapshot(),
            accelerators=tuple(Accelerator(name=n, model=m, memory_bytes=b) for n, m, b in self.accelerators.devices()),
        )


    # -------------------------------------------------------------- control thread
    def _control_loop(self) -> None:
        name_this_thread(CONTROL_THREAD_NAME)  # a host placing local agents tells it from the stage's compute by it
        sock = self._control
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        last_flush = time.monotonic()
        while not self._shutdown.is_set():
            timeout = EVENT_FLUSH_S * 1000 if self._events or self._state is AgentState.RUNNING else LEASE_CHECK_MS
            ready = dict(poller.poll(timeout))
            if sock in ready:
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        break
                    try:
                        self._on_control(frames)
                    except Exception as err:  # the control thread must outlive any frame
                        self._log(f"control frame not handled: {type(err).__name__}: {err}")
            self._check_lease()
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
            if self._outbox:
                self._drain_outbox()
                last_flush = time.monotonic()
            if self._events and time.monotonic() - last_flush >= EVENT_FLUSH_S:
                self._flush_events()
                last_flush = time.monotonic()
        sock.close(linger=0)

    def _drain_outbox(self) -> None:
        """Send the events and messages the worker queued (control thread only)."""
        self._flush_events()
        while self._outbox:
            to, msg = self._outbox.popleft()
            self._send_to_coordinator(msg, to)

    def _send_to_coordinator(self, msg, identity: bytes | None = None) -> None:
        ident = identity or self._coordinator_identity
        if ident is None:
            return
        try:
            encoded = encode_control(msg)
            self._control.send_multipart([ident, encoded], zmq.NOBLOCK)
            self.wire.add("coordinator", type(msg).__struct_config__.tag, len(encoded))
        except zmq.ZMQError as err:  # coordinator gone: nothing to do but note it
            self._logs.append(f"cannot reach coordinator: {err}")

    def _flush_events(self) -> None:
        if not self._events:
            return
        batch = []
        while self._events:
            batch.append(self._events.popleft())
        run_id, stage = self._event_meta
        self._send_to_coordinator(EventBatch(run_id=run_id, device=self.device, stage=stage, events=tuple(batch)),
                                  self._stream_peer())

    def _on_control(self, frames: list[bytes]) -> None:
        identity = frames[0]
        if len(frames) != 2:
            self._reply_error(identity, 0, "bad_frame", f"expected one frame per message, got {len(frames) - 1}")
            return
        try:
            msg = decode_control(frames[1])
        except VersionMismatch as err:
            # answered in an older coordinator's own version, echoing its request id, so its
            # request fails with this reason instead of timing out on a reply it cannot read
            why = (f"this agent speaks protocol version {PROTOCOL_VERSION}, the coordinator sent version "
                   f"{err.received!r}: {UPGRADE_HINT}")
            self._log(f"rejected control frame: {err.code}: {why}")
            self._send_to_coordinator(ErrorReply(v=err.reply_version, req=err.req, code=err.code, message=why),
                                      identity)
            return
        except ProtocolError as err:
            self._log(f"rejected control frame: {err.code}: {err}")
            self._reply_error(identity, err.req, err.code, str(err))
            return
        self._coordinator_identity = identity
        self._hear(identity)
        if identity == self._lease_holder:
            self._lease_renewed = time.monotonic()
        req = msg.req
        if isinstance(msg, Ping):
            t1 = self.clock()
            self._send_to_coordinator(Pong(req=req, t0=msg.t0, t1=t1, t2=self.clock(), state=self._state), identity)
        elif isinstance(msg, GetStatus):
            # read the state, then send what the worker posted before it: a "ready" read after
            # a run ended must not overtake that run's RunFinished (it would look like mid-run)
            status = self._status(req, identity)
            self._drain_outbox()
            self._send_to_coordinator(status, identity)
        elif isinstance(msg, GetLogs):
            lines = tuple(list(self._logs)[-max(0, msg.lines) :]) if msg.lines else ()
            self._send_to_coordinator(Logs(req=req, lines=lines), identity)
        elif isinstance(msg, (QueryWeights, PutWeights)):
            self._on_weights(identity, msg)
        elif refusal := self._refusal(identity, msg):
            self._log(f"refused {msg.type_name()}: {refusal}")
            self._reply_error(identity, req, "busy", refusal)
        elif isinstance(msg, StopRun):
            if msg.run_id and msg.run_id != self._run_id and self._state is AgentState.RUNNING:
                # not the run it serves: answered now, not queued behind that run
                self._send_to_coordinator(Ok(req=req, detail=f"run {msg.run_id} is not running here"), identity)
                return
            # a stop names its run (empty: the current one); a late stop of an earlier run
            # must not end the next. The state changes only where the run ends (``_run``).
            if not msg.run_id or msg.run_id == self._run_id:
                self._stop_run.set()
            self._work.put(("stop", msg, None, identity))
        elif isinstance(msg, (LoadShard, Unload, StartRun, ProfileCompute, MeasureLink)):
            if isinstance(msg, StartRun):
                if self._loaded is None or self._state is not AgentState.READY:
                    self._reply_error(identity, req, "bad_state", f"cannot start a run while {self._state}")
                    return
                self._take_run(identity, msg)
                return
            elif isinstance(msg, LoadShard):
                refusal = unavailable_device(msg.torch_device, tuple(n for n, _, _ in self.accelerators.devices()))
                if refusal:
                    self._reply_error(identity, req, "no_device", refusal)
                    return
                self._state = AgentState.LOADING
                self._loader = identity
            self._work.put((type(msg).__name__, msg, self._stop_run, identity))
        elif (handler := registry.handler_for(type(msg))) is not None and (handler.serve or handler.on_control):
            self._on_technique_request(identity, msg, handler)
        else:
            self._reply_error(identity, req, "bad_message", f"{type(msg).__name__} is not a request")

    def _on_technique_request(self, identity: bytes, msg, handler: registry.Handler) -> None:
        """A registered technique's request: refused by its handler's ``admit``, handed over on this
        thread (``on_control``), started as the agent's run (``takes_run``) or queued for the worker."""
        refused = handler.admit(self, msg) if handler.admit is not None else None
        if refused is None and handler.on_control is not None:
            refused = handler.on_control(self, identity, msg)
            if refused is None:
                return
        if refused is not None:
            self._reply_error(identity, msg.req, *refused)
        elif handler.takes_run:
            self._take_run(identity, msg)
        else:
            self._work.put(("handler", msg, None, identity))

    def _on_weights(self, identity: bytes, msg) -> None:
        """Answered on the control thread: a chunk is one append and the hash is kept running."""
        try:
            if isinstance(msg, QueryWeights):
                held = tuple(self.weights.have(d) for d in msg.digests)
            else:
                held = (self.weights.put(msg.digest, msg.offset, msg.size, msg.data),)
                if held[0] == msg.size:
                    self._log(f"received weights {msg.digest[:12]} ({msg.size / 2**20:.1f} MiB), checksum ok")
        except WeightStoreError as err:
            self._reply_error(identity, msg.req, "bad_weights", str(err))
        except OSError as err:  # disk full, permissions: the operator's to fix, the agent stays up
            self._log(f"cannot store weights in {self.weights.root}: {err}")
            self._reply_error(identity, msg.req, "failed", f"cannot store weights in {self.weights.root}: {err}")
        else:
            self._send_to_coordinator(WeightsHeld(req=msg.req, held=held), identity)

    def _reply_error(self, identity: bytes, req: int, code: str, message: str) -> None:
        self._send_to_coordinator(ErrorReply(req=req, code=code, message=message), identity)

