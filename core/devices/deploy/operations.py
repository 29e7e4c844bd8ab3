"""What callers do with an agent on a device: deploy it (one or many in parallel), ask its
state, read its log, stop it. Each opens its own verified SSH session."""

from __future__ import annotations

import concurrent.futures as cf
import os
import posixpath
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import msgspec

from core.devices.deploy.bundle import AgentBundle, build_bundle, upload_bundle
from core.devices.deploy.errors import AgentDidNotStart
from core.devices.deploy.host_keys import HostKeyInfo, HostKeyPolicy, user_known_hosts
from core.devices.deploy.remote import (DEFAULT_REMOTE_DIR, AgentRecord, AgentRunning, AgentState, DeployOptions, DeployResult,
                                        agent_state, check_device, read_log, remote_abs, remote_dir_for,
                                        start_agent, stop_agent, tail_log, wait_until_answers, write_record)
from core.devices.deploy.ssh import SshAuth, SshSession, SshTarget, connect
from core.devices.deploy.workspace import WORKSPACE_LOCK, coordinator_keypair
from core.errors import DeployError
from core.paths import home_folder
from core.reporting import Cancelled, NullReporter, Reporter


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
        base = remote_abs(s, s.sftp.normalize("."), opts.remote_dir)
        current = agent_state(s, base)
        if isinstance(current, AgentRunning) and current.record.bundle_stamp == bundle.stamp \
                and current.record.public_key:
            rep.status("agent already running this version; checking that it answers")
            rep.progress(5, steps)
            try:
                wait_until_answers(current.record, coordinator_keys)
            except Exception as err:
                raise AgentDidNotStart(target.device, f"the running agent (pid {current.record.pid}) does not "
                                       f"answer: {err}", tail_log(s, current.record.log_path)) from None
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
        upload_bundle(s, bundle, bundle_dir, NullReporter())
        action = "started"
        if isinstance(current, AgentRunning):
            rep.status(f"stopping the running agent ({current.record.bundle_stamp})")
            stop_agent(s, base)
            action = "upgraded"
        _stop_if_cancelled(rep)
        rep.status("starting the agent")
        rep.progress(3, steps)
        record = start_agent(s, opts, bundle, bundle_dir, base, coordinator_keys.public, target.address, rep)
        write_record(s, base, record)
        rep.status(f"agent up (pid {record.pid}); checking that it answers")
        rep.progress(4, steps)
        try:
            wait_until_answers(record, coordinator_keys)
        except Exception as err:
            raise AgentDidNotStart(target.device, f"the agent does not answer on {record.control_address}: {err}",
                                   tail_log(s, record.log_path)) from None
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


def _remember_agent(workspace: Path, record: AgentRecord) -> None:
    """Merge the agent into ``<workspace>/agents.json`` (format edgeshard.agents), which
    ``edgeshard run --agents`` and profiling read."""
    from core.devices.local_cluster import AgentEntry, AgentsFile

    path = workspace / "agents.json"
    with WORKSPACE_LOCK:
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
