"""`edgeshard` sub-commands for model checkpoints (registered through the edgeshard.commands entry point)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Add this module's sub-commands to the CLI."""
