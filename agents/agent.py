"""The agent: serves one device's control socket and runs its stage of a plan.

Two threads, no busy polling:

- the **control thread** blocks on a zmq Poller over the control ROUTER socket and a
  wake-up pipe. It answers pings and status at once (so heartbeats keep flowing while the
  stage computes), hands long work to the worker, forwards what the worker produced
  (replies, tokens, run results) and flushes timeline events about every 50 ms;
- the **worker thread** does every long action — loading a shard, profiling, the stage
  loop of a run: block on the data PULL socket (polled with a wake pipe, so a stop is
  noticed at once: ``agents.transport.DataInbox``), compute, hand the result to libzmq (or
  to the emulated link's sender thread) and go back to waiting — sending overlaps compute.
  While it works, status reports what it is doing (``activity``) and how far it got
  (``progress``, e.g. blocks read while loading).

The control thread must never wait on the worker, and nothing the worker does may hold
the GIL for long: ``warm_imports()`` (called by ``python -m agents serve`` in a thread
right after it listens, so launchers see the agent ready seconds sooner) imports
transformers before any shard is loaded, because importing it the first time loads
extension modules under the GIL for up to a few hundred ms here (more on slow devices).
Pongs may be that late while it runs, well inside the 3 s heartbeat timeout; a load or
profile that arrives meanwhile waits for it (``MODEL_CODE_IMPORTED``).

The agent is written in parts: this module (lifecycle, the worker, loading, held sessions),
``agents.control_plane`` (the control thread), ``agents.lease`` (one work at a time, the run's
lease) and ``agents.stage_run`` (a run on a stage). It names no technique: a technique's messages
reach the ``agents.registry.Handler`` registered for their type, its stages the executor
registered for their kind.

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

import torch
import zmq

from agents import registry
from agents.accelerators import CUDA, CudaBackend
from agents.clock import AgentClock
from agents.control_plane import ControlPlane
from agents.emulation import DeviceEmulation, ShardOverBudget
from agents.executors import executor_factory_for, placement
from agents.heap import release_free_pages
from agents.lease import LOADER_SILENT_S, LeaseRules  # noqa: F401  (LOADER_SILENT_S: public here too)
from agents.model_code import MODEL_CODE_IMPORTED, warm_imports, warm_imports_in_background  # noqa: F401
from agents.protocol import (
    AgentEvent,
    AgentState,
    DataHeader,
    ErrorReply,
    LinkShape,
    LoadShard,
    Ok,
    ProfileResult,
    ProtocolError,
    RunError,
    RunFinished,
    StartRun,
    decode_data,
    options_of,
)
from agents.stage_run import MAX_DATA_BYTES, Loaded, StageRun, default_sampler  # noqa: F401
from agents.transport import (
    CONTROL_DOMAIN, DATA_DOMAIN, CurveKeys, DataInbox, KeyGate, LinkSender, RunAborted, WireCounts, bind_port,
    curve_client, curve_server, harden, start_authenticator, tcp_address,
)
from agents.weights import WeightStore, WeightStoreError, default_root

log = logging.getLogger("edgeshard.agent")

DATA_POLL_MS = 100
"""A data receive's default wait (for loops with deadlines); a run's stop wakes any receive at once."""
SEND_TIMEOUT_MS = 200


class Agent(ControlPlane, LeaseRules):
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
        accelerators: CudaBackend = CUDA,
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
        self.accelerators = accelerators
        """The GPUs this agent reports, accepts stages on and profiles units on (agents.accelerators)."""
        self.weights = WeightStore(weights_dir or default_root())
        """Stage weights the coordinator sent, by content hash (agents/weights.py)."""
        self.clock = AgentClock()
        self.context = zmq.Context()
        self.wire = WireCounts()  # what its sockets sent, per link and kind (AgentStatus.wire_sent)
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
        self._loaded: Loaded | None = None
        self._rooms: dict[str, dict] = {}
        """Each technique's own state on this agent (``room``), by its room's name."""
        self._work: queue.Queue = queue.Queue()
        self._requeued: collections.deque = collections.deque()
        """Work taken off the queue while a handler served queued requests of its own (``next_queued``)
        that it does not serve: it comes next, in order, once the handler is done."""
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
        """The message that started the current run or held session (a StartRun, or a technique's)."""
        self._threads: list[threading.Thread] = []
        self._data: zmq.Socket | None = None
        self._inbox: DataInbox | None = None
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
        self._data.rcvtimeo = DATA_POLL_MS  # for a technique's own blocking receive
        curve_server(self._data, self.keys, DATA_DOMAIN)
        self.data_port = bind_port(self._data, self.host, self._want_ports[1])
        self._inbox = DataInbox(self._data)
        self._stop_run = self._inbox.stop_event()
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
        if self._inbox is not None:
            self._inbox.close()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until ``close()`` was called (by a signal handler) or ``timeout``."""
        return self._shutdown.wait(timeout)

    # ------------------------------------------------------------------- helpers
    def _log(self, line: str) -> None:
        stamped = f"{time.strftime('%H:%M:%S')} {line}"
        self._logs.append(stamped)
        log.info(line)

    def receive_data(self, max_bytes: int, timeout_ms: int | None = DATA_POLL_MS
                     ) -> tuple[DataHeader, list[memoryview], float] | None:
        """The next message on the data socket as (header, tensor buffers, its arrival on this
        agent's clock), or None when ``timeout_ms`` passed (None: no limit), the run's stop woke
        the receive, or the message did not decode: a malformed frame is logged and dropped here,
        so no data-plane loop can hand one to its handler or die of it."""
        frames = self._inbox.receive(timeout_ms)
        if frames is None:
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


    # ------------------------------------------------------- what technique rooms use
    @property
    def state(self) -> AgentState:
        return self._state

    @property
    def run_id(self) -> str:
        """The run (or held session) accepted last."""
        return self._run_id

    @property
    def loaded_stage(self) -> Loaded | None:
        return self._loaded

    @property
    def run_stop(self) -> threading.Event:
        """Set when the current run (or held session) is to end."""
        return self._stop_run

    @property
    def data_socket(self) -> zmq.Socket:
        """The data PULL socket, for a room that receives raw frames itself (``receive_data`` decodes)."""
        return self._data

    @property
    def event_run_id(self) -> str:
        """The run the events recorded now belong to (``set_event_meta``)."""
        return self._event_meta[0]

    def room(self, name: str) -> dict:
        """A technique's own state on this agent (its kept network, its stores, its links)."""
        return self._rooms.setdefault(name, {})

    def log(self, line: str) -> None:
        self._log(line)

    def post(self, msg, wake: bool = True, to: bytes | None = None) -> None:
        self._post(msg, wake, to)

    def event(self, kind: str, phase: str, step: int, mb: int, start: float, end: float, nbytes=0, peer=""):
        self._event(kind, phase, step, mb, start, end, nbytes, peer)

    def set_event_meta(self, run_id: str, stage: int) -> None:
        """The run and stage the events recorded from now on belong to."""
        self._event_meta = (run_id, stage)

    def unload(self) -> None:
        self._unload()

    def free_memory(self) -> None:
        """Every technique drops what it keeps between requests (``AgentTechnique.free_memory``)."""
        for technique in registry.techniques():
            if technique.free_memory is not None:
                technique.free_memory(self)

    def next_queued(self, accept):
        """For a handler that serves queued requests between its own steps (a continuous batch): the
        next queued technique request as (message, requester) when ``accept(message)``, else None.
        Other work is set aside to come next, in order, and from then on none is taken."""
        if self._requeued:
            return None
        try:
            item = self._work.get_nowait()
        except queue.Empty:
            return None
        kind, msg, _, identity = item
        if kind != "handler" or not accept(msg):
            self._requeued.append(item)
            return None
        return msg, identity

    # --------------------------------------------------------------- worker thread
    _ACTIVITIES = {"LoadShard": "loading", "ProfileCompute": "profiling compute", "MeasureLink": "measuring a link"}

    def _worker_loop(self) -> None:
        while True:
            kind, msg, stop, self._worker_peer = self._requeued.popleft() if self._requeued else self._work.get()
            if kind == "shutdown":
                break
            handler = registry.handler_for(type(msg)) if kind == "handler" else None
            self._activity, self._progress = self._ACTIVITIES.get(kind, handler.activity if handler else ""), 0.0
            if kind == "StartRun" or (handler is not None and handler.takes_run):
                self._activity = self._doing()
            if kind in ("LoadShard", "ProfileCompute") and not MODEL_CODE_IMPORTED.is_set():
                # a demo with a kept profile: its first Start waited 3-7 s here, unexplained (load 3-5)
                self._activity, waited = f"importing the model code before {self._activity}", time.perf_counter()
                MODEL_CODE_IMPORTED.wait()
                self._log(f"{kind} waited {time.perf_counter() - waited:.2f} s for the model code import")
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
                elif kind in ("ProfileCompute", "MeasureLink"):
                    from agents import profiler

                    result = (profiler.profile_compute(self, msg.options) if kind == "ProfileCompute"
                              else profiler.measure_link(self, msg.peer, msg.options))
                    self._activity, self._progress = "", 0.0  # before the reply: a status read after it is idle
                    self._post(ProfileResult(req=msg.req, result=result))
                elif kind == "handler":  # a technique's request (agents.registry.Handler)
                    reply = handler.serve(self, msg, stop)
                    if reply is not None:
                        self._post(reply)
                self._activity, self._progress = "", 0.0
            except Exception as err:  # a failure of this device's work, reported, never fatal
                self._activity, self._progress = "", 0.0
                self._log(f"{type(msg).__name__ if handler else kind} failed: {type(err).__name__}: {err}")
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
        self.free_memory()  # what techniques keep between requests goes to the stage
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
        if "options" in params:  # the stage kind's own options (agents.registry: its technique's Options)
            kwargs["options"] = options_of(msg.options)
        if "agent" in params:  # a stage that calls other agents over the data plane while it computes
            kwargs["agent"] = self
        if "budget" in params:  # checked on the checkpoint's header sizes before any memory is taken
            kwargs["budget"] = self.emulation.shard_check(self.device, (msg.start, msg.end))
        kwargs.update(placement(params, msg, self.accelerators))  # its weight precision and torch device
        executor = factory(model_dir, msg.start, msg.end, **kwargs)
        # checked on what the shard really holds: weights (dtype and tied heads included) + reserved KV cache
        self.emulation.check_shard(self.device, int(executor.memory_bytes()), (msg.start, msg.end),
                                   kv_bytes=int(getattr(executor, "kv_reserved_bytes", 0)))
        if not getattr(executor, "slows_itself", False):  # one that waits on other agents slows only its compute
            executor = self.emulation.slowed(executor)
        self._allow_stage_peers(msg)
        nxt = peers[(msg.stage + 1) % len(peers)] if len(peers) > 1 else None
        shape = msg.link if msg.link != LinkShape() else self.default_link
        self._loaded = Loaded(msg, executor, nxt, shape, source_device=peers[0].device)
        self._event_meta = ("", msg.stage)
        self._activity, self._progress = "", 0.0  # before the Ok: a status read right after it was still 'loading'
        self._state = AgentState.READY
        self._error = ""
        huge = int(getattr(executor, "huge_page_bytes", 0))
        placed = f", weights in huge pages ({huge >> 20} MiB)" if huge else ""
        self._log(f"loaded units [{msg.start}, {msg.end}) of {msg.model_dir} in {time.perf_counter() - t0:.2f} s{placed}")
        self._post(Ok(req=msg.req, detail=f"loaded [{msg.start}, {msg.end})"))

    def _allow_stage_peers(self, msg: LoadShard) -> None:
        """The data socket accepts the stage's plan peers and the agents its options name (its services)."""
        options = options_of(msg.options)
        self.gate.allow(DATA_DOMAIN, [p.public_key for p in msg.peers if p.device != self.device]
                        + list(options.data_keys() if options is not None else ()))

    def gate_data(self, keys) -> None:
        """Which peers' public keys this agent's data socket accepts (replacing the last set)."""
        self.gate.allow(DATA_DOMAIN, list(keys))

    def serve_held(self, msg, what: str, open_service, *, ready: str, ended: str, on_end=None) -> None:
        """A technique's held session (``Handler.takes_run``): answered Ok once serving, served until
        stopped. Any failure ends it, answered once the agent is idle again with no data peer
        allowed (so a status asked right after the reply says idle). ``on_end``: first thing when it
        ends (a session others reach on the control thread is no longer theirs)."""
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
            if on_end is not None:
                on_end()
            if service is not None:
                service.close()
            release_free_pages()  # what the session's activations freed goes back (agents.heap)
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
        """After a held session: no data peer allowed, no lease, idle again."""
        self._lease_holder = None
        if self._loaded is not None:  # a hold may keep a stage loaded beside it
            self._allow_stage_peers(self._loaded.msg)
        else:
            self.gate_data([])
        if self._state is AgentState.RUNNING:
            self._state = AgentState.READY if self._loaded is not None else AgentState.IDLE

    def _set_progress(self, fraction: float) -> None:
        self._progress = max(0.0, min(1.0, float(fraction)))

    def _unload(self) -> None:
        for technique in registry.techniques():  # what a technique holds for the loaded stage goes with it
            if technique.on_unload is not None:
                technique.on_unload(self)
        loaded, self._loaded = self._loaded, None
        if loaded is None:
            return
        close = getattr(loaded.executor, "close", None)
        if close is not None:  # an executor with sockets of its own
            close()
        if loaded.sender is not None:
            loaded.sender.close()
        if loaded.push is not None:
            loaded.push.close(linger=0)
        self.gate.allow(DATA_DOMAIN, [])

    # ------------------------------------------------------------------ the stage
    def _connect_next(self, loaded: Loaded) -> None:
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
        loaded.sender = LinkSender(push, loaded.link, clock=self.clock, counts=self.wire, link=loaded.next_peer.device)

    def _run(self, msg: StartRun, stop: threading.Event) -> None:
        loaded = self._loaded
        assert loaded is not None
        self._event_meta = (msg.run_id, loaded.msg.stage)
        run = None
        try:
            self._connect_next(loaded)
            options = options_of(msg.options)
            if options is not None:  # a technique's run schedules itself (agents.registry.run_driver_for)
                driver = registry.run_driver_for(type(options))
                if driver is None:
                    raise ValueError(f"no run driver for {type(options).__struct_config__.tag} run options here")
                self._post(RunFinished(run_id=msg.run_id, tokens=driver(self, loaded, msg, stop)))
                return
            run = StageRun(self, loaded, msg, stop)
            run.execute()
        except RunAborted:
            self._log(f"run {msg.run_id} stopped")
        except Exception as err:
            self._log(f"run {msg.run_id} failed: {type(err).__name__}: {err}")
            self._post(RunError(run_id=msg.run_id, device=self.device, message=f"{type(err).__name__}: {err}"))
        finally:
            if run is not None:
                run.drop_all()
            release_free_pages()  # what the run's activations freed goes back (agents.heap)
            if self._state is AgentState.RUNNING:
                self._state = AgentState.READY

