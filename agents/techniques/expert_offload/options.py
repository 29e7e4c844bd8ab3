"""What an ``expert-offload`` stage needs, carried in its ``LoadShard.options``.

The settings (slots, eviction, preload, storage throttle, whole-layer streaming, per-expert bit
widths) and the (name, sha256) of every file beside the checkpoint the stage reads (the quantised
experts, the activation profile) travel in the load message, so a stale or shipped copy of the
checkpoint cannot silently run other settings: the agent checks each named file's hash before it
builds the stage and reads no options file of its own.
"""

from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path

from agents.envelope import Options

POLICIES = ("edgemoe", "lru", "lfu")
BIT_WIDTHS = (2, 4, 8)
QUANTIZED_FILE = "experts-quantized.safetensors"
PROFILE_FILE = "expert-profile.safetensors"
STAGE_FILES = (QUANTIZED_FILE, PROFILE_FILE)
"""The files beside the checkpoint a stage may read (named in ``OffloadOptions.files``)."""
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
MAX_SLOTS = 1 << 16


class OffloadOptions(Options, frozen=True, tag="expert-offload"):
    """``LoadShard.options`` of an ``expert-offload`` stage."""

    slots: int = 4
    policy: str = "edgemoe"
    preload: int = 1
    whole_layers: bool = False
    bandwidth_bps: float | None = None
    """Throttle expert reads to this (emulate slower storage); None: as fast as the disk."""
    expert_bits: tuple[tuple[int, int, int], ...] = ()
    """(block, expert, bits) of the experts read quantised from ``QUANTIZED_FILE``; others full precision."""
    files: tuple[tuple[str, str], ...] = ()
    """(file name, sha256) of every file beside the checkpoint the stage reads (``STAGE_FILES``)."""

    def problem(self) -> str:
        if not 1 <= self.slots <= MAX_SLOTS:
            return f"slots must be in [1, {MAX_SLOTS}], got {self.slots}"
        if self.policy not in POLICIES:
            return f"policy must be one of {', '.join(POLICIES)}, got {self.policy[:40]!r}"
        if not 0 <= self.preload <= MAX_SLOTS:
            return f"preload must be in [0, {MAX_SLOTS}] experts per block, got {self.preload}"
        if self.bandwidth_bps is not None and not (math.isfinite(self.bandwidth_bps) and self.bandwidth_bps > 0):
            return f"bandwidth_bps must be > 0, got {self.bandwidth_bps!r}"
        if len(self.expert_bits) > MAX_SLOTS or any(
                b not in BIT_WIDTHS or not (0 <= layer < 1 << 16 and 0 <= e < 1 << 16) for layer, e, b in self.expert_bits):
            return f"expert_bits must be (block, expert, bits) with bits one of {BIT_WIDTHS}"
        names = [name for name, _ in self.files]
        if len(set(names)) != len(names) or any(n not in STAGE_FILES for n in names) \
                or not all(_SHA256.match(d) for _, d in self.files):
            return f"files must name each of {', '.join(STAGE_FILES)} at most once with its sha256"
        if self.expert_bits and QUANTIZED_FILE not in names:
            return f"expert_bits are set but {QUANTIZED_FILE} is not among the files"
        return ""

    def settings(self) -> dict:
        """The settings as the executor's options (``expert_bits`` keyed ``"block.expert"``)."""
        return {"slots": self.slots, "policy": self.policy, "preload": self.preload, "whole_layers": self.whole_layers,
                "bandwidth_bps": self.bandwidth_bps,
                "expert_bits": {f"{layer}.{expert}": bits for layer, expert, bits in self.expert_bits}}


def check_files(model_dir: str, files: tuple[tuple[str, str], ...]) -> None:
    """Every named file is in ``model_dir`` with the sha256 the load message says, else ``CheckpointError``:
    a stale copy of the quantised experts or the profile would change the stage's tokens or reads unnoticed."""
    from agents.checkpoint_reader import CheckpointError  # torch: only at load, never at the agent's start

    for name, digest in files:
        path = Path(model_dir) / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: the expert-offload stage reads it (ship the stage's "
                                  "weights, or copy it beside the checkpoint)")
        with open(path, "rb") as f:
            held = hashlib.file_digest(f, "sha256").hexdigest()
        if held != digest:
            raise CheckpointError(f"{path} is not the file the plan was made with (sha256 differs): copy the "
                                  "coordinator's, or configure the plan again")

