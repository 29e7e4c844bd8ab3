"""Typed command-line numbers, shared by the `edgeshard` CLI and techniques' own verbs: a number out of range is refused while the command
line is parsed (one line naming the option and what is allowed, exit status 2), before any
work starts. The converters live with the agent, which ships alone and needs them too."""

from __future__ import annotations

from agents.arguments import float_in, int_in

__all__ = ["PORT", "ROW_ID", "SEED", "THREADS", "TOKENS", "add_image_arguments", "float_in", "int_in"]

PORT = int_in(0, 65535)
THREADS = int_in(0, 1024)
TOKENS = int_in(1, 1 << 20)
SEED = int_in(0, (1 << 63) - 1)
ROW_ID = int_in(1, (1 << 63) - 1)
"""A run or session number in the workspace (SQLite INTEGER)."""


def add_image_arguments(parser) -> None:
    """What a CNN run classifies (``edgeshard run`` of a spatial plan, ``edgeshard spatial run``):
    image files, else that many seeded random images."""
    parser.add_argument("--image", action="append", default=[], metavar="FILE",
                        help="a CNN plan: classify this image file (PNG, JPEG, ...; repeatable), resized and "
                             "centre-cropped to the network's input")
    parser.add_argument("--images", type=int_in(1, 10_000), default=None,
                        help="a CNN plan without --image: this many seeded random images (default 4)")
