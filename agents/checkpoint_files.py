"""Which safetensors file holds each tensor of a checkpoint directory, without torch.

One discovery for everyone who needs it: the agents' ``CheckpointReader`` (which then reads
tensors with torch) and the studio's run path, which checks a model directory before a run and
must not import torch or transformers to do it (seconds of CPU taken from agents being
profiled). ``safetensors``' numpy reader lists a file's tensors from its header alone.
"""

from __future__ import annotations

import json
from pathlib import Path


class CheckpointError(ValueError):
    """A model directory that cannot be run: missing files, unsupported family, missing tensors."""


def tensor_files(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name → the file that holds it, from ``model.safetensors.index.json`` (its weight
    map; shards are not opened) or else ``model.safetensors``'s header. ``CheckpointError`` when
    neither is there or what is there cannot be read."""
    path = Path(model_dir)
    index, single = path / "model.safetensors.index.json", path / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index}: invalid index: {err}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index}: invalid index: weight_map is not an object of file names")
        return {name: path / file for name, file in weight_map.items()}
    if not single.is_file():
        raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json "
                              "(only safetensors checkpoints are supported)")
    from safetensors import safe_open

    try:
        with safe_open(str(single), framework="numpy") as f:
            return {name: single for name in f.keys()}
    except Exception as err:  # noqa: BLE001 — safetensors raises its own (Rust) error types
        raise CheckpointError(f"{single}: not a readable safetensors file ({err})") from None
