"""The workspace's memory of where agents were deployed (``<workspace>/deployments.json``).

A restarted studio or CLI reads it to stop, restart or read the log of an agent deployed
in an earlier session: it says how to reach the device again (address, port, user, how
to authenticate, the key file's path) and what the deploy left there (remote directory,
pid, log path). It holds no secret: a password is asked for again, and the host key is
checked against known_hosts as on every connection. Kept free of paramiko, so reading
it at the studio's start costs nothing.
"""

from __future__ import annotations

import threading
from pathlib import Path

import msgspec

from core import formats
from core.errors import FormatError

DEPLOYMENTS_FORMAT = "edgeshard.deployments"
DEPLOYMENTS_VERSION = 1
AUTH_METHODS = ("key", "password", "ssh-agent")
_LOCK = threading.Lock()
"""Parallel deploys write the same file: one writer at a time."""


class Deployment(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    device: str
    address: str
    ssh_port: int = 22
    ssh_user: str = ""
    auth: str = "ssh-agent"
    """How the deploy signed in: key, password (asked for again, never stored) or ssh-agent."""
    key_file: str = ""
    remote_dir: str
    """The agent's directory on the device (absolute)."""
    python: str = "python3"
    pid: int = 0
    log_path: str = ""
    control_port: int = 0
    bundle_stamp: str = ""
    deployed_at: float = 0.0


class DeploymentsFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    format: str = DEPLOYMENTS_FORMAT
    version: int = DEPLOYMENTS_VERSION
    deployments: tuple[Deployment, ...] = ()


formats.register_format(DEPLOYMENTS_FORMAT, DeploymentsFile, DEPLOYMENTS_VERSION)


def default_workspace() -> Path:
    """Where deploys keep the coordinator key, known_hosts, agents.json and this file:
    ``$EDGESHARD_HOME``, else ``~/.edgeshard`` (core.paths)."""
    from core.paths import edgeshard_home

    return edgeshard_home()


def deployments_path(workspace: Path) -> Path:
    return Path(workspace) / "deployments.json"


def load_deployments(workspace: Path) -> dict[str, Deployment]:
    """Device → its last deployment; empty when nothing was deployed from this workspace.
    A damaged file is a ``FormatError`` naming it."""
    path = deployments_path(workspace)
    if not path.is_file():
        return {}
    return {d.device: d for d in formats.load(path, DeploymentsFile).deployments}


def remember_deployment(workspace: Path, deployment: Deployment) -> None:
    """Add or replace the device's entry (atomic write)."""
    if deployment.auth not in AUTH_METHODS:
        raise ValueError(f"auth must be one of {AUTH_METHODS}, got {deployment.auth!r}")
    with _LOCK:
        try:
            known = load_deployments(workspace)
        except FormatError:
            known = {}  # a damaged file is replaced by what we know now
        known[deployment.device] = deployment
        formats.save(deployments_path(workspace),
                     DeploymentsFile(deployments=tuple(known[d] for d in sorted(known))))
