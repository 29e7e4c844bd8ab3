"""A known_hosts file with lines paramiko cannot read (a ``@cert-authority`` marker, an
unknown key type, garbage): before, such a line broke every deploy with a raw error (or hid
every other key in the file); now it is skipped alone and the host keys around it count."""

from __future__ import annotations

import subprocess
from pathlib import Path

import paramiko
import pytest

from core.devices import deploy

NO_USER_KNOWN = Path("/nonexistent")


def _pub_line(tmp_path: Path, host: str) -> tuple[str, paramiko.PKey]:
    key = tmp_path / f"key-{host}"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, capture_output=True)
    kind, b64 = Path(f"{key}.pub").read_text().split()[:2]
    return f"{host} {kind} {b64}", paramiko.Ed25519Key.from_private_key_file(str(key))


@pytest.mark.parametrize("odd_line", [
    "@cert-authority *.example.org ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl",
    "@revoked * ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQ",
    "10.0.0.9 ssh-unknown-type AAAAdGhpcyBpcyBub3QgYSBrZXk=",
    "this line is not a known_hosts line at all",
    "10.0.0.9 ssh-ed25519 !!!not-base64!!!",
])
def test_an_unreadable_line_is_skipped_and_the_other_keys_still_count(tmp_path, odd_line):
    before, key_a = _pub_line(tmp_path, "10.0.0.5")
    after, key_b = _pub_line(tmp_path, "10.0.0.6")
    kh = tmp_path / "known_hosts"
    kh.write_text(f"{before}\n{odd_line}\n{after}\n")
    policy = deploy.HostKeyPolicy(workspace_known_hosts=kh, user_known_hosts=NO_USER_KNOWN)
    assert policy.check("a", "10.0.0.5", 22, key_a).known
    assert policy.classify("10.0.0.6", 22, key_b).known
    other = paramiko.Ed25519Key.from_private_key_file(str(_keygen_other(tmp_path)))
    with pytest.raises(deploy.HostKeyMismatch):
        policy.check("b", "10.0.0.6", 22, other)


def _keygen_other(tmp_path: Path) -> Path:
    key = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, capture_output=True)
    return key
