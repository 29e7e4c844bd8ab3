"""A measured profile kept for the next launch of the same local cluster (the demo's).

Profiling the demo's three agents takes seconds to minutes on 2 cores, and at the next launch
nothing it measured has changed when the same agent code emulates the same devices for the
same model on the same machine. So the demo keeps its last profile and offers it at once,
saying when it was measured (the operator can profile again at any time).

The key is a hash of everything the measurement depends on (``profile_key``): the model's
units (its ``config.json``; not its weights — the trained demo model has the untrained one's
units and sizes), each device's emulation and link, the profiling options, the code that
measures (every ``agents/*.py`` source: the profiler, the shard, the emulation), the versions
of torch and transformers, and the host (CPU model, cores, machine). Any change gives another
key, so the kept profile is not found (a miss, never a stale hit); the next measurement
replaces it. One profile is kept per folder; a damaged file is a miss.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from core import formats
from core.devices.profile import Profile
from core.errors import FormatError

CACHE_PREFIX = "profile-"


def profile_key(*, model_config: dict, devices: dict[str, dict], options: dict, code: str, host: dict) -> str:
    """A stable hash of what a profile measured: the same inputs give the same key whatever
    their order; any changed value gives another."""
    doc = {"model": model_config, "devices": devices, "options": options, "code": code, "host": host}
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def code_digest(package_dir: str | os.PathLike) -> str:
    """Hash of every ``.py`` source under ``package_dir`` (path and bytes, sorted)."""
    root = Path(package_dir)
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def host_identity() -> dict:
    """The machine a profile was measured on, and the versions of the libraries that computed."""

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return ""

    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {"machine": platform.machine(), "cpu": cpu, "cores": os.cpu_count() or 0,
            "torch": version("torch"), "transformers": version("transformers")}


@dataclass(frozen=True)
class CachedProfile:
    profile: Profile
    measured_at: float
    """``time.time()`` when it was kept (just after it was measured)."""


def _path(folder: Path, key: str) -> Path:
    return folder / f"{CACHE_PREFIX}{key[:32]}.json"


def has_cached_profiles(folder: str | os.PathLike) -> bool:
    """Whether any profile is kept in ``folder`` (a quick look, before the key is known)."""
    return any(Path(folder).glob(f"{CACHE_PREFIX}*.json"))


def load_cached_profile(folder: str | os.PathLike, key: str) -> CachedProfile | None:
    """The profile kept under ``key``, or None (none kept, another key, or a damaged file)."""
    path = _path(Path(folder), key)
    try:
        measured_at = path.stat().st_mtime
        return CachedProfile(formats.load(path, Profile), measured_at)
    except (OSError, FormatError):
        return None


def save_cached_profile(folder: str | os.PathLike, key: str, profile: Profile) -> Path:
    """Keep ``profile`` under ``key``, replacing any profile kept before (one per folder)."""
    folder = Path(folder)
    path = _path(folder, key)
    formats.save(path, profile)  # atomic
    for old in folder.glob(f"{CACHE_PREFIX}*.json"):
        if old != path:
            old.unlink(missing_ok=True)
    return path


def describe_age(measured_at: float, now: float | None = None) -> str:
    """When a kept profile was measured, for the operator: ``14:32`` today, else ``2026-11-25 14:32``."""
    now = time.time() if now is None else now
    then, today = time.localtime(measured_at), time.localtime(now)
    same_day = then[:3] == today[:3]
    return time.strftime("%H:%M" if same_day else "%Y-%m-%d %H:%M", then)
