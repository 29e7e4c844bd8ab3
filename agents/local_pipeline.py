"""The reference decode loop over a chain of stages in one process.

It is what a distributed run must reproduce token for token: prefill every stage in
order, sample on the last stage's logits, feed the token back to the first stage, and
repeat until every sequence produced an EOS or ``max_new_tokens`` were made. Stopped
sequences keep being fed ``pad_token_id``, exactly as HF ``generate()`` does, so greedy
output equals ``generate()``'s new tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from agents.sampling import SamplingParams, sample, step_generator
from agents.shard import StageExecutor


@dataclass
class GenerationResult:
    tokens: torch.Tensor
    """[B, n] int64 new tokens (n <= max_new_tokens; pad after a sequence's EOS)."""
    step_logits: list[torch.Tensor] = field(default_factory=list)
    """Per step, the last stage's logits [B, V] float32 (kept when asked for)."""


def run_stages(
    executors: list[StageExecutor], group: int, x: torch.Tensor, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """One pass through the chain: prefill when a mask is given, else one decode step."""
    for executor in executors:
        x = executor.prefill(group, x, attention_mask) if attention_mask is not None else executor.decode(group, x)
    return x


def check_chain(executors: list[StageExecutor]) -> None:
    """The stages cover all units of one model, in order, without gaps."""
    if not executors:
        raise ValueError("no stages")
    expected = 0
    for executor in executors:
        if executor.start != expected:
            raise ValueError(f"stage [{executor.start}, {executor.end}) does not start at unit {expected}")
        expected = executor.end
    if expected != executors[-1].num_units:
        raise ValueError(f"stages end at unit {expected}, the model has {executors[-1].num_units}")


def generate_partitioned(
    executors: list[StageExecutor],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    params: SamplingParams,
    *,
    group: int = 0,
    keep_logits: bool = False,
    on_step: Callable[[int, torch.Tensor], None] | None = None,
) -> GenerationResult:
    """Generate with the chain ``executors`` (which must cover all units in order).

    ``on_step(step, tokens)`` is called with each step's tokens [B] as they are produced.
    """
    check_chain(executors)
    eos = torch.tensor(params.eos_token_ids, dtype=torch.long)
    batch = input_ids.shape[0]
    unfinished = torch.ones(batch, dtype=torch.bool)
    produced: list[torch.Tensor] = []
    logits_seen: list[torch.Tensor] = []
    history = input_ids.to(torch.long)  # as HF's input_ids: the padded prompt, then every token fed
    try:
        logits = run_stages(executors, group, input_ids.to(torch.long), attention_mask)
        while True:
            if keep_logits:
                logits_seen.append(logits)
            token = sample(logits, params, step_generator(params.seed, group, len(produced)), history)
            token = torch.where(unfinished, token, torch.full_like(token, params.pad_token_id))
            history = torch.cat([history, token[:, None]], dim=1)
            produced.append(token)
            if on_step is not None:
                on_step(len(produced) - 1, token)
            if eos.numel():
                unfinished &= ~torch.isin(token, eos)
            if len(produced) >= params.max_new_tokens or not bool(unfinished.any()):
                break
            logits = run_stages(executors, group, token[:, None], None)
    finally:
        for executor in executors:
            executor.drop(group)
    return GenerationResult(tokens=torch.stack(produced, dim=1), step_logits=logits_seen)
