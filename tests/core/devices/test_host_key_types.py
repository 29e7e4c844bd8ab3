"""Host keys of another type than the one on file: a real loopback sshd with RSA + ed25519 keys.

The attack: known_hosts has the host's ECDSA key, a man in the middle presents an RSA key. It
must be refused as a changed key, never accepted by ``--trust-new-host-keys``.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import paramiko
import pytest

from core.devices import deploy
from core.devices.deploy.host_key_types import algorithms_for

from tests.core.conftest import needs_root

NO_USER_KNOWN = Path("/nonexistent")


def _keygen(path: Path, kind: str) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-f", str(path)], check=True, capture_output=True)
    return path


def _known_line(host: str, port: int, pub: Path) -> str:
    kind, b64 = pub.read_text().split()[:2]
    return f"{deploy.known_hosts_name(host, port)} {kind} {b64}\n"


@pytest.fixture(scope="module")
def two_key_sshd(tmp_path_factory):
    """sshd on 127.0.0.1 offering an RSA and an ed25519 host key (it prefers ed25519)."""
    d = tmp_path_factory.mktemp("sshd2")
    rsa, ed = _keygen(d / "host_rsa", "rsa"), _keygen(d / "host_ed25519", "ed25519")
    op = _keygen(d / "operator", "ed25519")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = d / "sshd_config"
    conf.write_text("\n".join([
        f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {ed}", f"HostKey {rsa}",
        f"PidFile {d / 'sshd.pid'}", f"AuthorizedKeysFile {op}.pub", "PermitRootLogin prohibit-password",
        "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
        "UseDNS no", "",
    ]))
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    with open(d / "sshd.log", "wb") as log:
        proc = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(conf)], stdout=subprocess.DEVNULL,
                                stderr=log)
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        else:
            pytest.fail("loopback sshd did not start: " + (d / "sshd.log").read_text())
        yield dict(port=port, rsa=Path(f"{rsa}.pub"), ed25519=Path(f"{ed}.pub"), operator=str(op))
    finally:
        proc.terminate()
        proc.wait(10)


def _connect(srv, known_hosts: Path, trust_new):
    policy = deploy.HostKeyPolicy(workspace_known_hosts=known_hosts, user_known_hosts=NO_USER_KNOWN,
                                  trust_new=trust_new)
    target = deploy.SshTarget("dev", "127.0.0.1", srv["port"], "root")
    return deploy.connect(target, deploy.SshAuth(key_file=srv["operator"], use_agent=False), policy)


def test_a_key_of_a_type_not_on_file_for_a_known_host_is_a_change_not_a_new_host(tmp_path):
    kh = tmp_path / "known_hosts"
    kh.write_text(_known_line("10.0.0.5", 22, _keygen(tmp_path / "ecdsa", "ecdsa").with_suffix(".pub")))
    presented = paramiko.RSAKey.generate(2048)
    policy = deploy.HostKeyPolicy(workspace_known_hosts=kh, user_known_hosts=NO_USER_KNOWN, trust_new=True)
    info = policy.classify("10.0.0.5", 22, presented)
    assert info.changed and not info.known and info.known_key_type == "ecdsa-sha2-nistp256"
    with pytest.raises(deploy.HostKeyMismatch, match="HOST KEY CHANGED"):
        policy.check("dev", "10.0.0.5", 22, presented)
    assert kh.read_text().count("\n") == 1  # nothing was added


def test_rsa_host_key_algorithms_are_the_sha2_signatures():
    supported = paramiko.Transport._preferred_keys
    assert algorithms_for(["ssh-rsa"], supported) == ("rsa-sha2-512", "rsa-sha2-256")
    assert algorithms_for(["ssh-ed25519", "ecdsa-sha2-nistp256"], supported) == (
        "ssh-ed25519", "ecdsa-sha2-nistp256")


@pytest.mark.netns
@needs_root
def test_host_known_by_another_key_type_is_refused_even_when_new_keys_are_trusted(two_key_sshd, tmp_path):
    kh = tmp_path / "known_hosts"
    ecdsa = _keygen(tmp_path / "real_ecdsa", "ecdsa")  # the real host's key; this server has none such
    kh.write_text(_known_line("127.0.0.1", two_key_sshd["port"], ecdsa.with_suffix(".pub")))
    with pytest.raises(deploy.HostKeyMismatch, match="HOST KEY CHANGED"):
        _connect(two_key_sshd, kh, trust_new=True)
    assert kh.read_text().count("\n") == 1
    probe = deploy.probe_host_key("127.0.0.1", two_key_sshd["port"], workspace_known_hosts=kh,
                                  user_known=NO_USER_KNOWN)
    assert probe.changed and not probe.known


@pytest.mark.netns
@needs_root
def test_host_known_by_its_rsa_key_presents_that_key_although_it_prefers_ed25519(two_key_sshd, tmp_path):
    kh = tmp_path / "known_hosts"
    kh.write_text(_known_line("127.0.0.1", two_key_sshd["port"], two_key_sshd["rsa"]))
    with _connect(two_key_sshd, kh, trust_new=False) as s:
        assert s.host_key.known and s.host_key.key_type == "ssh-rsa"
        assert s.run("echo ok")[1].strip() == "ok"
    # an unknown host still gets the server's preferred key, to be accepted explicitly
    with pytest.raises(deploy.UnknownHostKey, match="ssh-ed25519"):
        _connect(two_key_sshd, tmp_path / "empty_known_hosts", trust_new=False)


@pytest.mark.netns
@needs_root
def test_host_known_by_an_rsa_key_that_differs_is_refused(two_key_sshd, tmp_path):
    kh = tmp_path / "known_hosts"
    kh.write_text(_known_line("127.0.0.1", two_key_sshd["port"], _keygen(tmp_path / "other", "rsa").with_suffix(".pub")))
    with pytest.raises(deploy.HostKeyMismatch) as err:
        _connect(two_key_sshd, kh, trust_new=True)
    assert err.value.info.key_type == "ssh-rsa"
