"""A fork server for agents on one machine: import torch and the model code once, fork each agent.

An agent spends ~3.3 s of CPU importing torch (1.2 s) and transformers (2 s) before it can
load a shard. Three local agents started as three interpreters do that three times, on a
2-core machine beside the studio's own start-up. The *zygote* (``python -m agents zygote``)
imports it all once and then ``os.fork()``s one agent per request: the child starts with
every module in memory (copy-on-write) and listens in milliseconds.

Each forked agent is still its own process, as one started with ``python -m agents serve``:
its own pid and session (``setsid``), its own name in ``ps``/``top`` (agents/process_title.py:
``agent edge-a``, and the command line ``edgeshard agent edge-a: python -m agents serve ...``
where ``setproctitle`` is installed), its own stdout/stderr (the launcher's pipe, so its own
log) and its own stdin (a pipe whose end-of-file stops it, ``--exit-on-stdin-eof``). The
launcher creates those pipes and hands their agent-side ends over the zygote's socket
(SCM_RIGHTS) with the agent's command line, environment and working directory; the agent
then runs ``agents.__main__.main(argv)`` exactly as the interpreter would (the zygote is
handed that function: it never imports ``agents.__main__`` itself).

Forking is safe only from a single-threaded process (a lock held by another thread at
fork stays held for ever in the child), so the zygote checks, after its imports, that it
runs one thread (torch and transformers start none at import; no torch op runs here, so
no OpenMP pool exists), and refuses to serve otherwise: the launcher then starts agents the
plain way. The zygote never imports zmq's context or touches a socket of the agents.

Protocol (a ``SOCK_SEQPACKET`` socketpair, one JSON object per message):

- launcher → zygote, first: ``{"preload": bool}``: import the model code (transformers) before
  forking, or leave it to each agent (forked ~1.5 s of CPU sooner; it imports in the background);
- zygote → launcher, once: ``{"ready": pid, "imports_s": {...}, "cpu_s": s, "model_code_imported":
  bool}`` (how long its imports took: torch, the agent's modules, the model code; its CPU
  seconds so far; whether transformers is loaded) or
  ``{"error": why}`` (then it exits);
- launcher → zygote: ``{"spawn": tag, "argv": [...], "env": {...}, "cwd": dir}`` with two
  descriptors (the agent's stdin, its stdout+stderr);
- zygote → launcher: ``{"forked": tag, "pid": pid}`` with one descriptor, a pidfd of the child
  (opened before the zygote could reap it, so it names that process even after its pid is
  reused: signals go through it and its readability means the agent exited), or
  ``{"failed": tag, "error": why}``;
- zygote → launcher: ``{"exited": pid, "status": code}`` when it reaps a child (code as
  ``Popen.returncode``: negative for a signal).

The zygote ends when the launcher's end of the socket closes (the launcher process ended, in
any way); its agents do not depend on it (each stops on its own stdin's end-of-file).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from agents.process_title import agent_titles, prepare_process_titles, set_process_title

MAX_MESSAGE = 1 << 20
LAUNCHERS = ("zygote", "popen")
LAUNCHER_ENV = "EDGESHARD_AGENT_LAUNCHER"
"""Environment variable naming how local launchers start agents by default (``popen``: one
interpreter per agent, no zygote)."""


def default_launcher() -> str:
    return os.environ.get(LAUNCHER_ENV) or "zygote"


def agent_environment(threads: int, base: dict | None = None) -> dict[str, str]:
    """The environment of a local agent (and of the zygote that forks it: OpenMP reads its
    thread count once, when torch is imported)."""
    env = dict(os.environ if base is None else base)
    env.setdefault("OMP_NUM_THREADS", str(max(1, threads)))
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = _with_own_code_first(env.get("PYTHONPATH", ""))
    return env


def _with_own_code_first(pythonpath: str) -> str:
    """``pythonpath`` with the folder that holds this very ``agents`` package first, so a local
    agent runs the launcher's code: a bench or test run from a checkout must not start agents
    from another installed copy (a stale editable install gave "No module named agents")."""
    own = str(Path(__file__).resolve().parent.parent)
    rest = [p for p in pythonpath.split(os.pathsep) if p and p != own]
    return os.pathsep.join([own, *rest])


def start_early_zygote(workdir: str, threads: int = 1) -> "ZygoteClient | None":
    """Start the agents' zygote for a cluster that will run in ``workdir`` *now*, before the
    caller's own slow imports (its imports are the longest part of a local cluster's start),
    or None when agents are not forked (``EDGESHARD_AGENT_LAUNCHER=popen``) or it cannot start
    (the cluster then tries again and falls back, saying so). Its log is ``workdir/zygote.log``.
    Whether it preloads the model code is decided later (``ZygoteClient.preload``)."""
    if default_launcher() != "zygote":
        return None
    os.makedirs(workdir, exist_ok=True)
    zygote = ZygoteClient(env=agent_environment(threads), cwd=workdir, log_path=os.path.join(workdir, "zygote.log"),
                          preload_model_code=None)
    try:
        zygote.start()
    except ZygoteUnavailable:
        return None
    return zygote


class ZygoteUnavailable(Exception):
    """The fork server could not start or stopped answering (the launcher falls back to plain processes)."""


# ------------------------------------------------------------------------------ the server
def serve_zygote(sock_fd: int, entry) -> int:
    """``python -m agents zygote --socket-fd N``: import, check, then fork agents on request;
    each child runs ``entry(argv)`` (``agents.__main__.main``, handed in by it)."""
    import gc

    gc.disable()  # imports make few cycles; collecting during them cost 20 % of their 3.2 s of CPU here
    sock = socket.socket(fileno=sock_fd)
    t0 = time.perf_counter()
    try:
        import torch  # noqa: F401  (timed on its own: the largest part)

        t_torch = time.perf_counter()
        from agents.agent import warm_imports

        t_agent = time.perf_counter()
        if _preload_decided(sock):
            warm_imports()
        t_model = time.perf_counter()
        prepare_process_titles()  # before the first fork: each agent renames itself (agents/process_title.py)
        threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()
        if threads != 1:
            raise RuntimeError(f"{threads} threads run after importing the model code; forking would not be safe")
        gc.freeze()  # what the imports made stays shared: a child's collections never touch (copy) it
    except Exception as err:  # noqa: BLE001 — any failure here means "start agents the plain way"
        _send(sock, {"error": f"{type(err).__name__}: {err}"})
        return 1
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so SIGCHLD reaches the wake-up pipe
    _send(sock, {"ready": os.getpid(), "imports_s": {"torch": round(t_torch - t0, 3), "agent": round(t_agent - t_torch, 3),
                                                     "model_code": round(t_model - t_agent, 3)},
                 "cpu_s": round(time.process_time(), 3), "model_code_imported": "transformers" in sys.modules})
    while True:
        readable, _, _ = select.select([sock, wake_r], [], [], 1.0)
        if wake_r in readable:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
        _reap(sock)
        if sock not in readable:
            continue
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 2)
        except InterruptedError:
            continue
        except OSError:
            return 0
        if not data:  # the launcher is gone
            return 0
        request = None
        try:
            request = json.loads(data)
            _fork_agent(sock, request, fds, wake_r, wake_w, entry)
        except Exception as err:  # noqa: BLE001 — a bad request is answered, never ends the zygote
            _send(sock, {"failed": (request or {}).get("spawn") if isinstance(request, dict) else None,
                         "error": f"{type(err).__name__}: {err}"})
        finally:
            for fd in fds:
                _close(fd)


def _preload_decided(sock: socket.socket) -> bool:
    """The launcher's first message: whether to import the model code before forking
    (``{"preload": true}``: each agent then has it at once; false: agents are forked sooner
    and each imports it in the background, as an agent started on its own does)."""
    data = sock.recv(MAX_MESSAGE)
    if not data:
        raise RuntimeError("the launcher left before saying whether to preload the model code")
    return bool(json.loads(data).get("preload", True))


def _fork_agent(sock: socket.socket, request: dict, fds: list[int], wake_r: int, wake_w: int, entry) -> None:
    tag, argv, env, cwd = request["spawn"], list(request["argv"]), dict(request["env"]), str(request["cwd"])
    if len(fds) != 2:
        raise ValueError(f"expected 2 descriptors (stdin, output), got {len(fds)}")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the agent
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (wake_r, wake_w, sock.fileno()):
                _close(fd)
            os.setsid()
            os.dup2(fds[0], 0)
            os.dup2(fds[1], 1)
            os.dup2(fds[1], 2)
            for fd in fds:
                _close(fd)
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(env)
            import gc

            gc.enable()  # an agent collects as any interpreter does
            sys.argv = [sys.executable, "-m", "agents", *argv]
            set_process_title(*agent_titles(argv))  # its own name in ps/top, not the zygote's command line
            code = entry(argv)
        except SystemExit as done:  # argparse refusing the command line
            code = done.code if isinstance(done.code, int) else 2
        except BaseException:  # noqa: BLE001 — reported in the agent's own log, then it exits
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # never the zygote's teardown, never back into its loop
    pidfd = os.pidfd_open(pid)  # the child cannot have been reaped yet: this names it
    try:
        socket.send_fds(sock, [json.dumps({"forked": tag, "pid": pid}).encode()], [pidfd])
    finally:
        os.close(pidfd)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exited": pid, "status": os.waitstatus_to_exitcode(status)})


def _send(sock: socket.socket, message: dict) -> None:
    try:
        sock.send(json.dumps(message).encode())
    except OSError:
        pass  # the launcher is gone; the loop sees the end-of-file next


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


# ------------------------------------------------------------------------------ the launcher's side
class ForkedAgent:
    """A process the zygote forked, with the part of ``subprocess.Popen`` a launcher uses
    (``pid``, ``stdin``, ``stdout``, ``poll``, ``wait``, ``terminate``, ``kill``,
    ``returncode``). Signals go through a pidfd, so they never reach a later process that
    reused the pid; the exit status is the zygote's report (``None`` until it arrives; if
    the zygote died first, the agent's end is still seen and its status reads 255)."""

    UNKNOWN_STATUS = 255

    def __init__(self, pid: int, pidfd: int, stdin, stdout, reports_ended: threading.Event) -> None:
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.returncode: int | None = None
        self._pidfd = pidfd
        self._status = threading.Event()
        self._reports_ended = reports_ended
        """Set when the zygote's reports stopped (it ended): no status will come."""

    def _exited(self, status: int) -> None:
        self.returncode = status
        self._status.set()

    def _gone(self, timeout_s: float) -> bool:
        if self._pidfd < 0:
            return True
        readable, _, _ = select.select([self._pidfd], [], [], max(0.0, timeout_s))
        return bool(readable)

    def poll(self) -> int | None:
        if self.returncode is None and self._gone(0):
            deadline = time.monotonic() + 1.0  # reaped by the zygote at once; its report follows
            while not self._status.wait(0.02) and not self._reports_ended.is_set() and time.monotonic() < deadline:
                pass
            if self.returncode is None:
                self.returncode = self.UNKNOWN_STATUS
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not self._gone(1e9 if timeout is None else timeout):
                raise subprocess.TimeoutExpired(f"agent pid {self.pid}", timeout)
        return self.poll()

    def send_signal(self, sig: int) -> None:
        if self.returncode is None and self._pidfd >= 0:
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def close(self) -> None:
        """Release the pidfd (after the agent ended)."""
        fd, self._pidfd = self._pidfd, -1
        if fd >= 0:
            os.close(fd)


class ZygoteClient:
    """Starts ``python -m agents zygote`` and asks it for agents. ``ZygoteUnavailable`` when
    it cannot start, is not ready within ``timeout_s``, or stops answering."""

    def __init__(self, python: str = sys.executable, env: dict | None = None, cwd: str | None = None,
                 log_path: str | None = None, preload_model_code: bool | None = True) -> None:
        """``preload_model_code``: import transformers and the model code before forking (each
        agent has it at once, imported once) or not (agents are forked ~1.5 s of CPU sooner and
        each imports it in the background); None: decided later with ``preload()``, which must
        come before ``wait_ready`` (else it preloads)."""
        self.python = python
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd
        self.log_path = log_path
        self.pid = 0
        self.popen: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()  # one spawn request at a time
        self._replies: list = []
        self._reply = threading.Condition()
        self._agents: dict[int, ForkedAgent] = {}
        self._early_exits: dict[int, int] = {}
        self._reader: threading.Thread | None = None
        self._ready = threading.Event()
        self._ended = threading.Event()
        self._error = ""
        self._closed = False
        self.started_at = 0.0
        """``time.time()`` when the zygote was started (0 before)."""
        self.ready_at = 0.0
        """``time.time()`` when its ready report arrived (0 before)."""
        self.report: dict = {}
        """Its ready report: ``imports_s`` (torch, agent, model_code), ``cpu_s`` and
        ``model_code_imported`` (whether the agents it forks have transformers at once)."""
        self._preload = preload_model_code
        self._preload_sent = False

    def start(self) -> None:
        """Start the zygote; returns at once (``wait_ready`` waits for its imports)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(self.env)
        env["PYTHONUNBUFFERED"] = "1"
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.started_at = time.time()
        try:
            self.popen = subprocess.Popen(
                [self.python, "-m", "agents", "zygote", "--socket-fd", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, cwd=self.cwd, start_new_session=True)
        except OSError as err:
            ours.close()
            raise ZygoteUnavailable(f"cannot start {self.python}: {err}") from None
        finally:
            theirs.close()
            if log is not subprocess.DEVNULL:
                log.close()
        self.pid = self.popen.pid
        self._sock = ours
        self._reader = threading.Thread(target=self._read, name="agent-zygote", daemon=True)
        self._reader.start()
        if self._preload is not None:
            self.preload(self._preload)

    def preload(self, model_code: bool) -> None:
        """Tell the zygote whether to import the model code before forking (the first word counts)."""
        if self._preload_sent or self._sock is None:
            return
        self._preload, self._preload_sent = model_code, True
        try:
            self._sock.send(json.dumps({"preload": bool(model_code)}).encode())
        except OSError:
            pass  # it ended: wait_ready says why

    @property
    def preloads_model_code(self) -> bool:
        return self._preload is not False

    def wait_ready(self, timeout_s: float) -> None:
        self.preload(True if self._preload is None else self._preload)  # undecided: the agents get it at once
        if not self._ready.wait(timeout_s):
            self.close()
            raise ZygoteUnavailable(f"not ready after {timeout_s:.0f} s")
        if self._error:
            self.close()
            raise ZygoteUnavailable(self._error)

    def spawn(self, argv: list[str], env: dict, cwd: str, timeout_s: float = 10.0) -> ForkedAgent:
        """Fork an agent running ``python -m agents ARGV`` with pipes for its stdin and its
        output (``.stdin`` and ``.stdout`` of the result, text mode, as Popen's)."""
        if self._sock is None or not self._ready.is_set() or self._error:
            raise ZygoteUnavailable(self._error or "not started")
        in_r, in_w = os.pipe2(os.O_CLOEXEC)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        request = {"spawn": f"{time.monotonic_ns()}", "argv": list(argv), "env": dict(env), "cwd": str(cwd)}
        try:
            with self._lock:
                with self._reply:
                    for _stale, fd in self._replies:  # an answer that came after its request timed out
                        if fd >= 0:
                            os.close(fd)
                    self._replies.clear()
                try:
                    socket.send_fds(self._sock, [json.dumps(request).encode()], [in_r, out_w])
                except OSError as err:
                    raise ZygoteUnavailable(f"cannot reach it ({err})") from None
                finally:
                    os.close(in_r)
                    os.close(out_w)
                    in_r = out_w = -1
                with self._reply:
                    if not self._reply.wait_for(lambda: self._replies or self._error, timeout_s):
                        raise ZygoteUnavailable(f"no answer within {timeout_s:.0f} s")
                    if not self._replies:
                        raise ZygoteUnavailable(self._error)
                    reply, pidfd = self._replies.pop(0)
            if "failed" in reply:
                raise ZygoteUnavailable(f"could not fork the agent: {reply.get('error')}")
            agent = ForkedAgent(int(reply["pid"]), pidfd, open(in_w, "w"), open(out_r, "r"), self._ended)
            in_w = out_r = -1
            with self._reply:
                self._agents[agent.pid] = agent
                early = self._early_exits.pop(agent.pid, None)
            if early is not None:
                agent._exited(early)
            return agent
        finally:
            for fd in (in_r, in_w, out_r, out_w):
                if fd >= 0:
                    os.close(fd)

    def _read(self) -> None:
        sock = self._sock
        assert sock is not None
        while True:
            try:
                data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 1)
            except OSError:
                data, fds = b"", []
            if not data:
                break
            try:
                message = json.loads(data)
            except ValueError:
                continue
            if "forked" in message or "failed" in message:
                with self._reply:
                    self._replies.append((message, fds[0] if fds else -1))
                    self._reply.notify_all()
                continue
            if "ready" in message or "error" in message:
                self._error = str(message.get("error", ""))
                self.ready_at = time.time()
                self.report = {k: message[k] for k in ("imports_s", "cpu_s", "model_code_imported") if k in message}
                self._ready.set()
            elif "exited" in message:
                pid, status = int(message["exited"]), int(message["status"])
                with self._reply:
                    agent = self._agents.pop(pid, None)
                    if agent is None:
                        self._early_exits[pid] = status
                if agent is not None:
                    agent._exited(status)
            for fd in fds:
                os.close(fd)
        with self._reply:
            if not self._error:
                self._error = "the zygote ended" if self._closed else self._exit_reason()
            self._ready.set()
            self._ended.set()
            self._reply.notify_all()

    @property
    def alive(self) -> bool:
        """Ready and still answering."""
        return self._ready.is_set() and not self._error and not self._ended.is_set()

    def _exit_reason(self) -> str:
        code = self.popen.poll() if self.popen is not None else None
        if code is None and self.popen is not None:
            try:
                code = self.popen.wait(2.0)
            except subprocess.TimeoutExpired:
                code = None
        where = f"; see {self.log_path}" if self.log_path else ""
        return f"the zygote exited (status {code}){where}"

    def close(self, timeout_s: float = 2.0) -> None:
        """End the zygote (its agents keep running: each stops on its own)."""
        self._closed = True
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        if self.popen is not None:
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout_s)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout_s)
