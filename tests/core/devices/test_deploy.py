"""Deployment over real SSH to testbed namespaces (real sshd, real host keys, real agents)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import agents
from core.devices import deploy
from core.devices import testbed as tb
from core.devices.deploy import (
    AgentNotDeployed,
    AgentRunning,
    AgentStopped,
    DeployOptions,
    SshTarget,
)
from core.errors import DeployError
from core.reporting import RecordingReporter

from tests.core.conftest import SESSION_DEVICES, needs_root

D1, D2, D3 = SESSION_DEVICES

pytestmark = [pytest.mark.netns, needs_root]

NO_USER_KNOWN = Path("/nonexistent")


def _ssh_keygen_fingerprint(pub: str) -> str:
    out = subprocess.run(["ssh-keygen", "-lf", pub], capture_output=True, text=True, check=True).stdout
    return out.split()[1]


@pytest.fixture(scope="module")
def small_testbed(tmp_path_factory):
    """One throw-away device for tests that break it (changed host key)."""
    root = tmp_path_factory.mktemp("hk")
    state = tb.testbed_up(1, name="eshk", subnet="10.83.0.0/24", state_root=root, advertise_mdns=False)
    yield state, root
    tb.testbed_down("eshk", state_root=root)
    assert tb.leftovers("eshk") == []


def _target(state, i=0, user=None):
    d = state.devices[i]
    return SshTarget(d.name, d.address, d.ssh_port, user or state.ssh_user)


def _quick_opts(tmp_path, **kw):
    return DeployOptions(python=sys.executable, remote_dir=str(tmp_path / "remote" / "{device}"), **kw)


# --------------------------------------------------------------------------- host keys
def test_unknown_host_key_is_refused_with_its_sha256_fingerprint(small_testbed, tmp_path):
    state, _ = small_testbed
    with pytest.raises(deploy.UnknownHostKey) as err:
        deploy.deploy_agent(None, _target(state), key_file=state.operator_key, workspace=tmp_path,
                            options=_quick_opts(tmp_path), use_agent=False, user_known=NO_USER_KNOWN)
    expected = _ssh_keygen_fingerprint(state.devices[0].host_key_path + ".pub")
    assert err.value.info.fingerprint == expected
    assert expected in str(err.value)
    assert not (tmp_path / "known_hosts").exists()


def test_accepted_host_key_is_recorded_and_then_known(small_testbed, tmp_path):
    state, _ = small_testbed
    d = state.devices[0]
    asked = []
    policy = deploy.HostKeyPolicy(workspace_known_hosts=tmp_path / "known_hosts", user_known_hosts=NO_USER_KNOWN,
                                  trust_new=lambda info: asked.append(info.fingerprint) or True)
    with deploy.connect(_target(state), deploy.SshAuth(key_file=state.operator_key, use_agent=False), policy) as s:
        assert s.run("echo hi")[1].strip() == "hi"
    assert asked == [_ssh_keygen_fingerprint(d.host_key_path + ".pub")]
    probe = deploy.probe_host_key(d.address, 22, workspace_known_hosts=tmp_path / "known_hosts",
                                  user_known=NO_USER_KNOWN)
    assert probe.known and not probe.changed


def test_changed_host_key_is_refused_even_when_new_keys_are_trusted(small_testbed, tmp_path):
    state, root = small_testbed
    auth = deploy.SshAuth(key_file=state.operator_key, use_agent=False)
    policy = deploy.HostKeyPolicy(workspace_known_hosts=tmp_path / "known_hosts", user_known_hosts=NO_USER_KNOWN,
                                  trust_new=True)
    deploy.connect(_target(state), auth, policy).close()
    state = tb.reinstall_device(state.devices[0].name, name="eshk", state_root=root)
    with pytest.raises(deploy.HostKeyMismatch) as err:
        deploy.connect(_target(state), auth, policy)
    assert "HOST KEY CHANGED" in str(err.value) and "ssh-keygen -R" in str(err.value)
    assert err.value.info.fingerprint == _ssh_keygen_fingerprint(state.devices[0].host_key_path + ".pub")
    probe = deploy.probe_host_key(state.devices[0].address, workspace_known_hosts=tmp_path / "known_hosts",
                                  user_known=NO_USER_KNOWN)
    assert probe.changed and not probe.known


# ------------------------------------------------------------------------- credentials
def test_wrong_key_is_an_authentication_failure(small_testbed, tmp_path):
    state, _ = small_testbed
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    policy = deploy.HostKeyPolicy(workspace_known_hosts=tmp_path / "kh", user_known_hosts=NO_USER_KNOWN, trust_new=True)
    with pytest.raises(deploy.AuthenticationFailed, match="rejected key"):
        deploy.connect(_target(state), deploy.SshAuth(key_file=str(other), use_agent=False), policy)


def test_password_is_refused_by_a_key_only_server(small_testbed, tmp_path):
    state, _ = small_testbed
    policy = deploy.HostKeyPolicy(workspace_known_hosts=tmp_path / "kh", user_known_hosts=NO_USER_KNOWN, trust_new=True)
    with pytest.raises(deploy.AuthenticationFailed, match="password"):
        deploy.connect(_target(state), deploy.SshAuth(password="hunter2", use_agent=False), policy)
    assert "hunter2" not in (tmp_path / "kh").read_text()


def test_refused_connection_and_unreachable_host_are_told_apart(small_testbed, tmp_path):
    state, _ = small_testbed
    policy = deploy.HostKeyPolicy(workspace_known_hosts=tmp_path / "kh", user_known_hosts=NO_USER_KNOWN)
    auth = deploy.SshAuth(key_file=state.operator_key, use_agent=False)
    d = state.devices[0]
    with pytest.raises(deploy.ConnectionRefused, match="refused"):
        deploy.connect(SshTarget(d.name, d.address, 2222, "root"), auth, policy)
    with pytest.raises(deploy.HostUnreachable):  # nobody holds .77 on the testbed subnet
        deploy.connect(SshTarget("ghost", "10.83.0.77", 22, "root"), auth, policy, timeout_s=2)


# -------------------------------------------------------------------- device checks
def test_missing_python_packages_are_reported_with_the_pip_command(small_testbed, tmp_path):
    state, _ = small_testbed
    venv = tmp_path / "bare-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    (tmp_path / "known_hosts").write_text("\n".join(state.known_hosts_lines()) + "\n")
    opts = DeployOptions(python=str(venv / "bin" / "python"), remote_dir=str(tmp_path / "r"))
    with pytest.raises(deploy.MissingPackages) as err:
        deploy.deploy_agent(None, _target(state), key_file=state.operator_key, workspace=tmp_path, options=opts,
                            use_agent=False, user_known=NO_USER_KNOWN)
    assert err.value.missing == {"torch": "torch", "transformers": "transformers", "safetensors": "safetensors",
                                 "zmq": "pyzmq", "msgspec": "msgspec", "zeroconf": "zeroconf"}
    assert "-m pip install msgspec pyzmq safetensors torch transformers zeroconf" in str(err.value)


def test_full_disk_is_reported_before_uploading(small_testbed, tmp_path):
    state = tb.testbed_status("eshk", small_testbed[1])  # current sshd pid (another test restarts it)
    small = tmp_path / "small-disk"
    small.mkdir()
    # the device's own mount namespace (its sshd's) gets a 2 MiB disk at that path
    in_device = ["nsenter", "-t", str(state.devices[0].sshd_pid), "-m"]
    subprocess.run([*in_device, "mount", "-t", "tmpfs", "-o", "size=2m", "edgeshard-test", str(small)], check=True)
    try:
        (tmp_path / "known_hosts").write_text("\n".join(state.known_hosts_lines()) + "\n")
        opts = DeployOptions(python=sys.executable, remote_dir=str(small / "agent"))
        with pytest.raises(deploy.NoDiskSpace, match="MiB free"):
            deploy.deploy_agent(None, _target(state), key_file=state.operator_key, workspace=tmp_path,
                                options=opts, use_agent=False, user_known=NO_USER_KNOWN)
    finally:
        subprocess.run([*in_device, "umount", str(small)], check=True)


# ------------------------------------------------------------------ the agent's life
def test_deployed_agent_runs_detached_and_answers_over_its_control_socket(deployed):
    res = deployed.results[D1]
    rec = res.record
    assert res.action in ("started", "already running")
    # the SSH session is closed: the agent lives on in the device's namespace
    pids = subprocess.run(["ip", "netns", "pids", f"es-{D1}"], capture_output=True, text=True).stdout.split()
    assert str(rec.pid) in pids
    assert rec.log_path.startswith(str(deployed.remote_root / D1))
    from agents.transport import CurveKeys
    from core.runs.coordinator import AgentEndpoint, Coordinator

    keys = CurveKeys.load(deployed.workspace / "coordinator.key")
    with Coordinator([AgentEndpoint(D1, rec.control_address, rec.public_key)], keys) as coord:
        assert coord.status()[D1].device == D1
    # the three parallel deploys all landed in one agents.json, readable with one key
    from core.devices.local_cluster import load_agents_file

    endpoints, _ = load_agents_file(deployed.workspace / "agents.json")
    assert {e.device for e in endpoints} >= {D1, D2, D3}
    assert rec.control_address in {e.control_address for e in endpoints}


def test_redeploy_is_idempotent_and_status_logs_stop_work(deployed):
    rep = RecordingReporter()
    target = deployed.target(D2)
    first = deployed.results[D2].record
    again = deploy.deploy_agent(rep, target, key_file=deployed.testbed.operator_key, workspace=deployed.workspace,
                                options=deployed.options(), use_agent=False, user_known=NO_USER_KNOWN)
    assert again.action == "already running" and again.record.pid == first.pid
    assert rep.progresses[-1] == (6, 6) and any("already running" in s for s in rep.statuses)
    state = deploy.status_of(target, remote_dir=deployed.options().remote_dir, **deployed.conn())
    assert isinstance(state, AgentRunning) and state.record.pid == first.pid
    assert f"EDGESHARD-AGENT-READY device={D2}" in deploy.logs_of(target, remote_dir=deployed.options().remote_dir,
                                                                   **deployed.conn())
    assert deploy.stop(target, remote_dir=deployed.options().remote_dir, **deployed.conn()) is True
    assert not Path(f"/proc/{first.pid}").exists() or "Z" in Path(f"/proc/{first.pid}/stat").read_text().split()[2]
    assert deploy.stop(target, remote_dir=deployed.options().remote_dir, **deployed.conn()) is False
    assert isinstance(deploy.status_of(target, remote_dir=deployed.options().remote_dir, **deployed.conn()),
                      AgentStopped)
    restarted = deploy.deploy_agent(None, target, key_file=deployed.testbed.operator_key,
                                    workspace=deployed.workspace, options=deployed.options(), use_agent=False,
                                    user_known=NO_USER_KNOWN)
    assert restarted.action == "started" and restarted.record.pid != first.pid
    deployed.results[D2] = restarted


def test_status_of_a_device_without_agent_says_not_deployed(deployed, tmp_path):
    state = deploy.status_of(deployed.target(D3), remote_dir=str(tmp_path / "nothing"), **deployed.conn())
    assert isinstance(state, AgentNotDeployed)


def test_upgrade_replaces_an_agent_of_another_version(deployed, tmp_path):
    """Device 3 runs the session's agent; a changed bundle (a new version) replaces it in place."""
    pkg = tmp_path / "agents"
    shutil.copytree(Path(agents.__file__).parent, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    (pkg / "__init__.py").write_text((pkg / "__init__.py").read_text() + "\n# patched build\n")
    v1, v2 = deploy.build_bundle(), deploy.build_bundle(pkg)
    assert v1.stamp != v2.stamp
    old = deployed.results[D3].record
    assert old.bundle_stamp == v1.stamp
    rep = RecordingReporter()
    new = deploy.deploy_agent(rep, deployed.target(D3), bundle=v2, key_file=deployed.testbed.operator_key,
                              workspace=deployed.workspace, options=deployed.options(), use_agent=False,
                              user_known=NO_USER_KNOWN)
    deployed.results[D3] = new
    assert new.action == "upgraded" and new.record.bundle_stamp == v2.stamp
    assert new.record.pid != old.pid and not _alive(old.pid)
    assert new.record.control_port == old.control_port
    assert any("stopping the running agent" in s for s in rep.statuses)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_agent_that_cannot_start_is_reported_with_its_log_tail(deployed, tmp_path):
    """Its control port is taken on the device: the agent exits, the error shows why."""
    blocker = subprocess.Popen(["ip", "netns", "exec", f"es-{D3}", sys.executable, "-c",
                                "import socket,sys; s=socket.socket(); s.bind(('0.0.0.0', 47020)); s.listen();"
                                " print('ok', flush=True); sys.stdin.read()"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert blocker.stdout.readline().strip() == "ok"
        opts = DeployOptions(python=sys.executable, remote_dir=str(tmp_path / "{device}"), control_port=47020,
                             data_port=47021, announce=False)
        with pytest.raises(deploy.AgentDidNotStart) as err:
            deploy.deploy_agent(None, deployed.target(D3), key_file=deployed.testbed.operator_key,
                                workspace=deployed.workspace, options=opts, use_agent=False,
                                user_known=NO_USER_KNOWN)
        assert "cannot listen" in err.value.log_tail
        assert "agent log (tail)" in str(err.value)
    finally:
        blocker.stdin.close()
        blocker.wait(timeout=10)


def test_parallel_deploy_reports_each_device_and_one_failure_does_not_stop_the_others(deployed):
    good = deployed.target(D1)
    bad = SshTarget("nosshd", deployed.testbed.device(D1).address, 2222, "root")
    reporters: dict[str, RecordingReporter] = {}

    def reporter_for(name):
        return reporters.setdefault(name, RecordingReporter())

    results = deploy.deploy_many([bad, good], reporter_for, key_file=deployed.testbed.operator_key,
                                 workspace=deployed.workspace, options=deployed.options(), use_agent=False,
                                 user_known=NO_USER_KNOWN)
    assert isinstance(results["nosshd"], deploy.ConnectionRefused)
    assert results[D1].action == "already running"
    assert reporters[D1].statuses and reporters["nosshd"].statuses


def test_errors_are_deploy_errors_with_a_hint():
    err = deploy.MissingPackages("dev", "python3", {"zmq": "pyzmq"})
    assert isinstance(err, DeployError) and "pip install pyzmq" in str(err) and err.hint


# ------------------------------------------------------------------- stage checkpoints
class _CancelAfter(RecordingReporter):
    def __init__(self, n):
        super().__init__()
        self.n = n

    def cancel_requested(self):
        return len(self.progresses) > self.n


def test_stage_upload_carries_only_its_units_and_resumes_after_an_interruption(deployed, tmp_path):
    import hashlib

    import transformers
    from safetensors import safe_open

    from core.reporting import Cancelled
    from core.models.stage_checkpoint import write_stage_checkpoint

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256)
    model_dir = tmp_path / "model"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(model_dir)
    stage = write_stage_checkpoint(model_dir, 2, 4, tmp_path / "cache")  # blocks 1 and 2
    with safe_open(str(stage / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {n.split(".")[2] for n in names if ".layers." in n} == {"1", "2"}
    assert not any("embed_tokens" in n or n.startswith("lm_head") for n in names)
    assert "model.norm.weight" in names

    remote = tmp_path / "remote-model" / "model.safetensors"
    policy = deploy.HostKeyPolicy(workspace_known_hosts=deployed.workspace / "known_hosts", user_known_hosts=None)
    auth = deploy.SshAuth(key_file=deployed.testbed.operator_key, use_agent=False)
    local = stage / "model.safetensors"
    with deploy.connect(deployed.target(D1), auth, policy) as ssh:
        with pytest.raises(Cancelled):
            deploy.upload_file_resumable(ssh, local, str(remote), _CancelAfter(3), chunk=8192)
    part = Path(str(remote) + ".part")
    partial = part.stat().st_size
    assert 0 < partial < local.stat().st_size and not remote.exists()
    rep = RecordingReporter()
    with deploy.connect(deployed.target(D1), auth, policy) as ssh:
        assert deploy.upload_file_resumable(ssh, local, str(remote), rep, chunk=8192) == "resumed"
        assert rep.progresses[0] == (partial, local.stat().st_size)  # continued where it stopped
        assert deploy.upload_file_resumable(ssh, local, str(remote)) == "already there"
    assert hashlib.sha256(remote.read_bytes()).digest() == hashlib.sha256(local.read_bytes()).digest()
    assert rep.progresses[-1] == (local.stat().st_size, local.stat().st_size)


# ----------------------------------------------------------------------------- the CLI
def test_cli_deploy_refuses_an_unknown_host_key_and_prints_its_fingerprint(small_testbed, tmp_path, capsys):
    from core.cli import main

    state = tb.testbed_status("eshk", small_testbed[1])
    d = state.devices[0]
    rc = main(["deploy", f"{d.name}=root@{d.address}", "--key", state.operator_key, "--no-ssh-agent",
               "--workspace", str(tmp_path), "--python", sys.executable])
    out = capsys.readouterr().out
    assert rc == 1
    assert _ssh_keygen_fingerprint(d.host_key_path + ".pub") in out and "--trust-new-host-keys" in out


def test_cli_agents_status_and_logs_of_a_deployed_agent(deployed, capsys):
    from core.cli import main

    d = deployed.testbed.device(D1)
    common = [f"{D1}=root@{d.address}", "--key", deployed.testbed.operator_key, "--no-ssh-agent",
              "--workspace", str(deployed.workspace), "--remote-dir", deployed.options().remote_dir]
    assert main(["agents", "status", *common]) == 0
    assert f"{D1}: running pid {deployed.results[D1].record.pid}" in capsys.readouterr().out
    assert main(["agents", "logs", "-n", "5", *common]) == 0
    assert "EDGESHARD-AGENT-READY" in capsys.readouterr().out


def test_ssh_agent_keys_are_used_when_no_key_file_is_given(small_testbed, tmp_path, monkeypatch):
    state = tb.testbed_status("eshk", small_testbed[1])
    sock = tmp_path / "agent.sock"
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL)
    try:
        for _ in range(100):
            if sock.exists():
                break
            time.sleep(0.05)
        env = dict(os.environ, SSH_AUTH_SOCK=str(sock))
        subprocess.run(["ssh-add", state.operator_key], env=env, check=True, capture_output=True)
        monkeypatch.setenv("SSH_AUTH_SOCK", str(sock))
        policy = deploy.HostKeyPolicy(workspace_known_hosts=tmp_path / "kh", user_known_hosts=NO_USER_KNOWN,
                                      trust_new=True)
        with deploy.connect(_target(state), deploy.SshAuth(use_agent=True), policy) as s:
            assert s.run("id -u")[1].strip() == "0"
    finally:
        agent.terminate()
        agent.wait(timeout=10)
