"""Speculative sampling's acceptance rule (Leviathan et al. 2023; Chen et al. 2023), so a sampled
speculative run's tokens are distributed as the target's own sampling.

Proposal i (drawn from the draft's q_i) is accepted with probability min(1, p_i(x) / q_i(x)); at
the first rejection the token is drawn from norm(max(0, p_i − q_i)) and the trip ends; when every
proposal is accepted the target's next distribution p_k gives one more. Every draw comes from the
trip's own generator (``trip_generator``: a function of the seed and the trip's index), in a fixed
order (the draft's k draws, then per proposal one uniform, then at most one token), so a seeded
run is reproducible and an independent implementation with the same draws gives the same tokens.
"""

from __future__ import annotations

import torch

from agents.sampling import step_generator


def trip_generator(seed: int, trip: int) -> torch.Generator:
    """The generator of trip ``trip``'s draws (0: the prefill's token)."""
    return step_generator(seed, 0, trip)


def distribution(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Rows of ``logits`` [n, V] as the probabilities the sampler draws from (temperature, then
    top-k, then top-p, as ``agents.sampling.sample``)."""
    scores = logits.float() / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, index = torch.sort(scores, descending=False, dim=-1)
        remove = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
        remove[..., -1:] = False
        scores = scores.masked_fill(remove.scatter(-1, index, remove), float("-inf"))
    return scores.softmax(dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a probability row [V]."""
    return int(torch.multinomial(probs, 1, generator=generator))


def accept(p: torch.Tensor, q: torch.Tensor, proposals: list[int], generator: torch.Generator) -> list[int]:
    """The tokens a trip commits: the accepted proposals, then a residual draw at the first
    rejection or a draw from ``p[len(proposals)]`` when all are accepted. ``p`` [k+1, V]: the
    target's distributions after each position; ``q`` [k, V]: the draft's for its proposals."""
    out = []
    for i, x in enumerate(proposals):
        ratio = float(p[i, x]) / float(q[i, x])
        if float(torch.rand((), generator=generator)) < min(1.0, ratio):
            out.append(x)
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        total = float(residual.sum())
        out.append(draw(residual / total if total > 0 else p[i], generator))
        return out
    out.append(draw(p[len(proposals)], generator))
    return out
