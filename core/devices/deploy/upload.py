"""Files to a device: resumable, checksummed uploads, and a stage's slice of a checkpoint."""

from __future__ import annotations

import hashlib
import posixpath
from pathlib import Path

from core.devices.deploy.errors import NoDiskSpace
from core.devices.deploy.remote import quote
from core.devices.deploy.ssh import SshSession, sftp_makedirs
from core.errors import DeployError
from core.reporting import Cancelled, NullReporter, Reporter


def upload_file_resumable(session: SshSession, local: Path, remote: str, reporter: Reporter | None = None,
                          chunk: int = 1 << 20) -> str:
    """Upload ``local`` to ``remote`` through ``remote.part``, continuing a partial upload;
    the sha256 of the finished remote file is checked before the rename. Returns 'uploaded',
    'resumed' or 'already there'."""
    rep = reporter or NullReporter()
    sftp = session.sftp
    size = local.stat().st_size
    digest = file_sha256(local)
    sftp_makedirs(sftp, posixpath.dirname(remote))
    try:
        st = sftp.stat(remote)
        if st.st_size == size and remote_sha256(session, remote) == digest:
            rep.progress(size, size)
            return "already there"
    except FileNotFoundError:
        pass
    part = remote + ".part"
    try:
        offset = sftp.stat(part).st_size
    except FileNotFoundError:
        offset = 0
    if offset > size:
        offset = 0
    outcome = "resumed" if offset else "uploaded"
    try:
        with open(local, "rb") as src, sftp.open(part, "ab" if offset else "wb") as dst:
            dst.set_pipelined(True)
            src.seek(offset)
            done = offset
            rep.progress(done, size)
            while True:
                if rep.cancel_requested():
                    raise Cancelled()
                buf = src.read(chunk)
                if not buf:
                    break
                dst.write(buf)
                done += len(buf)
                rep.progress(done, size)
    except OSError as err:
        if "Failure" in str(err) or "space" in str(err).lower():
            raise NoDiskSpace(session.target.device, f"upload of {local.name} failed: {err}") from None
        raise
    if remote_sha256(session, part) != digest:
        sftp.remove(part)
        raise DeployError(session.target.device, f"{remote}: checksum mismatch after upload; retry")
    sftp.posix_rename(part, remote)
    return outcome


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def remote_sha256(session: SshSession, path: str) -> str:
    rc, out, _ = session.run(f"sha256sum {quote(path)}", timeout_s=300)
    return out.split()[0] if rc == 0 and out else ""


def upload_stage_checkpoint(session: SshSession, model_dir: Path, start: int, end: int, remote_dir: str,
                            cache_dir: Path, reporter: Reporter | None = None) -> str:
    """Upload only units [start, end) of ``model_dir`` as one ``model.safetensors`` (plus
    config.json) into ``remote_dir``; returns the remote directory for ``LoadShard``."""
    from core.models.stage_checkpoint import write_stage_checkpoint

    rep = reporter or NullReporter()
    rep.status(f"packing units [{start}, {end})")
    local = write_stage_checkpoint(model_dir, start, end, cache_dir)
    rep.status(f"uploading units [{start}, {end}) ({(local / 'model.safetensors').stat().st_size / 2**20:.1f} MiB)")
    upload_file_resumable(session, local / "config.json", posixpath.join(remote_dir, "config.json"))
    upload_file_resumable(session, local / "model.safetensors", posixpath.join(remote_dir, "model.safetensors"), rep)
    return remote_dir
