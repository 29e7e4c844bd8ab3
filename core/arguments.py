"""Typed command-line numbers, shared by the `edgeshard` CLI and techniques' own verbs: a number out of range is refused while the command
line is parsed (one line naming the option and what is allowed, exit status 2), before any
work starts. The converters live with the agent, which ships alone and needs them too."""

from __future__ import annotations

from agents.arguments import float_in, int_in

__all__ = ["PORT", "ROW_ID", "SEED", "THREADS", "TOKENS", "add_image_arguments", "add_penalty_arguments", "float_in",
           "int_in"]

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


def add_penalty_arguments(parser, when: str) -> None:
    """OpenAI's frequency and presence penalties (agents/sampling.py), one set for `edgeshard run` and
    `edgeshard serve` (``when``: what the help adds, e.g. serve's "when a request gives none")."""
    parser.add_argument("--frequency-penalty", type=float_in(-2, 2), default=0.0,
                        help=f"OpenAI's frequency_penalty{when}: a token's logit loses this per time it was "
                             "generated so far (the prompt not counted; 0 = off)")
    parser.add_argument("--presence-penalty", type=float_in(-2, 2), default=0.0,
                        help=f"OpenAI's presence_penalty{when}: a token's logit loses this once it was generated "
                             "at all (0 = off)")
