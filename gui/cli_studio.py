"""Registers ``edgeshard studio``; imports Qt only when the command runs."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``studio`` sub-command (the GUI)."""
    p = sub.add_parser("studio", help="open the EdgeShard Studio desktop GUI",
                       description="Open the EdgeShard Studio desktop GUI.")
    p.add_argument("--workspace", metavar="FILE", help="workspace file (SQLite) to open or create")
    p.add_argument("--profile", metavar="FILE", help="a profile or problem file to plan with")
    p.add_argument("--demo", action="store_true",
                   help="start a local cluster of agents and a small model, and open the studio on it")
    p.set_defaults(func=run_studio)


def run_studio(args: argparse.Namespace) -> int:
    import os

    if not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY") and "QT_QPA_PLATFORM" not in os.environ:
        from core.errors import EdgeShardError

        raise EdgeShardError("no display found: run the studio on a desktop, or under `xvfb-run -a edgeshard studio`")
    from gui.launch import launch

    return launch(workspace=args.workspace, profile=args.profile, demo=args.demo)
