"""SSH connections: open, verify the host key before any credential is sent, authenticate;
then run commands and use SFTP through one ``SshSession``."""

from __future__ import annotations

import io
import os
import posixpath
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import paramiko

from core.devices.deploy.errors import AuthenticationFailed, ConnectionRefused, HostUnreachable
from core.devices.deploy.host_keys import HostKeyInfo, HostKeyMismatch, HostKeyPolicy, user_known_hosts
from core.devices.deployments import default_workspace
from core.errors import DeployError


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


def sftp_makedirs(sftp: paramiko.SFTPClient, path: str) -> None:
    parts = path.strip("/").split("/")
    cur = "/" if path.startswith("/") else ""
    for part in parts:
        cur = posixpath.join(cur, part) if cur else part
        try:
            sftp.stat(cur)
        except FileNotFoundError:
            sftp.mkdir(cur)
