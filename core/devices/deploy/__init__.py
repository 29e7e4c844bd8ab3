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

Modules by job: ``errors``; ``host_keys`` (+ ``host_key_types``) and ``ssh`` (verified
sessions); ``bundle`` (what ships); ``remote`` (commands on the device, its agent record);
``operations`` (deploy, state, logs, stop); ``upload`` (checkpoints); ``workspace`` (what a
deploy keeps locally). Callers use this package's names: ``from core.devices import deploy``.
"""

from __future__ import annotations

from core.devices.deploy.bundle import AgentBundle, build_bundle
from core.devices.deploy.errors import (AgentDidNotStart, AuthenticationFailed, ConnectionRefused, HostUnreachable,
                                        MissingPackages, NoDiskSpace, PythonTooOld)
from core.devices.deploy.host_keys import (HostKeyInfo, HostKeyMismatch, HostKeyPolicy, UnknownHostKey, fingerprint,
                                           known_hosts_name)
from core.devices.deploy.operations import deploy_agent, deploy_many, logs_of, status_of, stop
from core.devices.deploy.remote import (DEFAULT_CONTROL_PORT, DEFAULT_DATA_PORT, DEFAULT_REMOTE_DIR, AgentNotDeployed,
                                        AgentRecord, AgentRunning, AgentState, AgentStopped, DeployOptions,
                                        DeployResult, agent_state, check_device, read_log, read_record, stop_agent)
from core.devices.deploy.ssh import SshAuth, SshSession, SshTarget, connect, probe_host_key
from core.devices.deploy.upload import upload_file_resumable, upload_stage_checkpoint
from core.devices.deploy.workspace import coordinator_keypair
from core.devices.deployments import default_workspace

__all__ = [
    "DEFAULT_CONTROL_PORT", "DEFAULT_DATA_PORT", "DEFAULT_REMOTE_DIR",
    "AgentBundle", "AgentDidNotStart", "AgentNotDeployed", "AgentRecord", "AgentRunning", "AgentState",
    "AgentStopped", "AuthenticationFailed", "ConnectionRefused", "DeployOptions", "DeployResult", "HostKeyInfo",
    "HostKeyMismatch", "HostKeyPolicy", "HostUnreachable", "MissingPackages", "NoDiskSpace", "PythonTooOld",
    "SshAuth", "SshSession", "SshTarget", "UnknownHostKey", "agent_state", "build_bundle", "check_device",
    "connect", "coordinator_keypair", "default_workspace", "deploy_agent", "deploy_many", "fingerprint",
    "known_hosts_name", "logs_of", "probe_host_key", "read_log", "read_record", "status_of", "stop", "stop_agent",
    "upload_file_resumable", "upload_stage_checkpoint",
]
