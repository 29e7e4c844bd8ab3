"""EdgeMoE's expert-wise bit-width adaptation as a pure search over measured losses.

Importance of an expert = the accuracy loss when it alone is quantised to the low width.
The least important ``K`` experts go to the low width, the others to the high one; ``K`` is
raised while the whole-model loss stays within the bound (binary search: the loss grows
with ``K``, as more experts lose precision). ``measure(bits_of) -> loss`` is the caller's
(agents.expert_offload.perplexity on held-out text, relative to full precision).
"""

from __future__ import annotations

from collections.abc import Callable

Key = tuple[int, int]


def assignment(order: list[Key], k: int, low: int, high: int) -> dict[Key, int]:
    return {key: (low if i < k else high) for i, key in enumerate(order)}


def adapt_bit_widths(importance: dict[Key, float], measure: Callable[[dict[Key, int]], float], bound: float,
                     low: int = 2, high: int = 4) -> tuple[dict[Key, int], float, int]:
    """(bits per expert, its measured loss, K) for the largest K whose loss is within ``bound``;
    K = 0 (every expert at ``high``) when even that misses the bound (its loss says by how much)."""
    order = sorted(importance, key=lambda key: (importance[key], key))
    lo, hi = 0, len(order)
    best = (assignment(order, 0, low, high), measure(assignment(order, 0, low, high)), 0)
    if best[1] > bound:
        return best
    while lo < hi:
        mid = (lo + hi + 1) // 2
        bits = assignment(order, mid, low, high)
        loss = measure(bits)
        if loss <= bound:
            lo, best = mid, (bits, loss, mid)
        else:
            hi = mid - 1
    return best


def average_bits(bits_of: dict[Key, int], experts: int) -> float:
    """Average bits per expert weight over all ``experts`` (those not in ``bits_of`` are fp32)."""
    return (sum(bits_of.values()) + 32 * (experts - len(bits_of))) / experts
