"""What an expert-offload stage's ``io`` events say: which expert and what happened to it (their
``peer``), read by the timeline, the heat map and the adaptation in core."""

from __future__ import annotations

EXPERT_OUTCOMES = ("hit", "load", "preload", "evict")
"""What happened to an expert in an ``io`` event: found in the buffer, read on demand (a miss),
read ahead by the predictor, or evicted."""


def expert_activity(block: int, expert: int, outcome: str) -> str:
    """The ``peer`` of an expert's io event: ``expert BLOCK.EXPERT OUTCOME``."""
    return f"expert {block}.{expert} {outcome}"


def parse_expert_activity(peer: str) -> tuple[int, int, str] | None:
    """(block, expert, outcome) of an ``expert_activity`` peer; None for anything else."""
    parts = peer.split(" ")
    if len(parts) != 3 or parts[0] != "expert" or parts[2] not in EXPERT_OUTCOMES:
        return None
    block, _, expert = parts[1].partition(".")
    if not (block.isdigit() and expert.isdigit()):
        return None
    return int(block), int(expert), parts[2]
