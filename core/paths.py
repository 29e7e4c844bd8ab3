"""Where EdgeShard keeps its files: one folder, and one SQLite file. Read only here.

- ``$EDGESHARD_HOME`` (default ``~/.edgeshard``): a **folder** with what deployment keeps —
  the coordinator's CurveZMQ key, the workspace's known_hosts, agents.json, deployments.json.
- ``$EDGESHARD_WORKSPACE`` (default ``$XDG_DATA_HOME/edgeshard/workspace.sqlite``): the
  **SQLite file** that records sessions (core.sessions.store).
- ``$XDG_DATA_HOME/edgeshard/studio``: the studio's last workspace (problem and plan files).

Two variables because they are two kinds of thing; a value of the wrong kind (a file for
the home, a folder for the workspace) is a clear error naming the other variable.
"""

from __future__ import annotations

import os
from pathlib import Path

from core.errors import EdgeShardError

ENV_HOME = "EDGESHARD_HOME"
ENV_WORKSPACE = "EDGESHARD_WORKSPACE"


def edgeshard_home() -> Path:
    """The deployment folder: ``$EDGESHARD_HOME``, else ``~/.edgeshard``."""
    env = os.environ.get(ENV_HOME)
    return Path(env).expanduser() if env else Path.home() / ".edgeshard"


def workspace_file() -> Path:
    """The sessions SQLite file: ``$EDGESHARD_WORKSPACE``, else
    ``$XDG_DATA_HOME/edgeshard/workspace.sqlite`` (default ``~/.local/share/...``)."""
    env = os.environ.get(ENV_WORKSPACE)
    if env:
        return Path(env).expanduser()
    return _data_folder() / "workspace.sqlite"


def _data_folder() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "edgeshard"


def studio_folder() -> Path:
    """What the studio keeps between launches (the last workspace's problem and plan):
    ``$XDG_DATA_HOME/edgeshard/studio``, beside the default sessions file."""
    return _data_folder() / "studio"


def home_folder(path: str | os.PathLike | None = None) -> Path:
    """``path`` (or the default home) checked to be usable as a folder: an existing file
    there is an ``EdgeShardError`` rather than a FileExistsError halfway through a deploy."""
    home = Path(path).expanduser() if path else edgeshard_home()
    if home.exists() and not home.is_dir():
        raise EdgeShardError(
            f"{home} is a file, but the EdgeShard home must be a folder (it holds coordinator.key, "
            f"known_hosts and agents.json): set ${ENV_HOME} (or deploy's --home) to a folder; "
            f"${ENV_WORKSPACE} (or the sessions commands' --workspace) names the SQLite sessions file")
    return home
