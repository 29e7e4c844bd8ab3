"""Commands run on the device: check its Python, start, watch and stop the agent, and the
record (``<remote_dir>/agent.json``) a deploy leaves there."""

from __future__ import annotations

import json
import posixpath
import re
import shlex
import time
from dataclasses import dataclass

import msgspec

from core.devices.deploy.bundle import AgentBundle
from core.devices.deploy.errors import AgentDidNotStart, MissingPackages, NoDiskSpace, PythonTooOld
from core.devices.deploy.ssh import SshSession
from core.errors import DeployError
from core.reporting import Reporter

DEFAULT_REMOTE_DIR = ".edgeshard-agent/{device}"
"""Relative to the login's home directory; ``{device}`` is replaced by the device name
(emulated devices share one filesystem, so each needs its own directory)."""
DEFAULT_CONTROL_PORT = 47000
DEFAULT_DATA_PORT = 47001
MIN_PYTHON = (3, 11)
REQUIRED_MODULES: dict[str, str] = {
    "torch": "torch",
    "transformers": "transformers",
    "safetensors": "safetensors",
    "zmq": "pyzmq",
    "msgspec": "msgspec",
    "zeroconf": "zeroconf",
}
"""Module the agent imports → the pip package that provides it."""
FREE_SPACE_MARGIN = 16 << 20
READY_PREFIX = "EDGESHARD-AGENT-READY"


class AgentRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What a deploy leaves on the device (``agent.json``) and returns to the caller."""

    device: str
    address: str
    pid: int
    log_path: str
    bundle_stamp: str
    bundle_dir: str
    python: str
    control_port: int
    data_port: int
    public_key: str = ""
    started_at: float = 0.0

    @property
    def control_address(self) -> str:
        return f"tcp://{self.address}:{self.control_port}"


@dataclass(frozen=True)
class DeployResult:
    device: str
    record: AgentRecord
    action: str
    """started | already running | upgraded"""
    missing_nothing: bool = True

    @property
    def summary(self) -> str:
        return f"agent {self.action}: pid {self.record.pid}, {self.record.control_address}, log {self.record.log_path}"


@dataclass(frozen=True)
class AgentRunning:
    record: AgentRecord


@dataclass(frozen=True)
class AgentStopped:
    record: AgentRecord


@dataclass(frozen=True)
class AgentNotDeployed:
    pass


AgentState = AgentRunning | AgentStopped | AgentNotDeployed


@dataclass(frozen=True)
class DeployOptions:
    python: str = "python3"
    remote_dir: str = DEFAULT_REMOTE_DIR
    control_port: int = DEFAULT_CONTROL_PORT
    data_port: int = DEFAULT_DATA_PORT
    bind_host: str = "0.0.0.0"
    announce: bool = True
    startup_timeout_s: float = 90.0
    threads: int = 0
    link_mbit: float = 0.0
    link_latency_ms: float = 0.0
    memory_budget_mib: float = 0.0
    """An emulated memory budget the agent enforces (agents/emulation.py); 0 = none."""
    compute_slowdown: float = 1.0
    """An emulated slower device: each computation takes this many times as long; 1 = none."""
    shared_host: bool = False
    """Other agents of the cluster run on the same host (the netns testbed): the agent profiles
    its units cold (``--shared-host``). Real devices, one agent each, leave it False."""


_CHECK_SCRIPT = r"""
import importlib, json, os, shutil, sys
base = os.path.expanduser(sys.argv[1])
mods = sys.argv[2].split(",")
res = {"version": list(sys.version_info[:3]), "executable": sys.executable, "missing": {}}
for m in mods:
    try:
        importlib.import_module(m)
    except Exception as e:
        res["missing"][m] = type(e).__name__ + ": " + str(e)[:200]
try:
    os.makedirs(base, exist_ok=True)
    res["free_bytes"] = shutil.disk_usage(base).free
    res["home"] = os.path.expanduser("~")
except OSError as e:
    res["dir_error"] = str(e)
print(json.dumps(res))
"""


def remote_dir_for(template: str, device: str) -> str:
    return template.replace("{device}", device)


def quote(s: str) -> str:
    return shlex.quote(s)


def check_device(session: SshSession, opts: DeployOptions, needed_bytes: int = 0) -> dict:
    """Remote Python version, importable modules and free space; raise on any problem."""
    dev = session.target.device
    cmd = f"{quote(opts.python)} -c {quote(_CHECK_SCRIPT)} {quote(opts.remote_dir)} {quote(','.join(REQUIRED_MODULES))}"
    rc, out, err = session.run(cmd, timeout_s=180)
    if rc == 127 or (rc != 0 and "not found" in err):
        raise PythonTooOld(dev, f"no Python at {opts.python!r} on the device",
                           "install Python >= 3.11, or give its path with --python")
    try:
        res = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise DeployError(dev, f"the Python check failed (exit {rc}): {err.strip()[-500:]}") from None
    if tuple(res["version"][:2]) < MIN_PYTHON:
        raise PythonTooOld(dev, f"{opts.python} is Python {'.'.join(map(str, res['version']))}; the agent needs "
                                f">= {'.'.join(map(str, MIN_PYTHON))}", "install a newer Python and pass --python")
    if res["missing"]:
        raise MissingPackages(dev, opts.python, {m: REQUIRED_MODULES[m] for m in res["missing"]})
    if "dir_error" in res:
        raise DeployError(dev, f"cannot create {opts.remote_dir}: {res['dir_error']}")
    if res["free_bytes"] < needed_bytes + FREE_SPACE_MARGIN:
        raise NoDiskSpace(dev, f"only {res['free_bytes'] / 2**20:.1f} MiB free in ~/{opts.remote_dir}, "
                               f"need {(needed_bytes + FREE_SPACE_MARGIN) / 2**20:.1f} MiB",
                          "free some space on the device or choose another --remote-dir")
    return res


def remote_abs(session: SshSession, home: str, path: str) -> str:
    return path if path.startswith("/") else posixpath.join(home, path)

def read_record(session: SshSession, remote_dir: str = DEFAULT_REMOTE_DIR) -> AgentRecord | None:
    try:
        with session.sftp.open(posixpath.join(remote_dir, "agent.json"), "rb") as f:
            return msgspec.json.decode(f.read(), type=AgentRecord)
    except FileNotFoundError:
        return None
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def write_record(session: SshSession, remote_dir: str, record: AgentRecord) -> None:
    path = posixpath.join(remote_dir, "agent.json")
    with session.sftp.open(path + ".tmp", "wb") as f:
        f.write(msgspec.json.encode(record))
    session.sftp.posix_rename(path + ".tmp", path)


def is_running(session: SshSession, record: AgentRecord) -> bool:
    rc, out, _ = session.run(f"cat /proc/{int(record.pid)}/cmdline 2>/dev/null | tr '\\0' ' '", timeout_s=20)
    return rc == 0 and "agents" in out and "serve" in out


def agent_state(session: SshSession, remote_dir: str = DEFAULT_REMOTE_DIR) -> AgentState:
    record = read_record(session, remote_dir)
    if record is None:
        return AgentNotDeployed()
    return AgentRunning(record) if is_running(session, record) else AgentStopped(record)


def read_log(session: SshSession, remote_dir: str = DEFAULT_REMOTE_DIR, lines: int = 200) -> str:
    record = read_record(session, remote_dir)
    path = record.log_path if record else posixpath.join(remote_dir, "agent.log")
    rc, out, _ = session.run(f"tail -n {int(lines)} {quote(path)} 2>/dev/null", timeout_s=20)
    return out


def stop_agent(session: SshSession, remote_dir: str = DEFAULT_REMOTE_DIR, grace_s: float = 10.0) -> bool:
    """Stop the recorded agent (TERM, then KILL after ``grace_s``). Idempotent: False if none ran."""
    record = read_record(session, remote_dir)
    if record is None or not is_running(session, record):
        return False
    pid = int(record.pid)
    session.run(f"kill -TERM {pid} 2>/dev/null; for i in $(seq {int(grace_s * 10)}); do "
                f"kill -0 {pid} 2>/dev/null || exit 0; sleep 0.1; done; kill -KILL {pid} 2>/dev/null; exit 0",
                timeout_s=grace_s + 20)
    return True


def tail_log(session: SshSession, path: str, n: int = 40) -> str:
    _, out, _ = session.run(f"tail -n {n} {quote(path)} 2>/dev/null", timeout_s=20)
    return out


def start_agent(session: SshSession, opts: DeployOptions, bundle: AgentBundle, bundle_dir: str, base: str,
           coordinator_public_key: str, address: str, reporter: Reporter) -> AgentRecord:
    dev = session.target.device
    log_path = posixpath.join(base, "agent.log")
    key_file = posixpath.join(base, "agent.key")
    args = ["-m", "agents", "serve", "--device", dev, "--host", opts.bind_host, "--advertise-host", address,
            "--control-port", str(opts.control_port), "--data-port", str(opts.data_port),
            # "=" form: a Z85 key may start with "-", which argparse would take for an option
            f"--coordinator-key={coordinator_public_key}", "--key-file", key_file, "--log-level", "INFO"]
    if opts.announce:
        args.append("--announce")
    if opts.threads:
        args += ["--threads", str(opts.threads)]
    if opts.link_mbit:
        args += ["--link-mbit", str(opts.link_mbit)]
    if opts.link_latency_ms:
        args += ["--link-latency-ms", str(opts.link_latency_ms)]
    if opts.memory_budget_mib:
        args += ["--memory-budget-mib", str(opts.memory_budget_mib)]
    if opts.compute_slowdown != 1.0:
        args += ["--compute-slowdown", str(opts.compute_slowdown)]
    if opts.shared_host:
        args.append("--shared-host")
    cmd = (f"cd {quote(bundle_dir)} && : > {quote(log_path)} && PYTHONPATH={quote(bundle_dir)} PYTHONUNBUFFERED=1 "
           f"setsid nohup {quote(opts.python)} {' '.join(quote(a) for a in args)} "
           f">> {quote(log_path)} 2>&1 < /dev/null & echo $!")
    rc, out, err = session.run(cmd, timeout_s=30)
    if rc != 0 or not out.strip().isdigit():
        raise AgentDidNotStart(dev, f"could not launch the agent (exit {rc}): {err.strip()}", tail_log(session, log_path))
    pid = int(out.strip())
    reporter.status(f"agent launched (pid {pid}), waiting for it to listen")
    deadline = time.monotonic() + opts.startup_timeout_s
    ready = None
    while time.monotonic() < deadline:
        log = tail_log(session, log_path, 60)
        m = re.search(rf"{READY_PREFIX} .*control=(\d+) data=(\d+) public_key=(\S+) pid=(\d+)", log)
        if m:
            ready = m
            break
        rc, _, _ = session.run(f"kill -0 {pid}", timeout_s=10)
        if rc != 0:
            raise AgentDidNotStart(dev, "the agent exited during startup", tail_log(session, log_path))
        time.sleep(0.3)
    if ready is None:
        raise AgentDidNotStart(dev, f"the agent did not become ready within {opts.startup_timeout_s:.0f} s",
                               tail_log(session, log_path))
    return AgentRecord(device=dev, address=address, pid=int(ready.group(4)), log_path=log_path,
                       bundle_stamp=bundle.stamp, bundle_dir=bundle_dir, python=opts.python,
                       control_port=int(ready.group(1)), data_port=int(ready.group(2)),
                       public_key=ready.group(3), started_at=time.time())


def wait_until_answers(record: AgentRecord, coordinator_keys, timeout_s: float = 20.0) -> None:
    """A real answer over the control protocol (CurveZMQ), not just an open port."""
    from core.devices.agent_link import AgentEndpoint, AgentLink

    ep = AgentEndpoint(record.device, record.control_address, record.public_key)
    with AgentLink([ep], coordinator_keys, heartbeat_timeout_s=timeout_s + 5) as link:
        link.status(timeout_s=timeout_s)
