"""Host keys: known, unknown or changed, and the policy that decides which to trust.

No AutoAddPolicy: an unknown key is trusted only when the caller says so, and is then written
to the workspace's own known_hosts; a changed key is always refused.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import paramiko

from core.devices.deploy.host_key_types import restrict_to_known_types
from core.devices.deploy.workspace import WORKSPACE_LOCK
from core.errors import DeployError


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
        with WORKSPACE_LOCK:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(f"{known_hosts_name(host, port)} {key.get_name()} {key.get_base64()}\n")
            os.chmod(path, 0o600)


def _load_known_hosts(path: Path) -> paramiko.HostKeys:
    """The plain host keys in an OpenSSH known_hosts file, line by line: a line paramiko cannot
    read (a ``@cert-authority`` or ``@revoked`` marker, a key type it does not know, garbage)
    is skipped alone, so it neither breaks every deploy nor hides the other hosts' keys."""
    keys = paramiko.HostKeys()
    try:
        lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    except OSError:
        return keys
    for lineno, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith(("#", "@")):
            continue
        try:
            entry = paramiko.hostkeys.HostKeyEntry.from_line(line, lineno)
        except Exception:  # paramiko raises several types for lines it cannot read
            continue
        if entry is not None and entry.key is not None:
            for name in entry.hostnames:
                keys.add(name, entry.key.get_name(), entry.key)
    return keys
