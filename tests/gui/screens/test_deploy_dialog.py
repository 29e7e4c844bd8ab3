"""The deploy dialog: unknown hosts show their fingerprint and need consent; errors are plain."""

from __future__ import annotations

import threading
import time

import pytest
from PySide6.QtWidgets import QMessageBox

from core.errors import DeployError
from gui.connection.deploy_adapter import Credentials, HostKeyProbe
from gui.screens.deploy_dialog import DeployDialog
from core.devices.registry import DeviceRecord

FP = "SHA256:nThbg6kXUpJWGl7E1IGOCspRomTxdCARLviKw6E5SY8"


class RecordingDeploy:
    """Deploy functions that record every call (and its thread) instead of opening SSH."""

    def __init__(self, known: set[str] = frozenset(), changed: set[str] = frozenset(), fail: set[str] = frozenset()):
        self.known, self.changed, self.fail = known, changed, fail
        self.deployed: list[tuple[str, Credentials, str]] = []
        self.threads: list[threading.Thread] = []

    def probe_host_key(self, reporter, record, credentials):
        self.threads.append(threading.current_thread())
        return HostKeyProbe(device=record.id, key_type="ssh-ed25519", fingerprint=FP,
                            known=record.id in self.known, changed=record.id in self.changed)

    def deploy_agent(self, reporter, record, credentials, trusted):
        self.threads.append(threading.current_thread())
        for i, step in enumerate(("uploading agent", "installing", "starting agent")):
            reporter.status(step)
            reporter.progress(i + 1, 3)
        if record.id in self.fail:
            raise DeployError(record.id, "python3 was not found on the device", hint="install python3 (>= 3.10)")
        self.deployed.append((record.id, credentials, trusted.fingerprint))
        return "agent running on port 7000"


class StuckDeploy(RecordingDeploy):
    """A deploy stuck in the network: it ignores cancellation until ``release`` is set."""

    def __init__(self):
        super().__init__(known={"slow"})
        self.entered, self.release = threading.Event(), threading.Event()

    def deploy_agent(self, reporter, record, credentials, trusted):
        self.entered.set()
        self.release.wait(20)
        reporter.status("late status")
        return "late result"


def records(*names):
    return [DeviceRecord(id=n, address=f"10.0.0.{i + 2}", ssh_user="edge") for i, n in enumerate(names)]


@pytest.fixture
def make_dialog(qtbot):
    made = []

    def make(fns, *names):
        dlg = DeployDialog(records(*names), functions=fns)
        qtbot.addWidget(dlg)
        dlg.show()
        made.append(dlg)
        return dlg

    yield make
    for d in made:
        d.done(0)


def test_unknown_host_shows_its_fingerprint_and_deploys_only_after_trust(qtbot, make_dialog):
    fns = RecordingDeploy()
    dlg = make_dialog(fns, "jetson")
    with qtbot.waitSignal(dlg.host_key_confirmation_requested, timeout=30_000):
        dlg.deploy_button.click()
    box = dlg.findChild(QMessageBox, "hostKey-jetson")
    assert FP in box.informativeText() and "ssh-ed25519" in box.informativeText()
    assert dlg.step_text("jetson") == "confirm host key" and fns.deployed == []
    with qtbot.waitSignal(dlg.device_deployed, timeout=30_000):
        box.buttons()[0].click()  # "Trust and deploy"
    assert fns.deployed == [("jetson", Credentials(user="edge", key_file=""), FP)]
    assert dlg.step_text("jetson") == "done" and dlg.detail_text("jetson") == "agent running on port 7000"
    assert all(t is not threading.main_thread() for t in fns.threads)


def test_skipping_an_unknown_host_installs_nothing(qtbot, make_dialog):
    fns = RecordingDeploy()
    dlg = make_dialog(fns, "jetson")
    with qtbot.waitSignal(dlg.host_key_confirmation_requested, timeout=30_000):
        dlg.deploy_button.click()
    dlg.confirm_host_key("jetson", False)
    assert fns.deployed == [] and dlg.step_text("jetson") == "skipped"


def test_known_hosts_deploy_without_asking_and_each_row_shows_its_own_error(qtbot, make_dialog):
    fns = RecordingDeploy(known={"a", "b"}, fail={"b"})
    dlg = make_dialog(fns, "a", "b")
    with qtbot.waitSignal(dlg.device_failed, timeout=30_000):
        dlg.deploy_button.click()
    qtbot.waitUntil(lambda: dlg.step_text("a") == "done", timeout=30_000)
    assert dlg.step_text("b") == "failed"
    assert "python3 was not found" in dlg.detail_text("b") and "install python3" in dlg.detail_text("b")
    assert "Traceback" not in dlg.detail_text("b")
    assert "1 of 2 device(s) deployed" in dlg.summary.text()


def test_a_changed_host_key_is_refused_with_what_to_do(qtbot, make_dialog):
    fns = RecordingDeploy(changed={"a"})
    dlg = make_dialog(fns, "a")
    with qtbot.waitSignal(dlg.device_failed, timeout=30_000):
        dlg.deploy_button.click()
    assert "CHANGED" in dlg.detail_text("a") and "ssh-keygen -R" in dlg.detail_text("a")
    assert fns.deployed == []


def test_closing_during_a_deploy_returns_at_once_and_ignores_the_late_result(qtbot, make_dialog):
    fns = StuckDeploy()
    dlg = make_dialog(fns, "slow")
    deployed, failed = [], []
    dlg.device_deployed.connect(lambda d, _m: deployed.append(d))
    dlg.device_failed.connect(lambda d, _m: failed.append(d))
    dlg.deploy_button.click()
    qtbot.waitUntil(fns.entered.is_set, timeout=30_000)
    t0 = time.monotonic()
    dlg.reject()
    blocked_s = time.monotonic() - t0
    try:
        # the worker is held until release is set: a close that joined it would wait for join_workers'
        # timeout (30 s); 5 s leaves a loaded host room for the close itself
        assert blocked_s < 5.0, f"closing blocked the GUI thread for {blocked_s:.2f} s"
        assert not dlg.isVisible() and dlg.step_text("slow") == "cancelled"
        assert dlg.alive_threads(), "the stuck worker goes on in the background"
    finally:
        fns.release.set()
    qtbot.waitUntil(lambda: not dlg.alive_threads(), timeout=30_000)
    qtbot.wait(100)  # the worker's late signals arrive now and must be ignored
    assert deployed == [] and failed == [] and dlg.step_text("slow") == "cancelled"


def test_password_sign_in_requires_a_password(qtbot, make_dialog):
    fns = RecordingDeploy()
    dlg = make_dialog(fns, "a")
    dlg.password_radio.setChecked(True)
    dlg.deploy_button.click()
    assert "Enter the password" in dlg.summary.text() and fns.threads == []


# --- against a real sshd on loopback (root: sshd must run as root to switch users) ------------
import os
import random
import shutil
import socket
import subprocess
from pathlib import Path


def _free_port() -> int:
    """A free port below the kernel's ephemeral range (32768 and up here), so none of the
    suite's outgoing connections or port-0 binds takes it between a test's stopping an agent
    and its restarting the agent on the same port (once seen as a restart that never came up)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]) \
        if Path("/proc/sys/net/ipv4/ip_local_port_range").exists() else 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


@pytest.fixture
def real_sshd(tmp_path):
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    if os.geteuid() != 0 or not os.path.exists(sshd):
        pytest.skip("needs root and openssh-server")
    os.makedirs("/run/sshd", exist_ok=True)
    key = tmp_path / "host_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    port = _free_port()
    conf = tmp_path / "sshd_config"
    conf.write_text(f"Port {port}\nListenAddress 127.0.0.1\nHostKey {key}\nPidFile {tmp_path}/sshd.pid\n"
                    f"AuthorizedKeysFile {tmp_path}/authorized_keys\nUsePAM no\nPasswordAuthentication no\n"
                    "StrictModes no\nSubsystem sftp internal-sftp\n")
    proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    fp = subprocess.run(["ssh-keygen", "-lf", f"{key}.pub"], capture_output=True, text=True, check=True).stdout.split()[1]
    yield port, fp, (key.with_suffix(".pub")).read_text().split()
    proc.terminate()
    proc.wait(10)


def test_real_sshd_unknown_host_shows_the_fingerprint_ssh_keygen_prints(qtbot, real_sshd, tmp_path, monkeypatch):
    port, fp, _pub = real_sshd
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("EDGESHARD_HOME", str(tmp_path / "ws"))
    dlg = DeployDialog([DeviceRecord(id="loop", address="127.0.0.1", ssh_port=port, ssh_user="root")])
    qtbot.addWidget(dlg)
    dlg.show()
    try:
        with qtbot.waitSignal(dlg.host_key_confirmation_requested, timeout=60_000):
            dlg.deploy_button.click()
        box = dlg.findChild(QMessageBox, "hostKey-loop")
        assert fp in box.informativeText() and "ssh-ed25519" in box.informativeText()
        dlg.confirm_host_key("loop", False)
        assert dlg.step_text("loop") == "skipped"
    finally:
        dlg.done(0)


def test_real_sshd_known_host_without_authorized_key_fails_in_plain_words(qtbot, real_sshd, tmp_path, monkeypatch):
    port, _fp, (key_type, key_b64, *_rest) = real_sshd
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "known_hosts").write_text(f"[127.0.0.1]:{port} {key_type} {key_b64}\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("EDGESHARD_HOME", str(tmp_path / "ws"))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    dlg = DeployDialog([DeviceRecord(id="loop", address="127.0.0.1", ssh_port=port, ssh_user="root")])
    qtbot.addWidget(dlg)
    dlg.show()
    try:
        with qtbot.waitSignal(dlg.device_failed, timeout=30000):
            dlg.deploy_button.click()
        detail = dlg.detail_text("loop")
        assert dlg.step_text("loop") == "failed"
        assert "loop:" in detail and "Traceback" not in detail and "Unexpected error" not in detail
        assert "key file" in detail  # what to do: give a key file, a password or run ssh-agent
    finally:
        dlg.done(0)
