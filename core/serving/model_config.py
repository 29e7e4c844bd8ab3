"""What the server reads from a checkpoint's ``config.json``: how far it attends, and whether its rows may join
a running micro-batch."""

from __future__ import annotations

import json
from pathlib import Path


def full_attention_only(config: dict) -> bool:
    """Whether every block of the model attends over its whole past (rows may join a running micro-batch:
    a sliding window's cache cannot take masked columns), read as the stages read it (``StageExecutor``)."""
    config = config.get("text_config") or config
    types = config.get("layer_types")
    return all(t == "full_attention" for t in types) if types else config.get("sliding_window") is None


def model_context(model_dir: str) -> int:
    """Tokens the model can attend over (prompt + generated): its config's position limit."""
    config = json.loads(Path(model_dir, "config.json").read_text())
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        if isinstance(config.get(key), int):
            return int(config[key])
    text = config.get("text_config") or {}
    return int(text.get("max_position_embeddings", 2048))
