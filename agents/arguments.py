"""Typed argparse converters (shared by ``python -m agents`` and the ``edgeshard`` CLI, which
imports them from here: agents ship alone): a number out of range is refused while the command line is
parsed (one line naming the option and what is allowed, exit status 2), before any work
starts. NaN and infinities are never allowed."""

from __future__ import annotations

import argparse
import math


def int_in(lo: int, hi: int | None = None):
    """An integer in [lo, hi] (hi None: no upper bound)."""

    def convert(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"must be an integer {allowed}, got {value}")
        return value

    convert.__name__ = "integer"
    return convert


def float_in(lo: float, hi: float, *, lo_open: bool = False):
    """A finite number in [lo, hi] ((lo, hi] with ``lo_open``)."""

    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        low_ok = value > lo if lo_open else value >= lo
        if not math.isfinite(value) or not low_ok or value > hi:
            allowed = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
            raise argparse.ArgumentTypeError(f"must be a finite number in {allowed}, got {text!r}")
        return value

    convert.__name__ = "number"
    return convert

