"""The deploy dialog's SSH functions and the devices screen's SSH agent control, over core.devices.deploy.

Kept apart from the views so they hold no SSH code and this is the one place that
follows core.devices.deploy's API. The dialog's contract (``DeployFunctions`` and the values
it passes) lives here too, so the dialog imports this module and never the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

from core.devices import deploy
from core.reporting import Reporter


@dataclass(frozen=True)
class Credentials:
    user: str
    key_file: str = ""
    password: str = ""


@dataclass(frozen=True)
class HostKeyProbe:
    device: str
    key_type: str
    fingerprint: str
    """``SHA256:…`` as OpenSSH prints it."""
    known: bool
    """Listed in known_hosts with this very key."""
    changed: bool = False
    """Listed in known_hosts with a *different* key."""


class DeployFunctions(Protocol):
    def probe_host_key(self, reporter: Reporter, record: Any, credentials: Credentials) -> HostKeyProbe: ...

    def deploy_agent(self, reporter: Reporter, record: Any, credentials: Credentials, trusted: HostKeyProbe) -> str: ...


class CoreDeployFunctions:
    def probe_host_key(self, reporter: Reporter, record, credentials: Credentials) -> HostKeyProbe:
        reporter.status("checking host key")
        info = deploy.probe_host_key(record.address, record.ssh_port)
        return HostKeyProbe(device=record.id, key_type=info.key_type, fingerprint=info.fingerprint,
                            known=info.known, changed=info.changed)

    def deploy_agent(self, reporter: Reporter, record, credentials: Credentials, trusted: HostKeyProbe) -> str:
        device = replace(record, ssh_user=credentials.user or record.ssh_user).to_device()
        result = deploy.deploy_agent(
            reporter, device, user=credentials.user or None, key_file=credentials.key_file or None,
            password=credentials.password or None, trusted_fingerprint=trusted.fingerprint,
        )
        return result.summary


class SshAgentControl:
    """Start (deploy again: idempotent), stop and read the log of one device's agent over SSH.

    Made from a deployment the workspace remembers, so it works for agents deployed in an
    earlier session too. The host key is verified on every connection (known_hosts);
    a password-deployed device needs its password again for each action (``needs_password``):
    the GUI asks, and runs that one action on ``with_password``'s copy; this control never
    holds it."""

    def __init__(self, record, credentials: Credentials, remote_dir: str = deploy.DEFAULT_REMOTE_DIR,
                 python: str = "python3", password_auth: bool = False) -> None:
        self.record = record
        self.credentials = credentials
        self.remote_dir = remote_dir
        self.python = python
        self.password_auth = password_auth

    @classmethod
    def from_deployment(cls, dep, record, password: str = "") -> "SshAgentControl":
        return cls(record, Credentials(user=dep.ssh_user, key_file=dep.key_file, password=password),
                   remote_dir=dep.remote_dir, python=dep.python, password_auth=dep.auth == "password")

    def needs_password(self) -> bool:
        return self.password_auth and not self.credentials.password

    def with_password(self, password: str) -> "SshAgentControl":
        """A copy for one action (dropped when it ends); the kept control has no password."""
        return SshAgentControl(self.record, replace(self.credentials, password=password), self.remote_dir,
                               self.python, self.password_auth)

    def _conn(self) -> dict:
        c = self.credentials
        return dict(user=c.user or None, key_file=c.key_file or None, password=c.password or None)

    def _device(self):
        return replace(self.record, ssh_user=self.credentials.user or self.record.ssh_user).to_device()

    def start_agent(self, reporter: Reporter, device: str):
        opts = deploy.DeployOptions(python=self.python, remote_dir=self.remote_dir)
        result = deploy.deploy_agent(reporter, self._device(), options=opts, **self._conn())
        return replace(self.record, status="running", detail=result.summary)

    def stop_agent(self, reporter: Reporter, device: str):
        reporter.status(f"stopping the agent on {device}")
        was_running = deploy.stop(self._device(), remote_dir=self.remote_dir, **self._conn())
        return replace(self.record, status="agent deployed",
                       detail="agent stopped" if was_running else "no agent was running")

    def agent_log(self, reporter: Reporter, device: str) -> list[str]:
        return deploy.logs_of(self._device(), remote_dir=self.remote_dir, **self._conn()).splitlines()
