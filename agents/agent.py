"""The agent: serves one device's control socket and runs its stage of a plan.

Two threads, no busy polling:

- the **control thread** blocks on a zmq Poller over the control ROUTER socket and a
  wake-up pipe. It answers pings and status at once (so heartbeats keep flowing while the
  stage computes), hands long work to the worker, forwards what the worker produced
  (replies, tokens, run results) and flushes timeline events about every 50 ms;
- the **worker thread** does every long action — loading a shard, profiling, the stage
  loop of a run: block on the data PULL socket (with a timeout so a stop is noticed),
  compute, hand the result to libzmq (or to the emulated link's sender thread) and go back
  to waiting — sending overlaps compute. While it works, status reports what it is doing
  (``activity``) and how far it got (``progress``, e.g. blocks read while loading).

The control thread must never wait on the worker, and nothing the worker does may hold
the GIL for long: ``warm_imports()`` (called by ``python -m agents serve`` in a thread
right after it listens, so launchers see the agent ready seconds sooner) imports
transformers before any shard is loaded, because importing it the first time loads
extension modules under the GIL for up to a few hundred ms here (more on slow devices).
Pongs may be that late while it runs, well inside the 3 s heartbeat timeout; a load or
profile that arrives meanwhile waits for it (``MODEL_CODE_IMPORTED``).

The source stage (stage 0) also drives the run: it holds the prompts' token ids (they
never leave it), starts prefill and decode steps per micro-batch as ``agents.schedule``
decides for the mode, and receives the sampled tokens back from the last stage. Every
stage performs a step by executing ``agents.schedule.step_operations`` (receive, compute,
send): the schedule is written there once, and the simulator times the same operations.

Errors never kill the agent: a bad frame gets an ``ErrorReply``, a failing shard or run
a ``RunError`` naming this device, and the agent returns to a state it can report.
"""

from __future__ import annotations

import collections
import inspect
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import msgspec
import torch
import zmq

from agents import AGENT_VERSION
from agents.emulation import DeviceEmulation, ShardOverBudget, compute_began, emulated, end_emulated
from agents.executors import executor_factory_for
from agents.weights import WeightStore, WeightStoreError, default_root
from agents.schedule import Compute, Receive, Send, SourceState, Step, begin, on_returned, phase_of, step_operations
from agents.sampling import step_generator
from agents.stage_input import ReservationExceeded, StageInputError
from agents.protocol import (
    PROTOCOL_VERSION,
    UPGRADE_HINT,
    AgentEvent,
    AgentState,
    AgentStatus,
    PHASE_REQUESTS,
    DecodeTokens,
    AttendHeads,
    ClassifyImage,
    ComputeStrip,
    HeadsAttended,
    HoldDense,
    HoldHeads,
    DataHeader,
    ErrorReply,
    EventBatch,
    GetLogs,
    GetStatus,
    LinkShape,
    LoadShard,
    LogLine,
    Logs,
    MeasureLink,
    Ok,
    PeerSpec,
    Ping,
    Pong,
    ProfileCompute,
    ProfileResult,
    ProtocolError,
    PutWeights,
    QueryWeights,
    RunError,
    RunFinished,
    SamplingSpec,
    StartRun,
    StopRun,
    SpatialSetup,
    StripComputed,
    TokensProduced,
    Unload,
    VersionMismatch,
    WeightsHeld,
    decode_control,
    decode_data,
    encode_control,
)
from agents.transport import (
    CONTROL_DOMAIN,
    DATA_DOMAIN,
    CurveKeys,
    KeyGate,
    LinkSender,
    RunAborted,
    bind_port,
    curve_client,
    curve_server,
    data_message,
    harden,
    start_authenticator,
    tcp_address,
    tensor_frame,
    tensor_from_frame,
)

log = logging.getLogger("edgeshard.agent")

EVENT_FLUSH_S = 0.05
DATA_POLL_MS = 100
"""How long the stage loop blocks on its data socket before re-checking for a stop."""
SEND_TIMEOUT_MS = 200
LEASE_CHECK_MS = 250
"""The control thread's longest sleep: how late an expired run lease can be noticed."""
MAX_DATA_BYTES = 1 << 30
LOADER_SILENT_S = 5.0
"""A loaded stage belongs to the coordinator that loaded it while that coordinator speaks (its link
pings every 0.5 s); silent this long, another coordinator's spatial run or attention hold may
replace the stage (a CLI run that exited must not hold the device forever)."""


class AgentClock:
    """Wall-clock seconds with perf_counter resolution and monotonic steps.

    Events from different agents are placed on the coordinator's clock through an
    offset estimated from pings, so the agent's clock must be the one pings read.
    """

    def __init__(self) -> None:
        self._wall0 = time.time()
        self._perf0 = time.perf_counter()

    def __call__(self) -> float:
        return self._wall0 + (time.perf_counter() - self._perf0)

    def at(self, perf_counter_s: float) -> float:
        """This clock's reading at a past ``time.perf_counter()`` value (executors time with it)."""
        return self._wall0 + (perf_counter_s - self._perf0)




MODEL_CODE_IMPORTED = threading.Event()
"""Set once the model code is imported; the worker waits for it before loading or profiling,
because transformers' lazy modules break when two threads import them at once."""
MODEL_CODE_IMPORTED.set()  # an agent made in-process (tests) imports on first use, in its worker


def warm_imports() -> None:
    """Import what loading a shard needs (see the module docstring)."""
    import transformers.masking_utils  # noqa: F401
    from transformers import AutoModelForCausalLM, DynamicCache  # noqa: F401

    import agents.shard  # noqa: F401


def warm_imports_in_background(on_error) -> threading.Thread:
    """``warm_imports`` on a thread; loads and profiles wait for it (MODEL_CODE_IMPORTED)."""
    MODEL_CODE_IMPORTED.clear()

    def run() -> None:
        try:
            warm_imports()
        except ImportError as err:  # reported again, precisely, when a shard is loaded
            on_error(err)
        finally:
            MODEL_CODE_IMPORTED.set()

    t = threading.Thread(target=run, name="agent-warm-imports", daemon=True)
    t.start()
    return t


def default_sampler(spec: SamplingSpec):
    """Build ``(sample_fn, make_generator)`` from agents.sampling for a run."""
    from agents.sampling import SamplingParams, sample

    wanted = {"temperature": spec.temperature, "top_p": spec.top_p, "top_k": spec.top_k, "seed": spec.seed,
              "repetition_penalty": spec.repetition_penalty, "no_repeat_ngram_size": spec.no_repeat_ngram_size}
    accepted = inspect.signature(SamplingParams).parameters
    params = SamplingParams(**{k: v for k, v in wanted.items() if k in accepted})
    return lambda logits, gen, history=None: sample(logits, params, gen, history)


@dataclass
class _Group:
    """Source-side state of one micro-batch."""

    index: int
    seq_ids: tuple[int, ...]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    tokens: list[list[int]] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)
    last: torch.Tensor | None = None
    done: bool = False


def _batches(msg) -> bool:
    """A decode request that joins a continuous batch (one copy: profiling's copies run alone)."""
    return isinstance(msg, DecodeTokens) and msg.copies == 1


@dataclass
class _Loaded:
    msg: LoadShard
    executor: object
    next_peer: PeerSpec | None
    link: LinkShape
    source_device: str
    push: zmq.Socket | None = None
    sender: LinkSender | None = None

    @property
    def next_device(self) -> str:
        return self.next_peer.device if self.next_peer else ""


class Agent:
    """One device's agent. ``start()`` binds and launches the threads; ``close()`` joins them."""

    def __init__(
        self,
        device: str,
        coordinator_key: str,
        keys: CurveKeys | None = None,
        *,
        host: str = "127.0.0.1",
        control_port: int = 0,
        data_port: int = 0,
        advertise_host: str | None = None,
        executor_factory=None,
        sampler_factory=default_sampler,
        default_link: LinkShape | None = None,
        emulation: DeviceEmulation | None = None,
        weights_dir: str | os.PathLike | None = None,
    ) -> None:
        self.device = device
        self.coordinator_key = coordinator_key
        self.keys = keys or CurveKeys.generate()
        self.host = host
        self.advertise_host = advertise_host or (host if host not in ("0.0.0.0", "*") else "127.0.0.1")
        self._want_ports = (control_port, data_port)
        self.executor_factory = executor_factory
        self.sampler_factory = sampler_factory
        self.default_link = default_link or LinkShape()
        """Emulated shaping of this agent's outgoing data link unless a LoadShard sets one."""
        self.emulation = emulation or DeviceEmulation()
        """Emulated memory budget and compute slowdown (agents/emulation.py)."""
        self.weights = WeightStore(weights_dir or default_root())
        """Stage weights the coordinator sent, by content hash (agents/weights.py)."""
        self.clock = AgentClock()
        self.context = zmq.Context()
        self.gate = KeyGate()
        self.gate.allow(CONTROL_DOMAIN, [coordinator_key])
        self.gate.allow(DATA_DOMAIN, [])
        self._auth = None
        self.control_port = 0
        self.data_port = 0
        self._state = AgentState.IDLE
        self._error = ""
        self._activity = ""
        self._progress = 0.0
        self._loaded: _Loaded | None = None
        self._spatial_nets: dict = {}
        self._phase_links = None
        """EPD: (the loaded stage, its agents.phases.PhaseLinks), made at the stage's first phase request."""
        self._spatial_run = None
        """The spatial run this device takes part in (agents.spatial_run.SpatialSession), if any."""
        """Spatial partitioning's generated network, by its ``SpatialNet`` (one at a time)."""
        self._attention_stores: dict = {}
        """Attention offloading: (model_dir, kv_start, kv_stop) -> AttentionStore (agents.attention_offload)."""
        self._work: queue.Queue = queue.Queue()
        self._requeued: collections.deque = collections.deque()
        """Work taken off the queue while a decode batch ran that is not a phase request: it comes
        next, in order, once the batch is done."""
        self._outbox: collections.deque = collections.deque()
        self._events: collections.deque = collections.deque()
        self._event_meta = ("", 0)  # run_id, stage of the events in the deque
        self._stop_run = threading.Event()
        """Set to end the current run; a fresh Event per run, so a late stop of one run
        can never be cleared by (or leak into) the next."""
        self._run_id = ""
        """Id of the last run accepted (control thread): what a ``StopRun`` is compared with."""
        self._shutdown = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._logs: collections.deque[str] = collections.deque(maxlen=2000)
        self._coordinator_identity: bytes | None = None
        self._lease_holder: bytes | None = None
        """Control identity of the coordinator that started the current run (None: no lease)."""
        self._lease_s = 0.0
        self._lease_renewed = 0.0
        self._heard: dict[bytes, float] = {}
        """When each coordinator (control identity) last sent anything (monotonic)."""
        self._loader: bytes | None = None
        """The coordinator that loaded the current stage (the owner of a READY agent)."""
        self._run_owner: bytes | None = None
        """The coordinator that started the current run or held session (the owner of a RUNNING agent)."""
        self._worker_peer: bytes | None = None
        """The coordinator whose request the worker serves now (its replies go there)."""
        self._current = None
        """The message that started the current run or held session (StartRun, SpatialSetup, HoldHeads)."""
        self._threads: list[threading.Thread] = []
        self._data: zmq.Socket | None = None
        self._control: zmq.Socket | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def data_address(self) -> str:
        return tcp_address(self.advertise_host, self.data_port)

    @property
    def control_address(self) -> str:
        return tcp_address(self.advertise_host, self.control_port)

    def start(self) -> "Agent":
        self._auth = start_authenticator(self.context, self.gate)
        self._control = self.context.socket(zmq.ROUTER)
        harden(self._control)
        self._control.router_mandatory = False
        curve_server(self._control, self.keys, CONTROL_DOMAIN)
        self.control_port = bind_port(self._control, self.host, self._want_ports[0])
        self._data = self.context.socket(zmq.PULL)
        harden(self._data)
        self._data.rcvhwm = 1000
        self._data.rcvtimeo = DATA_POLL_MS  # the stage loop's blocking receive notices a stop
        curve_server(self._data, self.keys, DATA_DOMAIN)
        self.data_port = bind_port(self._data, self.host, self._want_ports[1])
        self._threads = [
            threading.Thread(target=self._control_loop, name=f"agent-control-{self.device}", daemon=True),
            threading.Thread(target=self._worker_loop, name=f"agent-worker-{self.device}", daemon=True),
        ]
        for t in self._threads:
            t.start()
        self._log(
            f"agent {self.device} up: control {self.control_address} data {self.data_address} "
            f"key {self.keys.public}"
        )
        return self

    def close(self, join_s: float = 5.0) -> bool:
        """Stop the agent's threads, waiting at most ``join_s`` for all of them together (not
        each); True if they ended. A work item in flight (a profile step, a stage's computation
        or its emulated slowdown) ends its thread only when it returns: a process being stopped
        (``agents.__main__``) gives it a short ``join_s`` and exits without it. Threads still
        running keep their sockets, so the sockets' context is then left to the process's end."""
        self._shutdown.set()
        self._stop_run.set()
        self._work.put(("shutdown", None, None, None))
        self._wake()
        deadline = time.monotonic() + join_s
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        left = [t for t in self._threads if t.is_alive()]
        self._threads = left
        if left:
            self._log(f"agent {self.device} stopping with {', '.join(t.name for t in left)} still busy")
            return False
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self.context.destroy(linger=0)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until ``close()`` was called (by a signal handler) or ``timeout``."""
        return self._shutdown.wait(timeout)

    # ------------------------------------------------------------------- helpers
    def _log(self, line: str) -> None:
        stamped = f"{time.strftime('%H:%M:%S')} {line}"
        self._logs.append(stamped)
        log.info(line)

    def receive_data(self, max_bytes: int) -> tuple[DataHeader, list[memoryview], float] | None:
        """The next message on the data socket as (header, tensor buffers, its arrival on this
        agent's clock), or None when the receive timed out (RCVTIMEO) or the message did not
        decode: a malformed frame is logged and dropped here, so no data-plane loop can hand
        one to its handler or die of it."""
        try:
            frames = self._data.recv_multipart(copy=False)
        except zmq.Again:
            return None
        received = self.clock()
        try:
            header, bufs = decode_data(frames, max_bytes)
        except ProtocolError as err:
            self._log(f"dropped data message: {err.code}: {err}")
            return None
        return header, bufs, received

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _post(self, msg, wake: bool = True, to: bytes | None = None) -> None:
        """Queue a message for the coordinator (any thread). ``wake=False``: the caller
        wakes the control thread later (``_wake_for_outbox``), off its hot path."""
        to = to or (self._worker_peer if msg.req else self._stream_peer())
        self._outbox.append((to, msg))
        if wake:
            self._wake()

    def _stream_peer(self) -> bytes | None:
        """Where a run's stream (events, tokens, its end) goes: the coordinator that started the run,
        not whoever spoke last (another coordinator asking for a status must not take it)."""
        return self._run_owner or self._coordinator_identity

    def _wake_for_outbox(self) -> None:
        if self._outbox:
            self._wake()

    def _event(self, kind: str, phase: str, step: int, mb: int, start: float, end: float, nbytes=0, peer=""):
        """Record a timeline event. During a run the control thread already flushes every
        EVENT_FLUSH_S, so it is not woken: a wake-up here lands between receive, compute and
        send, and the woken thread takes the GIL (and on a small machine the core) from the
        stage loop for a whole control-loop turn — it was most of a hop's cost."""
        was_empty = not self._events
        self._events.append(AgentEvent(kind, phase, step, mb, start, end, nbytes, peer))
        if was_empty and self._state is not AgentState.RUNNING:  # idle, the control loop sits in a long poll
            self._wake()

    def _owner(self) -> bytes | None:
        """The coordinator whose work this agent does now: its run's or session's, else its stage's."""
        if self._state is AgentState.RUNNING:
            return self._run_owner
        if self._state is AgentState.LOADING or self._loaded is not None:
            return self._loader
        return None

    def _silent_s(self, identity: bytes | None) -> float:
        heard = self._heard.get(identity) if identity is not None else None
        return 0.0 if heard is None else time.monotonic() - heard

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
            error=self._error,
            pid=os.getpid(),
            activity=self._activity,
            progress=self._progress,
            held_by=held_by,
            holder_silent_s=self._silent_s(owner),
        )

    # -------------------------------------------------------------- control thread
    def _control_loop(self) -> None:
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
            self._control.send_multipart([ident, encode_control(msg)], zmq.NOBLOCK)
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
        elif isinstance(msg, AttendHeads):
            if self._state is AgentState.LOADING:
                self._reply_error(identity, req, "bad_state", f"cannot attend while {self._state}")
                return
            self._work.put(("AttendHeads", msg, None, identity))
        elif isinstance(msg, PHASE_REQUESTS):
            if self._state is not AgentState.READY:
                self._reply_error(identity, req, "bad_state", f"cannot serve {msg.type_name()} while {self._state}: "
                                                              "load an epd-* stage first")
                return
            self._work.put(("phase", msg, None, identity))
        elif isinstance(msg, SpatialSetup):
            if self.device not in {p.device for p in msg.devices}:
                self._reply_error(identity, req, "bad_message", f"device {self.device} is not in this spatial plan")
                return
            self._take_run(identity, msg)
        elif isinstance(msg, (HoldHeads, HoldDense)):
            self._take_run(identity, msg)
        elif isinstance(msg, ClassifyImage):
            session = self._spatial_run
            if session is None or not session.is_gateway or msg.run_id != self._run_id:
                self._reply_error(identity, req, "bad_state",
                                  f"device {self.device} is not the gateway of spatial run {msg.run_id!r}")
                return
            session.images.put(msg)
        elif isinstance(msg, ComputeStrip):
            self._work.put(("ComputeStrip", msg, None, identity))
        elif isinstance(msg, (LoadShard, Unload, StartRun, ProfileCompute, MeasureLink)):
            if isinstance(msg, StartRun):
                if self._loaded is None or self._state is not AgentState.READY:
                    self._reply_error(identity, req, "bad_state", f"cannot start a run while {self._state}")
                    return
                self._take_run(identity, msg)
                return
            elif isinstance(msg, LoadShard):
                self._state = AgentState.LOADING
                self._loader = identity
            self._work.put((type(msg).__name__, msg, self._stop_run, identity))
        else:
            self._reply_error(identity, req, "bad_message", f"{type(msg).__name__} is not a request")

    def _hear(self, identity: bytes) -> None:
        self._heard[identity] = time.monotonic()
        if len(self._heard) > 64:  # coordinators come and go: keep the ones heard last
            for old in sorted(self._heard, key=self._heard.get)[:32]:
                if old not in (self._loader, self._run_owner):
                    del self._heard[old]

    _EXCLUSIVE = (LoadShard, StartRun, SpatialSetup, HoldHeads, HoldDense, ComputeStrip, ProfileCompute, MeasureLink)
    """Requests that need the worker to themselves or start work of their own: one at a time."""

    def _refusal(self, identity: bytes, msg) -> str:
        """Why ``msg`` may not run now because the agent serves other work ("" when it may).

        One coordinator's work at a time: while a run, a spatial session or an attention hold runs
        (or a stage loads) nothing else starts, and only its own coordinator unloads or stops it
        without naming it (a ``StopRun`` naming the run is honoured from anyone: the operator asked
        for that run). A stage another coordinator loaded and still speaks to is not replaced by a
        session of another technique (``LOADER_SILENT_S``); layer-sharding loads replace stages as
        before. A refusal is immediate: queued behind the work, the request would hang until it ended."""
        state = self._state
        if state in (AgentState.RUNNING, AgentState.LOADING):
            owner = self._owner()
            foreign = owner is not None and owner != identity
            if isinstance(msg, self._EXCLUSIVE) or (foreign and isinstance(msg, Unload)):
                return self._busy_text(identity, msg)
            if (isinstance(msg, StopRun) and not msg.run_id and state is AgentState.RUNNING and foreign
                    and self._lease_holder is not None):
                return self._busy_text(identity, msg)
            return ""
        if (state is AgentState.READY and isinstance(msg, (SpatialSetup, HoldHeads, HoldDense, Unload))
                and self._loader not in (None, identity) and self._silent_s(self._loader) < LOADER_SILENT_S):
            return self._busy_text(identity, msg)
        return ""

    def _doing(self) -> str:
        """What this agent serves, for an operator: the run or session, else the loaded stage."""
        cur, loaded = self._current, self._loaded
        if self._state is AgentState.LOADING:
            return "loading a stage"
        if self._state is AgentState.RUNNING:
            if isinstance(cur, SpatialSetup):
                role = "gateway" if cur.gateway == self.device else "a worker"
                return f"spatial run {cur.run_id} of {cur.net.network} (as {role})"
            if isinstance(cur, HoldHeads):
                return f"attention-offload hold {cur.run_id} (KV heads [{cur.kv_start}, {cur.kv_stop}))"
            if isinstance(cur, HoldDense):
                return f"attention-offload dense replica hold {cur.run_id} (replica {cur.replica})"
            if isinstance(cur, StartRun) and loaded is not None:
                return f"{loaded.msg.kind} run {cur.run_id} (units [{loaded.msg.start}, {loaded.msg.end}))"
            return "a run"
        if loaded is not None:
            m = loaded.msg
            return f"a loaded {m.kind} stage (units [{m.start}, {m.end}) of {os.path.basename(m.model_dir) or m.model_dir})"
        return "nothing"

    _WANTED = {"LoadShard": "load a stage", "StartRun": "start a run", "SpatialSetup": "join a spatial run",
               "HoldHeads": "hold attention heads", "HoldDense": "hold a dense replica",
               "ComputeStrip": "compute a strip", "ProfileCompute": "profile", "MeasureLink": "measure a link",
               "Unload": "unload", "StopRun": "stop a run it did not name"}

    def _busy_text(self, identity: bytes, msg) -> str:
        owner = self._owner()
        whose = "this coordinator" if owner == identity else "another coordinator"
        if self._state is AgentState.LOADING:
            ends = "try again once the load is done"
        elif self._state is AgentState.RUNNING and self._lease_holder is not None:
            ends = (f"it ends when {whose} stops it, or by itself {self._lease_s:g} s after that coordinator "
                    "goes silent")
        elif self._state is AgentState.RUNNING:
            ends = f"it ends when {whose} stops it"
        else:
            ends = (f"unload it from {whose}, or close that coordinator: once silent for {LOADER_SILENT_S:g} s "
                    "its stage may be replaced")
        return (f"cannot {self._WANTED.get(type(msg).__name__, msg.type_name())}: busy with {self._doing()} "
                f"for {whose}; {ends}")

    def _take_run(self, identity: bytes, msg) -> None:
        """Start a run the sender holds a lease on: a fresh stop event (a late stop of the
        last run cannot reach it), the run id a ``StopRun`` is compared with, then the work."""
        self._state = AgentState.RUNNING
        self._run_owner, self._current = identity, msg
        self._stop_run = threading.Event()
        self._run_id = msg.run_id
        self._lease_holder = identity if msg.lease_s > 0 else None
        self._lease_s = msg.lease_s
        self._lease_renewed = time.monotonic()
        self._work.put((type(msg).__name__, msg, self._stop_run, identity))

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

    def _check_lease(self) -> None:
        """Abort a run whose coordinator went silent (killed, stopped, cut off): the agent
        must not stay "running" for a coordinator that will never stop it."""
        if self._lease_holder is None or self._state is not AgentState.RUNNING:
            return
        silent = time.monotonic() - self._lease_renewed
        if silent > self._lease_s and not self._stop_run.is_set():
            why = f"run lease expired (coordinator silent for {silent:.1f} s): run aborted"
            self._log(f"run {self._run_id}: {why}")
            holder, self._lease_holder = self._lease_holder, None
            self._stop_run.set()
            # a coordinator that was only stopped (SIGSTOP) learns on SIGCONT why its run ended
            self._send_to_coordinator(RunError(run_id=self._run_id, device=self.device, message=why), holder)

    def _reply_error(self, identity: bytes, req: int, code: str, message: str) -> None:
        self._send_to_coordinator(ErrorReply(req=req, code=code, message=message), identity)

    # --------------------------------------------------------------- worker thread
    _ACTIVITIES = {"LoadShard": "loading", "ProfileCompute": "profiling compute", "MeasureLink": "measuring a link"}

    def _worker_loop(self) -> None:
        while True:
            kind, msg, stop, self._worker_peer = self._requeued.popleft() if self._requeued else self._work.get()
            if kind == "shutdown":
                break
            self._activity, self._progress = self._ACTIVITIES.get(kind, ""), 0.0
            if kind in ("StartRun", "SpatialSetup", "HoldHeads", "HoldDense"):
                self._activity = self._doing()
            if kind in ("LoadShard", "ProfileCompute"):
                MODEL_CODE_IMPORTED.wait()
            try:
                if kind == "LoadShard":
                    self._load(msg)
                elif kind == "Unload":
                    self._unload()
                    self._state = AgentState.IDLE
                    self._post(Ok(req=msg.req, detail="unloaded"))
                elif kind == "StartRun":
                    self._post(Ok(req=msg.req, detail="started"))
                    self._run(msg, stop)
                elif kind == "stop":  # queued behind the run it stops: the reply follows its last events
                    self._post(Ok(req=msg.req, detail="stopped"))
                elif kind == "ProfileCompute":
                    from agents import profiler

                    self._post(ProfileResult(req=msg.req, result=profiler.profile_compute(self, msg.options)))
                elif kind == "SpatialSetup":
                    self._spatial(msg, stop)
                elif kind == "HoldHeads":
                    self._hold_heads(msg, stop)
                elif kind == "HoldDense":
                    self._hold_dense(msg, stop)
                elif kind == "ComputeStrip":
                    self._post(self._compute_strip(msg))
                elif kind == "AttendHeads":
                    self._post(self._attend_heads(msg))
                elif kind == "phase":
                    self._serve_phases(msg)
                elif kind == "MeasureLink":
                    from agents import profiler

                    self._post(ProfileResult(req=msg.req, result=profiler.measure_link(self, msg.peer, msg.options)))
                self._activity, self._progress = "", 0.0
            except Exception as err:  # a failure of this device's work, reported, never fatal
                self._activity, self._progress = "", 0.0
                self._log(f"{kind} failed: {type(err).__name__}: {err}")
                if kind == "LoadShard":
                    self._unload()
                    self._state = AgentState.FAILED
                    self._error = f"{type(err).__name__}: {err}"
                code = err.code if isinstance(err, ShardOverBudget) else "failed"
                code = "bad_weights" if isinstance(err, WeightStoreError) else code
                self._post(ErrorReply(req=msg.req if msg else 0, code=code, message=f"{type(err).__name__}: {err}"))
        self._unload()
        if self._data is not None:
            self._data.close(linger=0)

    def _load(self, msg: LoadShard) -> None:
        self._unload()
        self._spatial_nets.clear()  # a kept spatial network's memory goes to the stage
        t0 = time.perf_counter()
        self._activity = f"loading units [{msg.start}, {msg.end}) of {msg.model_dir}"
        peers = sorted(msg.peers, key=lambda p: p.stage)
        if not peers or peers[msg.stage].device != self.device:
            raise ValueError(f"plan stage {msg.stage} is not this device ({self.device})")
        model_dir = msg.model_dir
        if msg.files:
            model_dir = str(self.weights.stage_dir(msg.files))
        elif not os.path.isdir(msg.model_dir):
            where = "" if os.path.isabs(msg.model_dir) else f" (relative to the agent's directory {os.getcwd()})"
            raise FileNotFoundError(
                f"model directory {msg.model_dir!r} does not exist on device {self.device}{where}: "
                "copy the checkpoint there or pass the path it has on that device"
            )
        if msg.threads > 0:
            torch.set_num_threads(msg.threads)
        kwargs = dict(dtype=msg.dtype, threads=msg.threads or None)
        factory = self.executor_factory or executor_factory_for(msg.kind)
        params = inspect.signature(factory).parameters
        if "progress" in params:
            kwargs["progress"] = self._set_progress
        if "kv" in params and msg.kv.groups:
            kwargs["kv"] = msg.kv
        if "services" in params:  # a stage that calls other agents over the data plane while it computes
            kwargs["services"], kwargs["agent"] = msg.services, self
        executor = factory(model_dir, msg.start, msg.end, **kwargs)
        # checked on what the shard really holds: weights (dtype and tied heads included) + reserved KV cache
        self.emulation.check_shard(self.device, int(executor.memory_bytes()), (msg.start, msg.end),
                                   kv_bytes=int(getattr(executor, "kv_reserved_bytes", 0)))
        if not getattr(executor, "slows_itself", False):  # a dense stage slows its own compute, not its waits
            executor = self.emulation.slowed(executor)
        self._allow_stage_peers(msg)
        nxt = peers[(msg.stage + 1) % len(peers)] if len(peers) > 1 else None
        shape = msg.link if msg.link != LinkShape() else self.default_link
        self._loaded = _Loaded(msg, executor, nxt, shape, source_device=peers[0].device)
        self._event_meta = ("", msg.stage)
        self._progress = 1.0
        self._state = AgentState.READY
        self._error = ""
        huge = int(getattr(executor, "huge_page_bytes", 0))
        placed = f", weights in huge pages ({huge >> 20} MiB)" if huge else ""
        self._log(f"loaded units [{msg.start}, {msg.end}) of {msg.model_dir} in {time.perf_counter() - t0:.2f} s{placed}")
        self._post(Ok(req=msg.req, detail=f"loaded [{msg.start}, {msg.end})"))

    def _allow_stage_peers(self, msg: LoadShard) -> None:
        """The data socket accepts the loaded stage's plan peers and the services it calls."""
        self.gate.allow(DATA_DOMAIN, [p.public_key for p in msg.peers if p.device != self.device]
                        + [s.public_key for s in msg.services])

    def _attend_heads(self, msg: AttendHeads):
        """Attention offloading's memory side (agents.attention_offload.AttentionStore): one store
        per (model geometry, heads), kept across requests; bad tensors get an ErrorReply."""
        from agents import attention_offload

        key = (msg.model_dir, msg.kv_start, msg.kv_stop)
        store = self._attention_stores.get(key)
        if msg.drop:
            if store is not None:
                store.drop(msg.group, msg.drop_layers or None)
            return Ok(req=msg.req, detail="dropped")
        MODEL_CODE_IMPORTED.wait()  # transformers' lazy modules: never import alongside the warm-up thread
        t_start = self.clock()
        began = compute_began()
        try:
            if store is None:
                shape = attention_offload.HeadShape.of(msg.model_dir)
                store = attention_offload.AttentionStore(shape, range(msg.kv_start, msg.kv_stop))
                self._attention_stores[key] = store
            out = attention_offload.attend_frames(store, msg)
        except Exception as err:  # a bad request: named to the coordinator, the agent stays up
            return ErrorReply(req=msg.req, code="failed", message=f"attention: {type(err).__name__}: {err}")
        end_emulated(self.emulation.compute_slowdown, began)
        return HeadsAttended(req=msg.req, shape=tuple(out.shape), data=out.numpy().tobytes(), t_start=t_start,
                             t_end=self.clock())

    def _serve_phase(self, msg):
        """EPD (agents.phases): the loaded phase executor serves the request; a request it cannot
        serve (wrong phase, bad shapes) is refused by name and the agent stays ready. Compute is
        slowed like a stage's on an emulated device."""
        loaded = self._loaded
        serve = getattr(loaded.executor, "serve", None) if loaded is not None else None
        if serve is None:
            return ErrorReply(req=msg.req, code="bad_state",
                              message=f"this agent's stage ({loaded.msg.kind if loaded else 'none'}) serves no phase "
                                      f"requests: load an epd-* stage")
        try:
            return serve(msg, clock=self.clock, slowdown=self.emulation.compute_slowdown, links=self._links_of(loaded))
        except ValueError as err:  # agents.phases.PhaseRequestError and the checkpoint's own checks
            return ErrorReply(req=msg.req, code="failed", message=f"{msg.type_name()}: {err}")

    def _links_of(self, loaded):
        if self._phase_links is None or self._phase_links[0] is not loaded:
            from agents.phases import PhaseLinks

            self._close_phase_links()
            self._phase_links = (loaded, PhaseLinks(self, loaded.msg.peers))
        return self._phase_links[1]

    def _serve_phases(self, msg) -> None:
        """A phase request; a decode starts a continuous batch (agents.phases.DecodeBatch): until it
        is empty, decodes that come join it between steps and other phase requests (an aggregated
        agent's encode and prefill) are served between steps too, before the next one (prefill
        first). Other work waits, in order, until the batch is done."""
        from agents.phases import DecodeBatch

        loaded = self._loaded
        executor = loaded.executor if loaded is not None else None
        make = getattr(executor, "decode_batch", None)
        batch = make(answer=self._answer_phase, clock=self.clock, slowdown=self.emulation.compute_slowdown,
                     links=self._links_of(loaded)) if make is not None and _batches(msg) else None
        if not isinstance(batch, DecodeBatch):
            self._post(self._serve_phase(msg))
            return
        batch.add(msg)
        holding = False
        while batch:
            while not holding:
                try:
                    item = self._work.get_nowait()
                except queue.Empty:
                    break
                if item[0] != "phase":
                    self._requeued.append(item)
                    holding = True
                elif _batches(item[1]):
                    batch.add(item[1])
                else:
                    self._post(self._serve_phase(item[1]), to=item[3])
            batch.step()

    def _answer_phase(self, msg, reply) -> None:
        if isinstance(reply, Exception):
            reply = ErrorReply(req=msg.req, code="failed", message=f"{msg.type_name()}: {reply}")
        self._post(reply)

    def gate_data(self, keys) -> None:
        """Which peers' public keys this agent's data socket accepts (replacing the last set)."""
        self.gate.allow(DATA_DOMAIN, list(keys))

    def spatial_network(self, net):
        """The generated network a spatial request names (``SpatialNet``), kept while requests name it
        (one at a time: a new one replaces it): a spatial run after another of the same network
        neither regenerates its weights nor pays fresh weights' first calls (a new VGG16 96²/2's first
        strip took 1.5–2× the next ones, ×3 on a 3× emulated device)."""
        from agents import spatial

        key = msgspec.structs.astuple(net)
        found = self._spatial_nets.get(key)
        if found is None:
            found = spatial.network_for(net.network, net.image, net.width_div, net.classes, net.seed)
            self._spatial_nets.clear()  # one network at a time: the memory of the last one goes
            self._spatial_nets[key] = found
        return found

    def _spatial(self, msg: SpatialSetup, stop: threading.Event) -> None:
        """Serve a spatial run (agents.spatial_run) until it is stopped."""
        from agents.spatial_run import SpatialSession

        if self._loaded is not None:  # its own coordinator's, or one silent for LOADER_SILENT_S (_refusal)
            m = self._loaded.msg
            self._log(f"unloading its {m.kind} stage (units [{m.start}, {m.end})) for spatial run {msg.run_id}")
        self._unload()
        self._event_meta = (msg.run_id, 0)

        def open_session():
            self._spatial_run = SpatialSession(self, msg, stop)
            return self._spatial_run

        self._serve_held(msg, "spatial run", open_session, ready=f"spatial run {msg.run_id} ready",
                         ended="stopped")

    def _hold_heads(self, msg, stop: threading.Event) -> None:
        """Attention offloading's memory side on the data plane (agents.attention_offload.HeadsService),
        served until the hold's StopRun (or its lease) ends it."""
        self._spatial_nets.clear()  # a kept spatial network's memory goes to the hold
        from agents.attention_offload import HeadsService

        MODEL_CODE_IMPORTED.wait()

        def open_service():
            service = HeadsService(self, msg, stop)
            self._log(f"holding heads [{msg.kv_start}, {msg.kv_stop}) of {msg.model_dir} for "
                      f"{', '.join(p.device for p in msg.dense)}")
            return service

        self._serve_held(msg, "attention hold", open_service,
                         ready=f"holding heads [{msg.kv_start}, {msg.kv_stop})", ended="ended")

    def _hold_dense(self, msg, stop: threading.Event) -> None:
        """A compute replica of attention offloading's staggered pipelining
        (agents.attention_offload_staggered.HeldReplica), served until the hold's StopRun."""
        self._spatial_nets.clear()  # a kept spatial network's memory goes to the hold
        from agents.attention_offload_staggered import HeldReplica

        MODEL_CODE_IMPORTED.wait()

        def open_service():
            service = HeldReplica(self, msg, stop)
            self._log(f"holding the dense part of {msg.model_dir} as replica {msg.replica} "
                      f"({msg.staggered.schedule} staggering)")
            return service

        self._serve_held(msg, "dense replica hold", open_service, ready=f"replica {msg.replica} loaded",
                         ended="ended")

    def _serve_held(self, msg, what: str, open_service, *, ready: str, ended: str) -> None:
        """A held run (spatial session, attention hold): answered Ok once serving, served until
        stopped. Any failure ends it, answered once the agent is idle again with no data peer
        allowed (so a status asked right after the reply says idle)."""
        service = None
        failure: Exception | None = None
        try:
            service = open_service()
            self._post(Ok(req=msg.req, detail=ready))
            service.serve()
        except RunAborted:
            self._log(f"{what} {msg.run_id} {ended}")
        except Exception as err:
            self._log(f"{what} {msg.run_id} failed: {type(err).__name__}: {err}")
            failure = err
        finally:
            self._spatial_run = None
            if service is not None:
                service.close()
            self._end_held_run()
            if failure is not None:
                self._held_run_failed(msg, failure, started=service is not None)

    def _held_run_failed(self, msg, err: Exception, started: bool) -> None:
        """A failed setup answers its request with the reason; a run that had started reports a RunError."""
        why = f"{type(err).__name__}: {err}"
        if started:
            self._post(RunError(run_id=msg.run_id, device=self.device, message=why))
        else:
            self._post(ErrorReply(req=msg.req, code="failed", message=why))

    def _end_held_run(self) -> None:
        """After a held run (spatial, attention hold): no data peer allowed, no lease, idle again."""
        self._lease_holder = None
        if self._loaded is not None:  # an attention hold keeps a stage loaded beside it
            self._allow_stage_peers(self._loaded.msg)
        else:
            self.gate_data([])
        if self._state is AgentState.RUNNING:
            self._state = AgentState.READY if self._loaded is not None else AgentState.IDLE

    def _close_phase_links(self) -> None:
        links, self._phase_links = self._phase_links, None
        if links is not None:
            links[1].close()

    def _compute_strip(self, msg: ComputeStrip) -> StripComputed:
        """Spatial partitioning (agents.spatial): the network is generated from the request's
        seed once and kept; the strip's compute is slowed like any on an emulated device (``emulated``)."""
        from agents import spatial

        net = self.spatial_network(msg.net)
        t_start = self.clock()
        with emulated(self.emulation.compute_slowdown):
            out = spatial.compute_strip(net, msg.start, msg.end, msg.x_lo, msg.lo, msg.hi, msg.shape, msg.data,
                                        msg.head)
        shape, data = out
        return StripComputed(req=msg.req, shape=shape, data=data, t_start=t_start, t_end=self.clock())

    def _set_progress(self, fraction: float) -> None:
        self._progress = max(0.0, min(1.0, float(fraction)))

    def _unload(self) -> None:
        self._close_phase_links()
        loaded, self._loaded = self._loaded, None
        if loaded is None:
            return
        close = getattr(loaded.executor, "close", None)
        if close is not None:  # an executor with sockets of its own (attention offloading's dense side)
            close()
        if loaded.sender is not None:
            loaded.sender.close()
        if loaded.push is not None:
            loaded.push.close(linger=0)
        self.gate.allow(DATA_DOMAIN, [])

    # ------------------------------------------------------------------ the stage
    def _connect_next(self, loaded: _Loaded) -> None:
        """Connect to the next stage at the first run, not at load: by then every agent of
        the plan has loaded and allows our key, so the CurveZMQ handshake cannot be refused."""
        if loaded.next_peer is None or loaded.push is not None:
            return
        push = self.context.socket(zmq.PUSH)
        harden(push)
        push.sndtimeo = SEND_TIMEOUT_MS
        curve_client(push, self.keys, loaded.next_peer.public_key)
        push.connect(loaded.next_peer.data_address)
        loaded.push = push
        loaded.sender = LinkSender(push, loaded.link, clock=self.clock)

    def _run(self, msg: StartRun, stop: threading.Event) -> None:
        loaded = self._loaded
        assert loaded is not None
        self._event_meta = (msg.run_id, loaded.msg.stage)
        run = None
        try:
            self._connect_next(loaded)
            run = _StageRun(self, loaded, msg, stop)
            run.execute()
        except RunAborted:
            self._log(f"run {msg.run_id} stopped")
        except Exception as err:
            self._log(f"run {msg.run_id} failed: {type(err).__name__}: {err}")
            self._post(RunError(run_id=msg.run_id, device=self.device, message=f"{type(err).__name__}: {err}"))
        finally:
            if run is not None:
                run.drop_all()
            if self._state is AgentState.RUNNING:
                self._state = AgentState.READY


class _StageRun:
    """One run on one stage: executes ``agents.schedule``'s operations for each step it
    receives (or, on the source, starts), and on the source follows the schedule."""

    def __init__(self, agent: Agent, loaded: _Loaded, msg: StartRun, stop: threading.Event) -> None:
        self.agent = agent
        self.stop = stop
        self.ex = loaded.executor
        self.loaded = loaded
        self.msg = msg
        self.stage = loaded.msg.stage
        self.n_stages = len(loaded.msg.peers)
        self.units = (loaded.msg.start, loaded.msg.end)
        self.is_first = self.stage == 0
        self.is_last = self.stage == self.n_stages - 1
        self.clock = agent.clock
        self.seen_groups: set[int] = set()
        self.sample = agent.sampler_factory(msg.sampling) if self.is_last else None
        self.histories: dict[int, torch.Tensor] = {}
        """Last stage, when the sampler needs them: per micro-batch, each sequence's tokens so far
        (the padded prompt, then every token sampled), as HF's ``input_ids``."""
        if self.is_last and msg.sampling.uses_history and msg.staggered is None:
            if not msg.input_ids:
                raise ValueError("a repetition penalty or n-gram ban needs the prompts' token ids at the last stage")
            ids = torch.tensor(msg.input_ids, dtype=torch.int64)
            self.histories = {g: ids[list(seqs)] for g, seqs in enumerate(msg.micro_batches)}
        self.groups: dict[int, _Group] = {}
        self.source: SourceState | None = None
        self.injections: collections.deque[Step] = collections.deque()
        """Steps the schedule started but this source has not computed yet. The execute loop
        runs them, so a one-stage plan (first and last at once) loops per token instead of recursing."""
        self.wait_started = self.clock()

    # ---------------------------------------------------------------- main loop
    def execute(self) -> None:
        if self.msg.staggered is not None:  # attention offloading over several replicas: its own schedule
            from agents.attention_offload_staggered import run_source

            tokens = run_source(self.agent, self.loaded, self.msg, self.stop)
            self.agent._post(RunFinished(run_id=self.msg.run_id, tokens=tokens))
            return
        if self.is_first:
            self._setup_groups()
            self.source, started = begin(self.msg.mode, len(self.groups), self.msg.max_new_tokens)
            self.injections.extend(started)
            self._run_injections()
            if self.source.all_finished:
                self._finish()
                return
            self.wait_started = self.clock()
        stop = self.stop
        while not stop.is_set():
            received = self.agent.receive_data(MAX_DATA_BYTES)  # one blocking receive (RCVTIMEO), not a poll
            if received is None:
                continue
            header, bufs, got = received
            if header.run_id != self.msg.run_id:
                continue  # a straggler of an earlier run
            if header.kind == "probe":
                continue
            problem = self._frame_problem(header)
            if problem:
                self.agent._log(f"dropped data message from {header.sender!r}: {problem}")
                continue
            self.agent._event("recv_wait", header.phase, header.step, header.micro_batch, self.wait_started, got)
            tensors = [tensor_from_frame(s, b) for s, b in zip(header.tensors, bufs)]
            if header.kind == "tokens":
                self._on_tokens(header.micro_batch, header.step, tensors[0], got)
                self._run_injections()
                self.agent._wake_for_outbox()
                if self.source.all_finished:
                    self._finish()
                    return
            else:
                step = Step(header.micro_batch, header.step)
                mask = tensors[1] if step.step == 0 and len(tensors) > 1 else None
                try:
                    self._perform(step, tensors[0], mask)
                except ReservationExceeded:
                    raise  # the run is larger than this load: it fails (RunError), nothing to drop
                except StageInputError as err:  # a frame this stage cannot run: dropped, the run goes on
                    self.agent._log(f"dropped data message from {header.sender!r}: {err}")
            self.wait_started = self.clock()
        raise RunAborted()

    def _frame_problem(self, header: DataHeader) -> str:
        """Why a decoded frame of this run cannot be used here ("" when it can): checked before
        any compute, so a lying or broken peer costs a log line, not the run."""
        if header.kind == "tokens":
            if not self.is_first:
                return "token ids sent to a stage that is not the source"
            g = self.groups.get(header.micro_batch)
            if g is None:
                return f"tokens for unknown micro-batch {header.micro_batch}"
            started = self.source.started[g.index]
            if header.step != started or self.source.returned[g.index] >= header.step:
                return f"tokens for step {header.step} of micro-batch {g.index}, expected step {started}"
            if len(header.tensors) != 1 or header.tensors[0].dtype != "int64":
                return "tokens must be one int64 tensor"
            n = 1
            for d in header.tensors[0].shape:
                n *= d
            if n != len(g.seq_ids):
                return f"{n} token ids for a micro-batch of {len(g.seq_ids)} sequences"
            return ""
        if self.is_first:
            return "hidden states sent to the source stage"
        if header.phase != phase_of(header.step):
            return f"phase {header.phase!r} does not match step {header.step}"
        want = 2 if header.step == 0 else 1
        if len(header.tensors) != want:
            return f"{header.phase} needs {want} tensors, got {len(header.tensors)}"
        return ""

    def drop_all(self) -> None:
        for g in sorted(self.seen_groups):
            try:
                self.ex.drop(g)
            except Exception:
                pass
        self.seen_groups.clear()

    # ------------------------------------------------------ one step's operations
    def _perform(self, step: Step, x: torch.Tensor, mask) -> None:
        """Execute this stage's operations of ``step`` (its Receive, if any, is what
        brought ``x`` here)."""
        for op in step_operations(self.stage, self.n_stages, self.units, step):
            if isinstance(op, Compute):
                x = self._compute(op, x, mask)
            elif isinstance(op, Send):
                self._send(op, x, mask)
            elif not isinstance(op, Receive):
                raise TypeError(f"unknown schedule operation {op!r}")
        if self.is_first and self.is_last:  # one stage: the sampled tokens are already here
            self._on_tokens(step.micro_batch, step.step, x, self.clock())

    def _compute(self, op: Compute, x: torch.Tensor, mask) -> torch.Tensor:
        mb = op.micro_batch
        self.seen_groups.add(mb)
        t0 = self.clock()
        with torch.inference_mode():
            out = self.ex.prefill(mb, x, mask) if op.step == 0 else self.ex.decode(mb, x)
            if op.samples:
                history = self.histories.get(mb)
                out = self.sample(out, self._generator(mb, op.step), history).to(torch.int64)
                if history is not None:
                    self.histories[mb] = torch.cat([history, out.view(-1, 1)], dim=1)
        if not getattr(self.ex, "records_own_spans", False):
            self.agent._event("compute", op.phase, op.step, mb, t0, self.clock())
        take_events = getattr(self.ex, "take_events", None)  # an executor's own events (expert reads, ...)
        if take_events is not None:
            for kind, start, end, nbytes, peer in take_events():
                self.agent._event(kind, op.phase, op.step, mb, self.clock.at(start), self.clock.at(end), nbytes, peer)
        return out

    def _generator(self, mb: int, step: int) -> torch.Generator:
        """The draw of ``step`` keyed by its place in the whole generation (``StartRun.first_steps``)."""
        msg = self.msg
        key = msg.micro_batch_keys[mb] if mb < len(msg.micro_batch_keys) else mb
        first = msg.first_steps[mb] if mb < len(msg.first_steps) else 0
        return step_generator(msg.sampling.seed, key, first + step)

    def _send(self, op: Send, out: torch.Tensor, mask) -> None:
        mb, step, phase = op.micro_batch, op.step, op.phase
        tensors = [out]
        if op.step == 0 and op.payload == "hidden" and mask is not None:
            tensors.append(mask.to(torch.int64))
        specs, bufs = zip(*(tensor_frame(t) for t in tensors))
        header = DataHeader(
            run_id=self.msg.run_id,
            kind=op.payload,
            phase=phase,
            step=step,
            micro_batch=mb,
            sender=self.agent.device,
            tensors=tuple(specs),
            t_sent=self.clock(),
        )
        nbytes = sum(s.nbytes() for s in specs)
        peer = self.loaded.next_device
        agent = self.agent

        def on_sent(start: float, end: float, n: int) -> None:
            agent._event("send", phase, step, mb, start, end, n, peer)

        self.loaded.sender.send(data_message(header, list(bufs)), nbytes, on_sent, self.stop)

    # ------------------------------------------------------------ the source's part
    def _setup_groups(self) -> None:
        ids = torch.tensor(self.msg.input_ids, dtype=torch.int64)
        mask = torch.tensor(self.msg.attention_mask, dtype=torch.int64)
        for g, seqs in enumerate(self.msg.micro_batches):
            idx = list(seqs)
            before = [list(self.msg.generated[i]) if self.msg.generated else [] for i in idx]
            eos = set(self.msg.eos_token_ids)
            self.groups[g] = _Group(
                index=g,
                seq_ids=tuple(seqs),
                input_ids=ids[idx],
                attention_mask=mask[idx],
                tokens=before,
                finished=[bool(t) and (t[-1] in eos or len(t) >= self.msg.max_new_tokens) for t in before],
            )

    def _run_injections(self) -> None:
        """Perform the started steps in order; on a one-stage plan each one starts the
        next through ``_on_tokens``, so this drains a whole run (checking for a stop per step)."""
        while self.injections and not self.stop.is_set():
            step = self.injections.popleft()
            g = self.groups[step.micro_batch]
            if step.step == 0:
                self._perform(step, g.input_ids, g.attention_mask)
            else:
                self._perform(step, g.last.view(-1, 1), None)
            self.agent._wake_for_outbox()  # the tokens that started this step go out now

    def _on_tokens(self, mb: int, step: int, ids: torch.Tensor, t: float) -> None:
        g = self.groups[mb]
        ids = ids.reshape(-1).to(torch.int64)
        eos = set(self.msg.eos_token_ids)
        fed = []
        for i, tok in enumerate(ids.tolist()):
            if g.finished[i]:
                fed.append(self.msg.pad_token_id)
                continue
            g.tokens[i].append(tok)
            fed.append(tok)
            if tok in eos or len(g.tokens[i]) >= self.msg.max_new_tokens:
                g.finished[i] = True
        g.last = torch.tensor(fed, dtype=torch.int64)
        g.done = all(g.finished)
        # Not woken here: the next step starts first (its compute and send are the hot
        # path); ``_run_injections`` wakes the control thread once it is under way. The
        # token's time ``t`` is its arrival, so figures do not move.
        self.agent._post(
            TokensProduced(
                run_id=self.msg.run_id,
                micro_batch=mb,
                step=step,
                sequence_ids=g.seq_ids,
                token_ids=tuple(int(x) for x in ids.tolist()),
                t=t,
            ),
            wake=False,
        )
        self.source, started = on_returned(self.source, mb, step, finished_early=g.done)
        self.injections.extend(started)

    def _finish(self) -> None:
        tokens: dict[int, list[int]] = {}
        for g in self.groups.values():
            for sid, toks in zip(g.seq_ids, g.tokens):
                tokens[sid] = toks
        n = len(self.msg.input_ids)
        self.agent._post(RunFinished(run_id=self.msg.run_id, tokens=tuple(tuple(tokens.get(i, ())) for i in range(n))))
