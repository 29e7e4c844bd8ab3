"""Registers ``edgeshard studio``; imports Qt only when the command runs."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``studio`` sub-command (the GUI)."""
