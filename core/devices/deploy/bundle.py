"""The agent bundle: the ``agents`` package alone, stamped by a hash of its files, uploaded
once per stamp."""

from __future__ import annotations

import errno
import hashlib
import posixpath
from dataclasses import dataclass
from pathlib import Path

import agents
from agents import AGENT_VERSION
from core.devices.deploy.errors import NoDiskSpace
from core.devices.deploy.ssh import SshSession, sftp_makedirs
from core.reporting import Reporter


@dataclass(frozen=True)
class AgentBundle:
    stamp: str
    """``AGENT_VERSION-<hash of the files>``: a changed file is a new version."""
    files: dict[str, bytes]
    """Path inside the bundle (``agents/...``) → content."""

    @property
    def size(self) -> int:
        return sum(len(b) for b in self.files.values())


def build_bundle(package_dir: Path | None = None) -> AgentBundle:
    """The ``agents`` package's source files, stamped (nothing from core/ or gui/ ships)."""
    root = Path(package_dir or Path(agents.__file__).parent)
    files = {}
    for p in sorted(root.rglob("*.py")):
        if "__pycache__" in p.parts:
            continue
        files[f"agents/{p.relative_to(root).as_posix()}"] = p.read_bytes()
    h = hashlib.sha256()
    for name, data in files.items():
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return AgentBundle(stamp=f"{AGENT_VERSION}-{h.hexdigest()[:12]}", files=files)


def upload_bundle(session: SshSession, bundle: AgentBundle, bundle_dir: str, reporter: Reporter) -> bool:
    """Upload unless a complete copy of this stamp is there; False when it was already there."""
    sftp = session.sftp
    marker = posixpath.join(bundle_dir, "BUNDLE_OK")
    try:
        if sftp.stat(marker).st_size == len(bundle.stamp):
            return False
    except FileNotFoundError:
        pass
    total, done = bundle.size, 0
    try:
        for name, data in bundle.files.items():
            path = posixpath.join(bundle_dir, name)
            sftp_makedirs(sftp, posixpath.dirname(path))
            with sftp.open(path, "wb") as f:
                f.write(data)
            done += len(data)
            reporter.progress(done, total)
        with sftp.open(marker, "wb") as f:
            f.write(bundle.stamp.encode())
    except OSError as err:
        if getattr(err, "errno", None) == errno.ENOSPC or "space" in str(err).lower() or "Failure" in str(err):
            raise NoDiskSpace(session.target.device, f"upload to {bundle_dir} failed: {err}",
                              "free some space on the device") from None
        raise
    return True
