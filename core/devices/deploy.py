"""Putting an agent on a device over SSH (paramiko): check, upload, start, watch, stop.

Security rules, and why:
- Host keys are verified against the user's ``~/.ssh/known_hosts`` and the workspace's
  own ``known_hosts``. An unknown key raises ``UnknownHostKey`` carrying its SHA256
  fingerprint; it is trusted only when the caller says so (GUI dialog, CLI prompt or
  ``--trust-new-host-keys``) and is then written to the workspace file. A key that differs
  from a known one raises ``HostKeyMismatch`` and is never overridden here: that is what a
  man-in-the-middle looks like. There is no AutoAddPolicy anywhere.
- A password is used for the one connection it was given to and never stored.

A deploy is idempotent: the agent bundle (the ``agents`` package only) is stamped with a
hash of its files, uploaded once per stamp, and an agent already running the same stamp
is left alone (a different stamp is an upgrade: stop, upload, start). The agent runs
detached (``setsid nohup``) so it survives the SSH session; its pid, ports, key and log
path are recorded on the device in ``<remote_dir>/agent.json``.

Every failure the operator can act on is a ``DeployError`` subclass with a hint.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import errno
import hashlib
import io
import json
import os
import posixpath
import re
import shlex
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import msgspec
import paramiko

import agents
from agents import AGENT_VERSION
from core.devices.deployments import default_workspace
from core.errors import DeployError
from core.devices.host_key_types import restrict_to_known_types
from core.paths import home_folder
from core.reporting import Cancelled, NullReporter, Reporter

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
_WORKSPACE_LOCK = threading.Lock()
"""Parallel deploys share the workspace's key, known_hosts and agents.json: one writer at a time."""


# ------------------------------------------------------------------------------ errors
class HostUnreachable(DeployError):
    """No route, DNS failure or timeout."""


class ConnectionRefused(DeployError):
    """The host answered but nothing listens on the SSH port."""


class AuthenticationFailed(DeployError):
    """The server rejected every credential offered."""


class UnknownHostKey(DeployError):
    """The host's key is in no known_hosts file: the operator must accept its fingerprint."""

    def __init__(self, device: str, info: HostKeyInfo):
        self.info = info
        super().__init__(
            device,
            f"unknown host key for {info.host_label}: {info.key_type} {info.fingerprint}",
            "check the fingerprint on the device (ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub), "
            "then accept it (GUI dialog, or --trust-new-host-keys)",
        )


class HostKeyMismatch(DeployError):
    """The host presented a different key than the one recorded: refused."""

    def __init__(self, device: str, info: HostKeyInfo):
        self.info = info
        super().__init__(
            device,
            f"HOST KEY CHANGED for {info.host_label}! It presented {info.key_type} {info.fingerprint}, "
            f"known_hosts has {info.known_key_type} {info.known_fingerprint} ({info.known_file}). "
            "Someone could be intercepting the connection (man-in-the-middle), or the device was reinstalled.",
            f"if the change is expected, remove the old entry: ssh-keygen -R {shlex.quote(info.host_label)} "
            f"-f {shlex.quote(info.known_file)}",
        )


class MissingPackages(DeployError):
    """The device's Python lacks modules the agent needs; ``missing`` maps module → pip package."""

    def __init__(self, device: str, python: str, missing: dict[str, str]):
        self.missing = dict(missing)
        pkgs = " ".join(sorted(set(missing.values())))
        lines = "; ".join(f"{m} (pip install {p})" for m, p in sorted(missing.items()))
        super().__init__(device, f"{python} cannot import: {lines}",
                         f"install them on the device: {python} -m pip install {pkgs}")


class PythonTooOld(DeployError):
    """No usable Python on the device."""


class NoDiskSpace(DeployError):
    """Not enough free space in the remote directory."""


class AgentDidNotStart(DeployError):
    """The agent exited or never answered; ``log_tail`` is the end of its log."""

    def __init__(self, device: str, message: str, log_tail: str):
        self.log_tail = log_tail
        super().__init__(device, f"{message}\n--- agent log (tail) ---\n{log_tail.rstrip()}",
                         "read the log above; `edgeshard agents logs` shows more")


# --------------------------------------------------------------------------- host keys
@dataclass(frozen=True)
class HostKeyInfo:
    host: str
    port: int
    key_type: str
    fingerprint: str
    """``SHA256:...`` exactly as OpenSSH prints it."""
    known: bool
    changed: bool = False
    known_fingerprint: str = ""
    known_file: str = ""
    known_key_type: str = ""
    key_base64: str = ""

    @property
    def host_label(self) -> str:
        return known_hosts_name(self.host, self.port)


def known_hosts_name(host: str, port: int) -> str:
    return host if port == 22 else f"[{host}]:{port}"


def fingerprint(key: paramiko.PKey) -> str:
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def user_known_hosts() -> Path:
    return Path.home() / ".ssh" / "known_hosts"


@dataclass(frozen=True)
class HostKeyPolicy:
    """Where known keys are read (user file, workspace file) and whether new ones are trusted.

    ``trust_new`` may be a bool or a callback ``(HostKeyInfo) -> bool`` (a GUI dialog, a CLI
    prompt); only a True answer adds the key, to the workspace file.
    """

    workspace_known_hosts: Path
    user_known_hosts: Path | None = field(default_factory=user_known_hosts)
    trust_new: bool | Callable[[HostKeyInfo], bool] = False
    trusted_fingerprints: tuple[str, ...] = ()
    """Fingerprints the operator already confirmed (e.g. in a dialog before the deploy)."""

    def check(self, device: str, host: str, port: int, key: paramiko.PKey) -> HostKeyInfo:
        info = self.classify(host, port, key)
        if info.changed:
            raise HostKeyMismatch(device, info)
        if info.known:
            return info
        accepted = info.fingerprint in self.trusted_fingerprints or (
            self.trust_new(info) if callable(self.trust_new) else bool(self.trust_new))
        if not accepted:
            raise UnknownHostKey(device, info)
        self.remember(host, port, key)
        return HostKeyInfo(**{**info.__dict__, "known": True})

    def classify(self, host: str, port: int, key: paramiko.PKey) -> HostKeyInfo:
        """Known, unknown, or changed. A host with ANY entry that presents a key of a type not
        on file counts as changed: otherwise a man in the middle with another key type would be
        an "unknown" host that ``trust_new`` accepts."""
        fp = fingerprint(key)
        base = dict(host=host, port=port, key_type=key.get_name(), fingerprint=fp, key_base64=key.get_base64())
        entries = self.known_entries(host, port)
        for path, known in entries:
            if known.get_name() != key.get_name():
                continue
            if known.asbytes() == key.asbytes():
                return HostKeyInfo(**base, known=True, known_fingerprint=fp, known_file=str(path),
                                   known_key_type=known.get_name())
            return HostKeyInfo(**base, known=False, changed=True, known_fingerprint=fingerprint(known),
                               known_file=str(path), known_key_type=known.get_name())
        if entries:
            path, known = entries[0]
            return HostKeyInfo(**base, known=False, changed=True, known_fingerprint=fingerprint(known),
                               known_file=str(path), known_key_type=known.get_name())
        return HostKeyInfo(**base, known=False)

    def known_entries(self, host: str, port: int) -> list[tuple[Path, paramiko.PKey]]:
        """Every key on file for the host (user file first), with the file it is in."""
        name = known_hosts_name(host, port)
        found = []
        for path in [p for p in (self.user_known_hosts, self.workspace_known_hosts) if p]:
            entry = _load_known_hosts(path).lookup(name)
            found += [(path, entry[kt]) for kt in (entry.keys() if entry else ())]
        return found

    def start_verified(self, device: str, host: str, port: int, t: paramiko.Transport,
                       timeout_s: float) -> paramiko.PKey:
        """Handshake asking a known host only for key types on file; one that offers none of
        them is refused as a changed key. Returns the presented key (not yet checked)."""
        entries = self.known_entries(host, port)
        restrict_to_known_types(t, dict.fromkeys(k.get_name() for _, k in entries))
        try:
            t.start_client(timeout=timeout_s)
        except paramiko.ssh_exception.IncompatiblePeer as err:
            if not entries or "host key" not in str(err):
                raise
            path, known = entries[0]
            types = ", ".join(dict.fromkeys(k.get_name() for _, k in entries))
            raise HostKeyMismatch(device, HostKeyInfo(
                host=host, port=port, key_type=f"no key of the known type ({types})",
                fingerprint="(the server offers only other key types)", known=False, changed=True,
                known_fingerprint=fingerprint(known), known_file=str(path),
                known_key_type=known.get_name())) from None
        return t.get_remote_server_key()

    def remember(self, host: str, port: int, key: paramiko.PKey) -> None:
        path = self.workspace_known_hosts
        with _WORKSPACE_LOCK:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(f"{known_hosts_name(host, port)} {key.get_name()} {key.get_base64()}\n")
            os.chmod(path, 0o600)


def _load_known_hosts(path: Path) -> paramiko.HostKeys:
    keys = paramiko.HostKeys()
    if path.is_file():
        try:
            keys.load(str(path))
        except (OSError, paramiko.SSHException):
            pass
    return keys


# ------------------------------------------------------------------------- connections
@dataclass(frozen=True)
class SshTarget:
    device: str
    address: str
    port: int = 22
    user: str = ""


@dataclass(frozen=True, repr=False)
class SshAuth:
    """Credentials for one connection. ``password`` is never written anywhere."""

    key_file: str | None = None
    password: str | None = None
    use_agent: bool = True
    passphrase: str | None = None


def _open_socket(target: SshTarget, timeout_s: float) -> socket.socket:
    try:
        return socket.create_connection((target.address, target.port), timeout=timeout_s)
    except ConnectionRefusedError:
        raise ConnectionRefused(target.device, f"connection refused by {target.address}:{target.port}",
                                "is sshd running on the device, and is this its SSH port?") from None
    except socket.timeout:
        raise HostUnreachable(target.device, f"no answer from {target.address}:{target.port} within {timeout_s:.0f} s",
                              "is the device on and on this network?") from None
    except OSError as err:
        raise HostUnreachable(target.device, f"cannot reach {target.address}:{target.port}: {err.strerror or err}",
                              "check the address and the network") from None


def probe_host_key(address: str, port: int = 22, *, workspace_known_hosts: Path | None = None,
                   user_known: Path | None = None, timeout_s: float = 10.0) -> HostKeyInfo:
    """Fetch the host's key and say whether it is known, unknown or changed (no login)."""
    target = SshTarget(device=address, address=address, port=port)
    policy = HostKeyPolicy(workspace_known_hosts=workspace_known_hosts or default_workspace() / "known_hosts",
                           user_known_hosts=user_known if user_known is not None else user_known_hosts())
    sock = _open_socket(target, timeout_s)
    t = paramiko.Transport(sock)
    try:
        return policy.classify(address, port, policy.start_verified(address, address, port, t, timeout_s))
    except HostKeyMismatch as err:
        return err.info
    except paramiko.SSHException as err:
        raise HostUnreachable(address, f"SSH handshake with {address}:{port} failed: {err}") from None
    finally:
        t.close()




class SshSession:
    """One authenticated SSH transport: run commands, use SFTP. Close it (context manager)."""

    def __init__(self, target: SshTarget, transport: paramiko.Transport, host_key: HostKeyInfo):
        self.target, self.transport, self.host_key = target, transport, host_key
        self._sftp: paramiko.SFTPClient | None = None

    def run(self, command: str, timeout_s: float = 120.0, stdin: bytes | None = None) -> tuple[int, str, str]:
        chan = self.transport.open_session(timeout=timeout_s)
        try:
            chan.settimeout(timeout_s)
            chan.exec_command(command)
            if stdin is not None:
                chan.sendall(stdin)
                chan.shutdown_write()
            out, err = io.BytesIO(), io.BytesIO()
            deadline = time.monotonic() + timeout_s
            while True:
                while chan.recv_ready():
                    out.write(chan.recv(65536))
                while chan.recv_stderr_ready():
                    err.write(chan.recv_stderr(65536))
                if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                    break
                if time.monotonic() > deadline:
                    raise DeployError(self.target.device, f"command timed out after {timeout_s:.0f} s: {command[:80]}")
                time.sleep(0.01)
            return chan.recv_exit_status(), out.getvalue().decode(errors="replace"), err.getvalue().decode(
                errors="replace")
        finally:
            chan.close()

    @property
    def sftp(self) -> paramiko.SFTPClient:
        if self._sftp is None:
            self._sftp = paramiko.SFTPClient.from_transport(self.transport)
        return self._sftp

    def close(self) -> None:
        if self._sftp is not None:
            self._sftp.close()
        self.transport.close()

    def __enter__(self) -> SshSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(target: SshTarget, auth: SshAuth, policy: HostKeyPolicy, timeout_s: float = 15.0) -> SshSession:
    """Open, verify the host key (before any credential is sent), authenticate."""
    sock = _open_socket(target, timeout_s)
    t = paramiko.Transport(sock)
    try:
        try:
            key = policy.start_verified(target.device, target.address, target.port, t, timeout_s)
        except (paramiko.SSHException, EOFError, OSError) as err:
            raise HostUnreachable(target.device, f"SSH handshake with {target.address}:{target.port} failed: {err}",
                                  "is this an SSH server?") from None
        info = policy.check(target.device, target.address, target.port, key)
        _authenticate(t, target, auth)
        return SshSession(target, t, info)
    except BaseException:
        t.close()
        raise


def _authenticate(t: paramiko.Transport, target: SshTarget, auth: SshAuth) -> None:
    user = target.user or os.environ.get("USER", "root")
    tried: list[str] = []
    if auth.key_file:
        try:
            key = paramiko.PKey.from_path(os.path.expanduser(auth.key_file), password=auth.passphrase)
        except paramiko.PasswordRequiredException:
            raise AuthenticationFailed(target.device, f"key file {auth.key_file} is encrypted",
                                       "give its passphrase, or load it into ssh-agent") from None
        except (OSError, paramiko.SSHException, ValueError) as err:
            raise AuthenticationFailed(target.device, f"cannot read key file {auth.key_file}: {err}") from None
        try:
            t.auth_publickey(user, key)
            return
        except paramiko.AuthenticationException:
            tried.append(f"key {auth.key_file}")
    if auth.use_agent and not t.is_authenticated():
        try:
            agent_keys = paramiko.Agent().get_keys()
        except paramiko.SSHException:
            agent_keys = ()
        for key in agent_keys:
            try:
                t.auth_publickey(user, key)
                return
            except paramiko.AuthenticationException:
                continue
        if agent_keys:
            tried.append(f"{len(agent_keys)} ssh-agent key(s)")
    if auth.password is not None:
        try:
            t.auth_password(user, auth.password)
            return
        except paramiko.AuthenticationException:
            tried.append("password")
        except paramiko.BadAuthenticationType as err:
            tried.append(f"password (server allows only {', '.join(err.allowed_types)})")
    if not tried:
        raise AuthenticationFailed(target.device, "no credentials: give a key file, a password or run ssh-agent")
    raise AuthenticationFailed(target.device, f"{user}@{target.address} rejected {', '.join(tried)}",
                               "check the user name and that the key is in the device's authorized_keys")


# ------------------------------------------------------------------------------ bundle
@dataclass(frozen=True)
class AgentBundle:
    stamp: str
    """``AGENT_VERSION-<hash of the files>``: a changed file is a new version."""
    files: dict[str, bytes]
    """Path inside the bundle (``agents/...``) → content."""

    @property
    def size(self) -> int:
        return sum(len(b) for b in self.files.values())


def build_bundle(package_dir: Path | None = None) -> AgentBundle:
    """The ``agents`` package's source files, stamped (nothing from core/ or gui/ ships)."""
    root = Path(package_dir or Path(agents.__file__).parent)
    files = {}
    for p in sorted(root.rglob("*.py")):
        if "__pycache__" in p.parts:
            continue
        files[f"agents/{p.relative_to(root).as_posix()}"] = p.read_bytes()
    h = hashlib.sha256()
    for name, data in files.items():
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return AgentBundle(stamp=f"{AGENT_VERSION}-{h.hexdigest()[:12]}", files=files)


# -------------------------------------------------------------------------- the record
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


def _q(s: str) -> str:
    return shlex.quote(s)


def check_device(session: SshSession, opts: DeployOptions, needed_bytes: int = 0) -> dict:
    """Remote Python version, importable modules and free space; raise on any problem."""
    dev = session.target.device
    cmd = f"{_q(opts.python)} -c {_q(_CHECK_SCRIPT)} {_q(opts.remote_dir)} {_q(','.join(REQUIRED_MODULES))}"
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


def _remote_abs(session: SshSession, home: str, path: str) -> str:
    return path if path.startswith("/") else posixpath.join(home, path)


def _sftp_makedirs(sftp: paramiko.SFTPClient, path: str) -> None:
    parts = path.strip("/").split("/")
    cur = "/" if path.startswith("/") else ""
    for part in parts:
        cur = posixpath.join(cur, part) if cur else part
        try:
            sftp.stat(cur)
        except FileNotFoundError:
            sftp.mkdir(cur)


def _upload_bundle(session: SshSession, bundle: AgentBundle, bundle_dir: str, reporter: Reporter) -> bool:
    """Upload unless a complete copy of this stamp is there; False when it was already there."""
    sftp = session.sftp
    marker = posixpath.join(bundle_dir, "BUNDLE_OK")
    try:
        if sftp.stat(marker).st_size == len(bundle.stamp):
            return False
    except FileNotFoundError:
        pass
    total, done = bundle.size, 0
    try:
        for name, data in bundle.files.items():
            path = posixpath.join(bundle_dir, name)
            _sftp_makedirs(sftp, posixpath.dirname(path))
            with sftp.open(path, "wb") as f:
                f.write(data)
            done += len(data)
            reporter.progress(done, total)
        with sftp.open(marker, "wb") as f:
            f.write(bundle.stamp.encode())
    except OSError as err:
        if getattr(err, "errno", None) == errno.ENOSPC or "space" in str(err).lower() or "Failure" in str(err):
            raise NoDiskSpace(session.target.device, f"upload to {bundle_dir} failed: {err}",
                              "free some space on the device") from None
        raise
    return True


def read_record(session: SshSession, remote_dir: str = DEFAULT_REMOTE_DIR) -> AgentRecord | None:
    try:
        with session.sftp.open(posixpath.join(remote_dir, "agent.json"), "rb") as f:
            return msgspec.json.decode(f.read(), type=AgentRecord)
    except FileNotFoundError:
        return None
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _write_record(session: SshSession, remote_dir: str, record: AgentRecord) -> None:
    path = posixpath.join(remote_dir, "agent.json")
    with session.sftp.open(path + ".tmp", "wb") as f:
        f.write(msgspec.json.encode(record))
    session.sftp.posix_rename(path + ".tmp", path)


def _is_running(session: SshSession, record: AgentRecord) -> bool:
    rc, out, _ = session.run(f"cat /proc/{int(record.pid)}/cmdline 2>/dev/null | tr '\\0' ' '", timeout_s=20)
    return rc == 0 and "agents" in out and "serve" in out


def agent_state(session: SshSession, remote_dir: str = DEFAULT_REMOTE_DIR) -> AgentState:
    record = read_record(session, remote_dir)
    if record is None:
        return AgentNotDeployed()
    return AgentRunning(record) if _is_running(session, record) else AgentStopped(record)


def read_log(session: SshSession, remote_dir: str = DEFAULT_REMOTE_DIR, lines: int = 200) -> str:
    record = read_record(session, remote_dir)
    path = record.log_path if record else posixpath.join(remote_dir, "agent.log")
    rc, out, _ = session.run(f"tail -n {int(lines)} {_q(path)} 2>/dev/null", timeout_s=20)
    return out


def stop_agent(session: SshSession, remote_dir: str = DEFAULT_REMOTE_DIR, grace_s: float = 10.0) -> bool:
    """Stop the recorded agent (TERM, then KILL after ``grace_s``). Idempotent: False if none ran."""
    record = read_record(session, remote_dir)
    if record is None or not _is_running(session, record):
        return False
    pid = int(record.pid)
    session.run(f"kill -TERM {pid} 2>/dev/null; for i in $(seq {int(grace_s * 10)}); do "
                f"kill -0 {pid} 2>/dev/null || exit 0; sleep 0.1; done; kill -KILL {pid} 2>/dev/null; exit 0",
                timeout_s=grace_s + 20)
    return True


def _tail(session: SshSession, path: str, n: int = 40) -> str:
    _, out, _ = session.run(f"tail -n {n} {_q(path)} 2>/dev/null", timeout_s=20)
    return out


def _start(session: SshSession, opts: DeployOptions, bundle: AgentBundle, bundle_dir: str, base: str,
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
    cmd = (f"cd {_q(bundle_dir)} && : > {_q(log_path)} && PYTHONPATH={_q(bundle_dir)} PYTHONUNBUFFERED=1 "
           f"setsid nohup {_q(opts.python)} {' '.join(_q(a) for a in args)} "
           f">> {_q(log_path)} 2>&1 < /dev/null & echo $!")
    rc, out, err = session.run(cmd, timeout_s=30)
    if rc != 0 or not out.strip().isdigit():
        raise AgentDidNotStart(dev, f"could not launch the agent (exit {rc}): {err.strip()}", _tail(session, log_path))
    pid = int(out.strip())
    reporter.status(f"agent launched (pid {pid}), waiting for it to listen")
    deadline = time.monotonic() + opts.startup_timeout_s
    ready = None
    while time.monotonic() < deadline:
        log = _tail(session, log_path, 60)
        m = re.search(rf"{READY_PREFIX} .*control=(\d+) data=(\d+) public_key=(\S+) pid=(\d+)", log)
        if m:
            ready = m
            break
        rc, _, _ = session.run(f"kill -0 {pid}", timeout_s=10)
        if rc != 0:
            raise AgentDidNotStart(dev, "the agent exited during startup", _tail(session, log_path))
        time.sleep(0.3)
    if ready is None:
        raise AgentDidNotStart(dev, f"the agent did not become ready within {opts.startup_timeout_s:.0f} s",
                               _tail(session, log_path))
    return AgentRecord(device=dev, address=address, pid=int(ready.group(4)), log_path=log_path,
                       bundle_stamp=bundle.stamp, bundle_dir=bundle_dir, python=opts.python,
                       control_port=int(ready.group(1)), data_port=int(ready.group(2)),
                       public_key=ready.group(3), started_at=time.time())


def wait_until_answers(record: AgentRecord, coordinator_keys, timeout_s: float = 20.0) -> None:
    """A real answer over the control protocol (CurveZMQ), not just an open port."""
    from core.runs.coordinator import AgentEndpoint, Coordinator

    ep = AgentEndpoint(record.device, record.control_address, record.public_key)
    with Coordinator([ep], coordinator_keys, heartbeat_timeout_s=timeout_s + 5) as coord:
        coord.status(timeout_s=timeout_s)


def deploy_agent(
    reporter: Reporter | None,
    device,
    *,
    user: str | None = None,
    key_file: str | None = None,
    password: str | None = None,
    trusted_fingerprint: str | None = None,
    trust_new_host_keys: bool | Callable[[HostKeyInfo], bool] = False,
    workspace: Path | None = None,
    options: DeployOptions | None = None,
    use_agent: bool = True,
    user_known: Path | None = None,
    bundle: AgentBundle | None = None,
) -> DeployResult:
    """Deploy (or confirm, or upgrade) the agent on one device (a ``core.devices.cluster.Device`` or
    ``SshTarget``). Steps, each reported: connect (host key verified) → check Python,
    packages and disk → upload the bundle if this stamp is not there → stop an older agent
    → start detached → wait for its ready line → answer over the control protocol."""
    rep = reporter or NullReporter()
    opts = options or DeployOptions()
    ws = home_folder(workspace)
    if isinstance(device, SshTarget):
        target = device if not user else SshTarget(device.device, device.address, device.port, user)
    else:
        target = SshTarget(device=device.id, address=device.address, port=device.ssh_port or 22,
                           user=user or device.ssh_user)
    policy = HostKeyPolicy(workspace_known_hosts=ws / "known_hosts",
                           user_known_hosts=user_known if user_known is not None else user_known_hosts(),
                           trust_new=trust_new_host_keys,
                           trusted_fingerprints=(trusted_fingerprint,) if trusted_fingerprint else ())
    coordinator_keys = coordinator_keypair(ws)
    bundle = bundle or build_bundle()
    opts = replace(opts, remote_dir=remote_dir_for(opts.remote_dir, target.device))
    steps = 6
    rep.status(f"connecting to {target.user + '@' if target.user else ''}{target.address}:{target.port}")
    rep.progress(0, steps)
    with connect(target, SshAuth(key_file=key_file, password=password, use_agent=use_agent), policy) as s:
        base = _remote_abs(s, s.sftp.normalize("."), opts.remote_dir)
        current = agent_state(s, base)
        if isinstance(current, AgentRunning) and current.record.bundle_stamp == bundle.stamp \
                and current.record.public_key:
            rep.status("agent already running this version; checking that it answers")
            rep.progress(5, steps)
            try:
                wait_until_answers(current.record, coordinator_keys)
            except Exception as err:
                raise AgentDidNotStart(target.device, f"the running agent (pid {current.record.pid}) does not "
                                       f"answer: {err}", _tail(s, current.record.log_path)) from None
            _remember_agent(ws, current.record)
            _remember_deployment(ws, target, key_file, password, base, opts, current.record)
            rep.progress(steps, steps)
            return DeployResult(target.device, current.record, "already running")
        _stop_if_cancelled(rep)
        rep.status(f"checking Python and packages ({opts.python})")
        rep.progress(1, steps)
        check_device(s, opts, needed_bytes=bundle.size)
        bundle_dir = posixpath.join(base, f"agent-{bundle.stamp}")
        _stop_if_cancelled(rep)
        rep.status(f"uploading agent {bundle.stamp} ({bundle.size / 1024:.0f} KiB)")
        rep.progress(2, steps)
        _upload_bundle(s, bundle, bundle_dir, NullReporter())
        action = "started"
        if isinstance(current, AgentRunning):
            rep.status(f"stopping the running agent ({current.record.bundle_stamp})")
            stop_agent(s, base)
            action = "upgraded"
        _stop_if_cancelled(rep)
        rep.status("starting the agent")
        rep.progress(3, steps)
        record = _start(s, opts, bundle, bundle_dir, base, coordinator_keys.public, target.address, rep)
        _write_record(s, base, record)
        rep.status(f"agent up (pid {record.pid}); checking that it answers")
        rep.progress(4, steps)
        try:
            wait_until_answers(record, coordinator_keys)
        except Exception as err:
            raise AgentDidNotStart(target.device, f"the agent does not answer on {record.control_address}: {err}",
                                   _tail(s, record.log_path)) from None
        _remember_agent(ws, record)
        _remember_deployment(ws, target, key_file, password, base, opts, record)
        rep.status(f"agent {action}: pid {record.pid}, log {record.log_path}")
        rep.progress(steps, steps)
        return DeployResult(target.device, record, action)


def _stop_if_cancelled(rep: Reporter) -> None:
    """Between deploy steps: a cancelled deploy (dialog closed) stops before the next step
    rather than starting an agent nobody is waiting for."""
    if rep.cancel_requested():
        raise Cancelled()


def coordinator_keypair(workspace: Path):
    """The workspace's CurveZMQ keypair: agents accept control only from its public key."""
    from agents.transport import CurveKeys

    with _WORKSPACE_LOCK:
        workspace.mkdir(parents=True, exist_ok=True)
        return CurveKeys.load_or_create(workspace / "coordinator.key")


def _remember_agent(workspace: Path, record: AgentRecord) -> None:
    """Merge the agent into ``<workspace>/agents.json`` (format edgeshard.agents), which
    ``edgeshard run --agents`` and profiling read."""
    from core.devices.local_cluster import AgentEntry, AgentsFile

    path = workspace / "agents.json"
    with _WORKSPACE_LOCK:
        entries: dict[str, AgentEntry] = {}
        if path.is_file():
            try:
                old = msgspec.json.decode(path.read_bytes(), type=AgentsFile)
                entries = {a.device: a for a in old.agents}
            except (msgspec.DecodeError, msgspec.ValidationError):
                entries = {}
        entries[record.device] = AgentEntry(device=record.device, control_address=record.control_address,
                                            public_key=record.public_key, pid=record.pid)
        data = AgentsFile(coordinator_key_file="coordinator.key",
                          agents=tuple(entries[d] for d in sorted(entries)))
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.format(msgspec.json.encode(data), indent=2))
        os.replace(tmp, path)


def _remember_deployment(workspace: Path, target: SshTarget, key_file: str | None, password: str | None,
                         remote_dir: str, opts: DeployOptions, record: AgentRecord) -> None:
    """How to reach this agent again from a later session (never the password itself)."""
    from core.devices.deployments import Deployment, remember_deployment

    auth = "key" if key_file else "password" if password is not None else "ssh-agent"
    remember_deployment(workspace, Deployment(
        device=target.device, address=target.address, ssh_port=target.port,
        ssh_user=target.user or os.environ.get("USER", "root"), auth=auth,
        key_file=os.path.abspath(os.path.expanduser(key_file)) if key_file else "", remote_dir=remote_dir,
        python=opts.python, pid=record.pid, log_path=record.log_path, control_port=record.control_port,
        bundle_stamp=record.bundle_stamp, deployed_at=time.time()))


def deploy_many(
    devices: Sequence,
    reporter_for: Callable[[str], Reporter] | None = None,
    max_parallel: int = 10,
    **kwargs,
) -> dict[str, DeployResult | DeployError]:
    """Deploy to every device in parallel; one failure never stops the others.

    Returns device → result or the typed error it ended with. Bugs (non-EdgeShard
    exceptions) are returned wrapped in a DeployError with their type, so one bad device
    cannot hide the others' results."""
    out: dict[str, DeployResult | DeployError] = {}

    def one(dev):
        name = dev.device if isinstance(dev, SshTarget) else dev.id
        rep = reporter_for(name) if reporter_for else NullReporter()
        try:
            return name, deploy_agent(rep, dev, **kwargs)
        except DeployError as err:
            return name, err
        except Exception as err:  # keep the others going; report what happened
            return name, DeployError(name, f"{type(err).__name__}: {err}")

    with cf.ThreadPoolExecutor(max_workers=max(1, min(max_parallel, len(devices)))) as pool:
        for name, res in pool.map(one, devices):
            out[name] = res
    return out


# ----------------------------------------------------------------- operations on agents
def _session_for(device, *, user=None, key_file=None, password=None, workspace=None, trust_new_host_keys=False,
                 use_agent=True, user_known=None) -> SshSession:
    ws = home_folder(workspace)
    if isinstance(device, SshTarget):
        target = device if not user else SshTarget(device.device, device.address, device.port, user)
    else:
        target = SshTarget(device=device.id, address=device.address, port=device.ssh_port or 22,
                           user=user or device.ssh_user)
    policy = HostKeyPolicy(workspace_known_hosts=ws / "known_hosts",
                           user_known_hosts=user_known if user_known is not None else user_known_hosts(),
                           trust_new=trust_new_host_keys)
    return connect(target, SshAuth(key_file=key_file, password=password, use_agent=use_agent), policy)


def status_of(device, remote_dir: str = DEFAULT_REMOTE_DIR, **conn) -> AgentState:
    with _session_for(device, **conn) as s:
        return agent_state(s, remote_dir_for(remote_dir, s.target.device))


def logs_of(device, lines: int = 200, remote_dir: str = DEFAULT_REMOTE_DIR, **conn) -> str:
    with _session_for(device, **conn) as s:
        return read_log(s, remote_dir_for(remote_dir, s.target.device), lines)


def stop(device, remote_dir: str = DEFAULT_REMOTE_DIR, **conn) -> bool:
    """Stop the device's agent; idempotent (False when none was running)."""
    with _session_for(device, **conn) as s:
        return stop_agent(s, remote_dir_for(remote_dir, s.target.device))


# ------------------------------------------------------------------ checkpoint upload
def upload_file_resumable(session: SshSession, local: Path, remote: str, reporter: Reporter | None = None,
                          chunk: int = 1 << 20) -> str:
    """Upload ``local`` to ``remote`` through ``remote.part``, continuing a partial upload;
    the sha256 of the finished remote file is checked before the rename. Returns 'uploaded',
    'resumed' or 'already there'."""
    rep = reporter or NullReporter()
    sftp = session.sftp
    size = local.stat().st_size
    digest = _sha256(local)
    _sftp_makedirs(sftp, posixpath.dirname(remote))
    try:
        st = sftp.stat(remote)
        if st.st_size == size and _remote_sha256(session, remote) == digest:
            rep.progress(size, size)
            return "already there"
    except FileNotFoundError:
        pass
    part = remote + ".part"
    try:
        offset = sftp.stat(part).st_size
    except FileNotFoundError:
        offset = 0
    if offset > size:
        offset = 0
    outcome = "resumed" if offset else "uploaded"
    try:
        with open(local, "rb") as src, sftp.open(part, "ab" if offset else "wb") as dst:
            dst.set_pipelined(True)
            src.seek(offset)
            done = offset
            rep.progress(done, size)
            while True:
                if rep.cancel_requested():
                    raise Cancelled()
                buf = src.read(chunk)
                if not buf:
                    break
                dst.write(buf)
                done += len(buf)
                rep.progress(done, size)
    except OSError as err:
        if "Failure" in str(err) or "space" in str(err).lower():
            raise NoDiskSpace(session.target.device, f"upload of {local.name} failed: {err}") from None
        raise
    if _remote_sha256(session, part) != digest:
        sftp.remove(part)
        raise DeployError(session.target.device, f"{remote}: checksum mismatch after upload; retry")
    sftp.posix_rename(part, remote)
    return outcome


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _remote_sha256(session: SshSession, path: str) -> str:
    rc, out, _ = session.run(f"sha256sum {_q(path)}", timeout_s=300)
    return out.split()[0] if rc == 0 and out else ""


def upload_stage_checkpoint(session: SshSession, model_dir: Path, start: int, end: int, remote_dir: str,
                            cache_dir: Path, reporter: Reporter | None = None) -> str:
    """Upload only units [start, end) of ``model_dir`` as one ``model.safetensors`` (plus
    config.json) into ``remote_dir``; returns the remote directory for ``LoadShard``."""
    from core.models.stage_checkpoint import write_stage_checkpoint

    rep = reporter or NullReporter()
    rep.status(f"packing units [{start}, {end})")
    local = write_stage_checkpoint(model_dir, start, end, cache_dir)
    rep.status(f"uploading units [{start}, {end}) ({(local / 'model.safetensors').stat().st_size / 2**20:.1f} MiB)")
    upload_file_resumable(session, local / "config.json", posixpath.join(remote_dir, "config.json"))
    upload_file_resumable(session, local / "model.safetensors", posixpath.join(remote_dir, "model.safetensors"), rep)
    return remote_dir


__all__ = [
    "AgentBundle", "AgentDidNotStart", "AgentNotDeployed", "AgentRecord", "AgentRunning", "AgentStopped",
    "AuthenticationFailed", "ConnectionRefused", "DeployOptions", "DeployResult", "HostKeyInfo",
    "HostKeyMismatch", "HostKeyPolicy", "HostUnreachable", "MissingPackages", "NoDiskSpace", "PythonTooOld",
    "SshAuth", "SshSession", "SshTarget", "UnknownHostKey", "build_bundle", "check_device", "connect",
    "deploy_agent", "deploy_many", "fingerprint", "logs_of", "probe_host_key", "status_of", "stop",
    "upload_file_resumable", "upload_stage_checkpoint",
]
