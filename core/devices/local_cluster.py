"""Agents as subprocesses on loopback: a cluster for development, demos and tests (no root).

The cluster generates the coordinator's CurveZMQ keypair and one keypair per agent in
its working directory, starts ``python -m agents serve`` for each device with the
coordinator's public key, reads each agent's ready line, and writes ``agents.json``
(format ``edgeshard.agents``) that ``edgeshard run --agents FILE`` and the GUI use to
connect. Each agent may emulate a different device (agents/emulation.py): a memory
budget it enforces, a compute slowdown, and a shaped outgoing link (bandwidth, latency),
given for all agents or per agent — so one machine can show a heterogeneous cluster.

No process outlives the cluster: each agent runs with ``--exit-on-stdin-eof`` and its stdin
is a pipe whose write end only this process holds, so when this process ends in any way
(even ``kill -9``) the kernel closes it and the agents shut down. That is tied to the
*process*, not to the thread that called ``start()`` (unlike PR_SET_PDEATHSIG, which fires
when the spawning thread exits), so a cluster can be started from a short-lived worker
thread. ``stop()`` terminates, waits, then kills what is left. (The pipe is close-on-exec,
so other programs this process starts do not hold it; only a child forked *without* exec,
e.g. multiprocessing's "fork", would keep the agents up until it ends too.)

**Forked from a zygote.** Each agent imports torch and transformers (~3.3 s of CPU here);
three at once on two cores made the demo's agents the slowest part of its start. So by
default the cluster starts one fork server (``python -m agents zygote``, agents/zygote.py)
that imports them once and forks every agent: still one process per agent with its own pid,
session, log, stdin (end-of-file stops it) and command line, restartable on its own. When
the zygote cannot start (or stops answering) the cluster starts each agent as its own
interpreter, as before, and says so in ``launch_note`` and the log. ``launcher="popen"`` or
``EDGESHARD_AGENT_LAUNCHER=popen`` asks for the plain way.

**Zygotes shared by a process's clusters.** A process that starts many clusters one after
another (the test suite: dozens) can keep their zygotes (``share_zygotes``): a cluster then
forks its agents from a running zygote of the same Python and environment instead of starting
one (~3.3 s of CPU each time), and leaves it running when it stops. Its agents are unchanged:
their own processes, stopped by their cluster. A cluster handed a zygote (``zygote=``) uses that one.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from agents.emulation import MIB, DeviceEmulation
from agents.transport import CurveKeys
from agents.zygote import (LAUNCHER_ENV, LAUNCHERS, ForkedAgent, ZygoteClient, ZygoteUnavailable, agent_environment,
                           default_launcher)
from core.devices.agent_link import AgentEndpoint
from core.errors import DeployError, FormatError

AGENTS_FORMAT = "edgeshard.agents"
AGENTS_VERSION = 1
READY_PREFIX = "EDGESHARD-AGENT-READY"
log = logging.getLogger(__name__)


class AgentEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    device: str
    control_address: str
    public_key: str
    pid: int = 0


class AgentsFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where the agents of a cluster listen, and which coordinator key they trust."""

    format: str = AGENTS_FORMAT
    version: int = AGENTS_VERSION
    coordinator_key_file: str
    agents: tuple[AgentEntry, ...]

    def endpoints(self) -> list[AgentEndpoint]:
        return [AgentEndpoint(a.device, a.control_address, a.public_key) for a in self.agents]


def load_agents_file(path: str | os.PathLike) -> tuple[list[AgentEndpoint], CurveKeys]:
    """Read an ``agents.json`` and the coordinator keypair it points at."""
    p = Path(path)
    try:
        data = msgspec.json.decode(p.read_bytes(), type=AgentsFile)
    except OSError as err:
        raise FormatError(str(p), f"cannot read file ({err.strerror or err})") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise FormatError(str(p), str(err)) from None
    if data.format != AGENTS_FORMAT or data.version > AGENTS_VERSION:
        raise FormatError(str(p), f"expected format {AGENTS_FORMAT!r} version <= {AGENTS_VERSION}", "$.format")
    names = [a.device for a in data.agents]
    twice = sorted({d for d in names if names.count(d) > 1})
    if twice:  # every command reads agents by name: refused here, not as a traceback when connecting
        raise FormatError(str(p), f"device {', '.join(twice)} is listed more than once", "$.agents")
    key_path = Path(data.coordinator_key_file)
    if not key_path.is_absolute():
        key_path = p.parent / key_path
    try:
        keys = CurveKeys.load(key_path)
    except (OSError, ValueError) as err:
        raise FormatError(str(key_path), f"cannot read the coordinator key ({err})") from None
    return data.endpoints(), keys


def _per_device(value, devices: list[str], what: str) -> dict:
    """One value for every device, or a mapping that must name each device exactly."""
    if not isinstance(value, dict):
        return dict.fromkeys(devices, value)
    if set(value) != set(devices):
        raise ValueError(f"{what} must name exactly the devices {devices}, got {sorted(value)}")
    return dict(value)


def per_agent_values(text: str, n: int, flag: str) -> list[float]:
    """``"8"`` (every agent) or ``"24,16,12"`` (one per agent) from a command line flag."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise FormatError(flag, f"{text!r} is not a number or a comma-separated list of numbers") from None
    bad = [v for v in values if not (math.isfinite(v) and v >= 0)]
    if bad:  # NaN or infinity would reach an agent's sleep or byte budget
        raise FormatError(flag, f"every value must be a finite number >= 0, got {bad[0]!r}")
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise FormatError(flag, f"{len(values)} values for {n} agents: give one value, or one per agent")
    return values


def emulations_from_flags(devices: list[str], memory_mib: str | None, slowdown: str | None
                          ) -> dict[str, DeviceEmulation]:
    """Per-agent emulated limits from ``--memory-mib`` / ``--slowdown`` (FormatError if bad)."""
    n = len(devices)
    mem = per_agent_values(memory_mib, n, "--memory-mib") if memory_mib else [0.0] * n
    slow = per_agent_values(slowdown, n, "--slowdown") if slowdown else [1.0] * n
    out = {}
    for dev, m, f in zip(devices, mem, slow):
        try:
            out[dev] = DeviceEmulation(memory_budget_bytes=int(m * MIB), compute_slowdown=f)
        except ValueError as err:
            raise FormatError("--memory-mib" if m < 0 else "--slowdown", f"{dev}: {err}") from None
    return out


@dataclass
class _Proc:
    device: str
    popen: subprocess.Popen | ForkedAgent
    ready: threading.Event = field(default_factory=threading.Event)
    line: str = ""
    tail: deque = field(default_factory=lambda: deque(maxlen=200))
    reader: threading.Thread | None = None


class SharedZygotes:
    """Ready zygotes kept for the local clusters of this process, one per (Python, environment,
    preload): each imports torch and transformers once, not once per cluster. Clusters running
    at once may fork from the same one (it answers one request at a time and routes each exit
    report to its agent). Idle ones beyond ``keep`` are ended; ``close()`` ends them all.
    ``ignored_env``: variables that may differ between clusters of one zygote (each forked agent
    gets its cluster's whole environment; only what the zygote read while importing is shared)."""

    def __init__(self, workdir: str | os.PathLike, keep: int = 2, ignored_env: tuple[str, ...] = ()) -> None:
        self.workdir = Path(workdir)
        self.keep = keep
        self.ignored_env = frozenset(ignored_env)
        self._lock = threading.Lock()
        self._zygotes: dict[tuple, ZygoteClient] = {}  # oldest use first
        self._users: dict[ZygoteClient, int] = {}  # clusters using each
        self._started = 0

    def take(self, python: str, env: dict[str, str], preload: bool, timeout_s: float) -> ZygoteClient:
        """A ready zygote for ``env`` (started and waited for if none runs); ``ZygoteUnavailable`` if it cannot start."""
        key = (python, preload, tuple(sorted((k, v) for k, v in env.items() if k not in self.ignored_env)))
        with self._lock:
            zygote = self._zygotes.pop(key, None)
            if zygote is not None and not zygote.alive:
                self._users.pop(zygote, None)
                zygote.close()
                zygote = None
            if zygote is None:
                self._started += 1
                folder = self.workdir / f"zygote-{self._started}"
                folder.mkdir(parents=True, exist_ok=True)
                zygote = ZygoteClient(python, env=env, cwd=str(folder), log_path=str(folder / "zygote.log"),
                                      preload_model_code=preload)
                try:
                    zygote.start()
                    zygote.wait_ready(timeout_s)
                except ZygoteUnavailable:
                    zygote.close()
                    raise
            self._zygotes[key] = zygote
            self._users[zygote] = self._users.get(zygote, 0) + 1
            self._end_idle_beyond_keep()
        return zygote

    def give_back(self, zygote: ZygoteClient, broken: bool = False) -> None:
        """A cluster stopped using ``zygote`` (``broken``: it stopped answering; ended at once)."""
        with self._lock:
            self._users[zygote] = max(0, self._users.get(zygote, 1) - 1)
            if broken:
                self._zygotes = {k: z for k, z in self._zygotes.items() if z is not zygote}
                zygote.close()
            self._end_idle_beyond_keep()

    def _end_idle_beyond_keep(self) -> None:
        idle = [k for k, z in self._zygotes.items() if not self._users.get(z)]
        for key in idle[:max(0, len(idle) - self.keep)]:
            zygote = self._zygotes.pop(key)
            self._users.pop(zygote, None)
            zygote.close()

    def close(self) -> None:
        with self._lock:
            zygotes, self._zygotes = list(self._zygotes.values()), {}
            self._users.clear()
        for zygote in zygotes:
            zygote.close()


_shared_zygotes: SharedZygotes | None = None


def share_zygotes(zygotes: SharedZygotes | None) -> None:
    """Local clusters started from now on fork from ``zygotes`` (None: each starts and ends its own)."""
    global _shared_zygotes
    _shared_zygotes = zygotes


class LocalCluster:
    """``n`` agents on 127.0.0.1. Use as a context manager, or ``start()`` / ``stop()``."""

    def __init__(
        self,
        workdir: str | os.PathLike,
        devices: list[str] | int = 4,
        *,
        threads_per_agent: int = 1,
        link_mbit: float | dict[str, float] = 0.0,
        link_latency_ms: float | dict[str, float] = 0.0,
        emulation: DeviceEmulation | dict[str, DeviceEmulation] | None = None,
        startup_timeout_s: float = 60.0,
        python: str = sys.executable,
        launcher: str | None = None,
        zygote: ZygoteClient | None = None,
        preload_model_code: bool = True,
    ) -> None:
        self.workdir = Path(workdir)
        self.devices = [f"local-{i}" for i in range(devices)] if isinstance(devices, int) else list(devices)
        if len(set(self.devices)) != len(self.devices):
            raise ValueError("device names must be unique")
        self.threads_per_agent = threads_per_agent
        self.link_mbit = _per_device(link_mbit, self.devices, "link_mbit")
        self.link_latency_ms = _per_device(link_latency_ms, self.devices, "link_latency_ms")
        self.emulation = _per_device(emulation or DeviceEmulation(), self.devices, "emulation")
        """Per device: the limits its agent emulates."""
        self.startup_timeout_s = startup_timeout_s
        self.python = python
        self.launcher = launcher or default_launcher()
        if self.launcher not in LAUNCHERS:
            if launcher is None:  # the operator's environment, not a caller's argument
                raise FormatError(f"environment variable {LAUNCHER_ENV}", f"must be one of {', '.join(LAUNCHERS)} "
                                  f"(or unset), got {self.launcher!r}")
            raise ValueError(f"launcher must be one of {LAUNCHERS}, got {self.launcher!r}")
        self.launch_note = ""
        """How the agents were started, for the operator's log (set by ``start``)."""
        self._zygote: ZygoteClient | None = None
        self._zygote_shared_by: SharedZygotes | None = None
        """The SharedZygotes ``_zygote`` came from (handed back, not ended, when the cluster stops)."""
        self._early_zygote = zygote
        """A zygote the caller started already (before its own slow imports), ours to use and stop."""
        self.preload_model_code = preload_model_code
        """Whether the zygote imports the model code before forking the agents (each has it at
        once, imported once), or forks them sooner and each imports it in the background (the
        demo, when it has a kept profile: nothing to measure before the operator's first run)."""
        self.keys: CurveKeys | None = None
        self.endpoints: list[AgentEndpoint] = []
        self._procs: list[_Proc] = []
        self._entries: list[AgentEntry] = []

    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def agents_file(self) -> Path:
        return self.workdir / "agents.json"

    def pid_of(self, device: str) -> int:
        return next(p.popen.pid for p in self._procs if p.device == device)

    def live_pids(self) -> list[int]:
        """The pids of the agents whose process has not exited (a dead one's pid may be reused)."""
        return [p.popen.pid for p in self._procs if p.popen.poll() is None]

    def start(self, on_ready: Callable[[str], None] | None = None) -> list[AgentEndpoint]:
        """Spawn every agent at once, then wait for each one's ready line; ``on_ready(device)``
        after each (a caller shows start-up progress with it)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.keys = CurveKeys.generate()
        self.keys.save(self.workdir / "coordinator.key")
        try:
            self._start_zygote()
            for dev in self.devices:
                self._procs.append(self._spawn(dev))
            self._entries = []
            for p in self._procs:
                self._entries.append(self._wait_ready(p))
                if on_ready is not None:
                    on_ready(p.device)
        except BaseException:
            self.stop()
            raise
        self._write_agents_file()
        return self.endpoints

    def restart(self, device: str) -> AgentEndpoint:
        """Start ``device``'s agent again after it exited, on the ports and key it had, so a
        coordinator that knew it reaches it at the same address (the agents file is rewritten
        with its new pid). DeployError when it does not come up."""
        at = next((i for i, p in enumerate(self._procs) if p.device == device), None)
        if at is None:
            raise DeployError(device, "not an agent of this local cluster", hint=f"its agents: {self.devices}")
        old = self._procs[at]
        if old.popen.poll() is None:
            raise DeployError(device, "its agent is still running", hint="stop it first, or leave it")
        if isinstance(old.popen, ForkedAgent):
            old.popen.close()
        fields = dict(kv.split("=", 1) for kv in old.line.split()[1:])
        proc = self._spawn(device, ports=(int(fields["control"]), int(fields["data"])))
        self._procs[at] = proc
        try:
            self._entries[at] = self._wait_ready(proc)
        except DeployError:
            proc.popen.kill()
            raise
        self._write_agents_file()
        return self.endpoints[at]

    def exited(self) -> list[tuple[str, int]]:
        """(device, exit status) of each agent that is no longer running."""
        return [(p.device, p.popen.returncode) for p in self._procs if p.popen.poll() is not None]

    def _wait_ready(self, p: _Proc) -> AgentEntry:
        if not p.ready.wait(self.startup_timeout_s) or not p.line:
            tail = "\n".join(p.tail)
            raise DeployError(p.device, "local agent did not come up", hint=tail[-2000:] or "no output")
        fields = dict(kv.split("=", 1) for kv in p.line.split()[1:])
        return AgentEntry(device=p.device, control_address=f"tcp://127.0.0.1:{fields['control']}",
                          public_key=fields["public_key"], pid=int(fields["pid"]))

    def _write_agents_file(self) -> None:
        self.endpoints = [AgentEndpoint(e.device, e.control_address, e.public_key) for e in self._entries]
        doc = AgentsFile(coordinator_key_file="coordinator.key", agents=tuple(self._entries))
        self.agents_file.write_bytes(msgspec.json.format(msgspec.json.encode(doc), indent=2) + b"\n")

    def _agent_env(self) -> dict[str, str]:
        return agent_environment(self.threads_per_agent)

    def _start_zygote(self) -> None:
        """Start the fork server (or adopt the caller's) and wait for its imports; on failure,
        note it and go on without (each agent then starts its own interpreter)."""
        zygote, self._early_zygote = self._early_zygote, None
        if self.launcher != "zygote":
            if zygote is not None:
                zygote.close()
            self.launch_note = "each agent started as its own interpreter (launcher popen)"
            return
        if zygote is None and _shared_zygotes is not None:
            try:
                zygote = _shared_zygotes.take(self.python, self._agent_env(), self.preload_model_code,
                                              self.startup_timeout_s)
            except ZygoteUnavailable as err:
                self._zygote_failed(str(err))
                return
            self._zygote, self._zygote_shared_by = zygote, _shared_zygotes
            self.launch_note = f"agents forked from a shared zygote (pid {zygote.pid}) that imported torch and transformers once"
            return
        try:
            if zygote is None:
                zygote = ZygoteClient(self.python, env=self._agent_env(), cwd=str(self.workdir),
                                      log_path=str(self.workdir / "zygote.log"),
                                      preload_model_code=self.preload_model_code)
                zygote.start()
            zygote.preload(self.preload_model_code)  # an early zygote may not know yet
            zygote.wait_ready(self.startup_timeout_s)
        except ZygoteUnavailable as err:
            zygote.close()
            self._zygote_failed(str(err))
            return
        self._zygote = zygote
        self.launch_note = (f"agents forked from a zygote (pid {zygote.pid}) that imported torch and transformers once"
                            if zygote.preloads_model_code else
                            f"agents forked from a zygote (pid {zygote.pid}) that imported torch once; each agent "
                            "imports transformers in the background")

    def _zygote_failed(self, why: str) -> None:
        self.launch_note = (f"the agents' zygote is unavailable ({why}); each agent starts its own interpreter "
                            "(slower: each imports torch)")
        log.warning("local cluster: %s", self.launch_note)

    def _launch(self, argv: list[str]) -> subprocess.Popen | ForkedAgent:
        """One agent: forked by the zygote when it runs, else its own interpreter."""
        env = self._agent_env()
        if self._zygote is not None:
            try:
                return self._zygote.spawn(argv, env, str(self.workdir))
            except ZygoteUnavailable as err:
                self._release_zygote(broken=True)
                self._zygote_failed(str(err))
        return subprocess.Popen(
            [self.python, "-m", "agents", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE,  # never written; its end-of-file tells the agent we are gone
            text=True,
            env=env,
            cwd=self.workdir,  # like a remote agent, it does not share the operator's directory
            start_new_session=True,  # Ctrl-C reaches the cluster, which stops the agents in order
        )

    def _spawn(self, device: str, ports: tuple[int, int] = (0, 0)) -> _Proc:
        proc = _Proc(device, self._launch(self.agent_argv(device, ports)))
        proc.reader = threading.Thread(target=self._read, args=(proc,), name=f"local-agent-{device}", daemon=True)
        proc.reader.start()
        return proc

    def agent_argv(self, device: str, ports: tuple[int, int] = (0, 0)) -> list[str]:
        """``python -m agents`` arguments of ``device``'s agent (after ``start()`` made the keys)."""
        assert self.keys is not None
        return [
            "serve",
            "--device", device,
            "--host", "127.0.0.1",
            f"--coordinator-key={self.keys.public}",  # a Z85 key may start with "-"
            "--key-file", str(self.workdir / f"{device}.key"),
            "--threads", str(self.threads_per_agent),
            "--link-mbit", str(self.link_mbit[device]),
            "--link-latency-ms", str(self.link_latency_ms[device]),
            "--memory-budget-mib", str(self.emulation[device].memory_budget_bytes / MIB),
            "--compute-slowdown", str(self.emulation[device].compute_slowdown),
            # its emulated devices are profiled as the runs find them: cold, the others computing
            # between their steps (unemulated agents keep the warm profile the fidelity table is read against)
            *(["--shared-host"] if self.emulation[device].active else []),
            "--weights-dir", str(self.workdir / "weights" / device),
            "--exit-on-stdin-eof",
            "--control-port", str(ports[0]),
            "--data-port", str(ports[1]),
        ]  # fmt: skip

    def _read(self, proc: _Proc) -> None:
        """Drain the agent's output (so it never blocks on a full pipe) and spot its ready line."""
        with open(self.workdir / f"{proc.device}.log", "a") as log:
            for line in proc.popen.stdout:
                log.write(line)
                log.flush()
                proc.tail.append(line.rstrip())
                if line.startswith(READY_PREFIX) and not proc.ready.is_set():
                    proc.line = line.strip()
                    proc.ready.set()
        proc.ready.set()

    def stop(self, timeout_s: float = 5.0) -> None:
        procs, self._procs = self._procs, []
        for p in procs:
            if p.popen.poll() is None:
                p.popen.terminate()
        for p in procs:
            try:
                p.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait(timeout=timeout_s)
            if p.reader is not None:
                p.reader.join(timeout=timeout_s)
            for pipe in (p.popen.stdin, p.popen.stdout):
                if pipe is not None:
                    pipe.close()
            if isinstance(p.popen, ForkedAgent):
                p.popen.close()
        self._release_zygote(timeout_s=timeout_s)  # after the agents: it reports their exit statuses
        if self._early_zygote is not None:
            self._early_zygote.close(timeout_s)
        self._early_zygote = None

    def _release_zygote(self, broken: bool = False, timeout_s: float = 2.0) -> None:
        """End our zygote, or hand a shared one back."""
        zygote, shared = self._zygote, self._zygote_shared_by
        self._zygote = self._zygote_shared_by = None
        if zygote is None:
            return
        if shared is not None:
            shared.give_back(zygote, broken=broken)
        else:
            zygote.close(timeout_s)
