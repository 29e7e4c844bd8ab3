"""The workspace's coordinator key, and the one lock under which parallel deploys write the
workspace's files (the key, known_hosts, agents.json)."""

from __future__ import annotations

import threading
from pathlib import Path

WORKSPACE_LOCK = threading.Lock()
"""Parallel deploys share the workspace's key, known_hosts and agents.json: one writer at a time."""


def coordinator_keypair(workspace: Path):
    """The workspace's CurveZMQ keypair: agents accept control only from its public key."""
    from agents.transport import CurveKeys

    with WORKSPACE_LOCK:
        workspace.mkdir(parents=True, exist_ok=True)
        return CurveKeys.load_or_create(workspace / "coordinator.key")
