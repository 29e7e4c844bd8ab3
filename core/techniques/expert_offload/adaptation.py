"""EdgeMoE's expert-wise bit-width adaptation as a pure search over measured losses.

The caller measures ``loss(bits_of) -> relative accuracy loss`` of the whole model with the
experts in ``bits_of`` quantised ((block, expert) -> bits; the others full precision), e.g.
agents.techniques.expert_offload.perplexity on held-out text relative to fp32. The search, as the paper
describes it:

1. **Global bit widths** from whole-model measurements: every expert at each candidate width
   (INT8, INT4, INT2). The *upper* width is the narrowest whose uniform loss is within the
   bound; the *lower* one is the next narrower candidate (when the upper is already the
   narrowest, every expert goes there: nothing narrower is left to try).
2. **Importance** of each expert: the loss when it alone is at the lower width.
3. The least important ``K`` experts go to the lower width, the others stay at the upper one;
   ``K`` is raised one at a time while the measured loss stays within the bound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

Key = tuple[int, int]
WIDTHS = (2, 4, 8)
"""Candidate expert widths, narrowest first (agents.techniques.expert_offload.BIT_WIDTHS)."""


def assignment(order: list[Key], k: int, low: int, high: int) -> dict[Key, int]:
    return {key: (low if i < k else high) for i, key in enumerate(order)}


def global_widths(uniform_loss: dict[int, float], bound: float) -> tuple[int, int] | None:
    """(lower, upper) from the whole model's loss at each uniform width; None when even the widest
    misses the bound (the experts must stay full precision)."""
    widths = sorted(uniform_loss)
    within = [w for w in widths if uniform_loss[w] <= bound]
    if not within:
        return None
    upper = within[0]
    narrower = [w for w in widths if w < upper]
    return (narrower[-1] if narrower else upper), upper


def adapt_bit_widths(importance: dict[Key, float], measure: Callable[[dict[Key, int]], float], bound: float,
                     low: int = 2, high: int = 4) -> tuple[dict[Key, int], float, int]:
    """(bits per expert, its measured loss, K) for the least important K experts at ``low`` and the rest
    at ``high``, K raised from 0 while the loss stays within ``bound`` (stops at the first K over it);
    K = 0 (every expert at ``high``) when even that misses the bound (its loss says by how much)."""
    order = sorted(importance, key=lambda key: (importance[key], key))
    best = (assignment(order, 0, low, high), measure(assignment(order, 0, low, high)), 0)
    if best[1] > bound or low == high:
        return best
    for k in range(1, len(order) + 1):
        bits = assignment(order, k, low, high)
        loss = measure(bits)
        if loss > bound:
            break
        best = (bits, loss, k)
    return best


@dataclass
class Adaptation:
    """What the whole search measured and chose."""

    bits_of: dict[Key, int]
    """Per expert; empty when no width keeps the model within the bound (all full precision)."""
    loss: float
    int_low: int
    """Experts at the lower width (K)."""
    lower: int | None
    upper: int | None
    uniform_loss: dict[int, float]
    importance: dict[Key, float] = field(default_factory=dict)

    def average_bits(self, experts: int) -> float:
        return average_bits(self.bits_of, experts)


def edgemoe_adaptation(keys: list[Key], loss: Callable[[dict[Key, int]], float], bound: float,
                       widths: tuple[int, ...] = WIDTHS, progress: Callable[[str], None] = lambda _: None
                       ) -> Adaptation:
    """Steps 1-3 above over the experts ``keys``, with ``loss`` measuring one assignment."""
    progress(f"every expert at each of {', '.join(f'INT{w}' for w in widths)}")
    uniform = {w: loss({key: w for key in keys}) for w in widths}
    chosen = global_widths(uniform, bound)
    if chosen is None:
        return Adaptation(bits_of={}, loss=0.0, int_low=0, lower=None, upper=None, uniform_loss=uniform)
    lower, upper = chosen
    if lower == upper:  # the narrowest width already keeps the whole model within the bound
        return Adaptation(bits_of={key: lower for key in keys}, loss=uniform[lower], int_low=len(keys),
                          lower=lower, upper=upper, uniform_loss=uniform)
    progress(f"importance of {len(keys)} experts (each alone at INT{lower})")
    importance = {key: loss({key: lower}) for key in keys}
    progress(f"raising the INT{lower} experts (the rest INT{upper}) while within a {bound * 100:.1f} % loss")
    bits_of, adapted, k = adapt_bit_widths(importance, loss, bound, lower, upper)
    return Adaptation(bits_of=bits_of, loss=adapted, int_low=k, lower=lower, upper=upper, uniform_loss=uniform,
                      importance=importance)


def average_bits(bits_of: dict[Key, int], experts: int) -> float:
    """Average bits per expert weight over all ``experts`` (those not in ``bits_of`` are fp32)."""
    return (sum(bits_of.values()) + 32 * (experts - len(bits_of))) / experts
