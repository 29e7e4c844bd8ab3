"""Stage weights sent by the coordinator, kept on the device by content hash.

The coordinator sends each agent only its stage's slice (``core.runs.weights``), file by
file, in chunks over the encrypted control channel. Files are stored as
``<root>/blobs/<sha256>``: a file already here (any earlier plan that shared it) is not
sent again, and an interrupted one continues from ``<sha256>.part``. The digest is checked
when the last byte arrives; a mismatch drops the partial file. A stage directory is then
hard links named as the checkpoint's files, so the ordinary checkpoint reader loads it.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_FILE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
MAX_FILE_BYTES = 1 << 40


class WeightStoreError(ValueError):
    """A chunk or file list that cannot be stored (bad name, wrong offset, checksum mismatch)."""


def default_root() -> Path:
    """``$XDG_CACHE_HOME/edgeshard-agent/weights`` (default ``~/.cache/...``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "edgeshard-agent" / "weights"


class WeightStore:
    """Content-addressed files on the device. Used from the agent's control thread only."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self._hashing: dict[str, tuple[int, "hashlib._Hash"]] = {}
        """Running sha256 of each partial file (offset it covers), so completing one is instant."""

    def _blob(self, digest: str) -> Path:
        if not _DIGEST.match(digest):
            raise WeightStoreError(f"not a sha256 hex digest: {digest[:80]!r}")
        return self.root / "blobs" / digest

    def have(self, digest: str) -> int:
        """Bytes of ``digest`` already here: its size when complete, else the partial length."""
        blob = self._blob(digest)
        if blob.is_file():
            return blob.stat().st_size
        part = blob.with_name(blob.name + ".part")
        return part.stat().st_size if part.is_file() else 0

    def is_complete(self, digest: str) -> bool:
        return self._blob(digest).is_file()

    def put(self, digest: str, offset: int, size: int, data: bytes) -> int:
        """Write ``data`` at ``offset`` of the file ``digest`` of ``size`` bytes; returns the
        bytes now held. The offset must be where the partial file ends (resume asks first)."""
        blob = self._blob(digest)
        if not 0 <= size <= MAX_FILE_BYTES:
            raise WeightStoreError(f"file size {size} out of range")
        if blob.is_file():
            return blob.stat().st_size
        part = blob.with_name(blob.name + ".part")
        held = part.stat().st_size if part.is_file() else 0
        if offset != held:
            raise WeightStoreError(f"chunk at offset {offset}, but {held} bytes of {digest[:12]} are here; resume from {held}")
        if offset + len(data) > size:
            raise WeightStoreError(f"chunk ends at {offset + len(data)}, beyond the file's {size} bytes")
        part.parent.mkdir(parents=True, exist_ok=True)
        h = self._running_hash(digest, part, held)
        with open(part, "ab") as f:
            f.write(data)
        h.update(data)
        held += len(data)
        self._hashing[digest] = (held, h)
        if held == size:
            del self._hashing[digest]
            if h.hexdigest() != digest:
                part.unlink(missing_ok=True)
                raise WeightStoreError(f"checksum mismatch for {digest[:12]}: the partial file was dropped; send it again")
            os.replace(part, blob)
        return held

    def _running_hash(self, digest: str, part: Path, held: int):
        known = self._hashing.get(digest)
        if known is not None and known[0] == held:
            return known[1]
        h = hashlib.sha256()  # a partial file from before a restart: hash what is there once
        if held:
            with open(part, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        return h

    def stage_dir(self, files: tuple[tuple[str, str], ...]) -> Path:
        """A directory holding the complete files ``(name, digest)`` under their names."""
        if not files:
            raise WeightStoreError("no files named for the stage")
        for name, digest in files:
            if not _FILE_NAME.match(name) or name in (".", ".."):
                raise WeightStoreError(f"bad file name {name[:80]!r}")
            if not self.is_complete(digest):
                raise WeightStoreError(f"{name} ({digest[:12]}) has not been received completely; send it first")
        key = hashlib.sha256(repr(sorted(files)).encode()).hexdigest()[:24]
        out = self.root / "stages" / key
        if out.is_dir():
            return out
        tmp = out.with_name(key + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name, digest in files:
            try:
                os.link(self._blob(digest), tmp / name)
            except OSError:
                shutil.copyfile(self._blob(digest), tmp / name)
        os.replace(tmp, out)
        return out
