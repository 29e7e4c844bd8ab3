"""The accuracy metric of bit-width adaptation: a whole-model executor's perplexity on token
sequences (split from ``offload``: a job of its own, and that module had no room left)."""

from __future__ import annotations

import torch

from agents.checkpoint_reader import CheckpointError


@torch.inference_mode()
def perplexity(executor, texts: list[list[int]]) -> float:
    """Perplexity of a whole-model executor on token sequences, teacher-forced one token at a time
    (prefill the first token, decode the rest): the accuracy metric of bit-width adaptation."""
    if not (executor.is_first and executor.is_last):
        raise CheckpointError("perplexity needs an executor holding the whole model")
    nll, count = 0.0, 0
    for group, ids in enumerate(texts):
        if len(ids) < 2:
            continue
        x = torch.tensor([ids], dtype=torch.long)
        logits = executor.prefill(group, x[:, :1], torch.ones((1, 1), dtype=torch.long))
        for t in range(1, len(ids)):
            nll -= float(torch.log_softmax(logits, dim=-1)[0, ids[t]])
            count += 1
            if t + 1 < len(ids):
                logits = executor.decode(group, x[:, t:t + 1])
        executor.drop(group)
    if not count:
        raise CheckpointError("perplexity needs at least one text of 2 tokens or more")
    return float(torch.exp(torch.tensor(nll / count)))
