"""Choose the next token from the last stage's logits: greedy, or seeded temperature/top-p.

Sampling draws only from the ``torch.Generator`` passed in, never from the global RNG, so a
run is reproducible and equal however the model is partitioned. A pipeline run seeds one
generator per (seed, micro-batch, step) (``step_generator``): the draw of a step depends on
its position only, so a run that resumes after a failure (a new last stage, the KV cache
rebuilt) samples exactly what the undisturbed run would have. The order is HF's
(repetition penalty and repeated n-grams, then temperature, then top-k, then top-p); the
top-p rule is HF's ``TopPLogitsWarper``: keep the smallest set of most likely tokens whose
probability reaches ``top_p`` (always at least one).

The repetition penalty and the n-gram ban are HF's ``RepetitionPenaltyLogitsProcessor`` and
``NoRepeatNGramLogitsProcessor``: they look at each sequence's *history* — every token it
holds so far, the (left-padded) prompt included, as HF's ``input_ids`` — so greedy text stops
looping ("not the man who -- not the man who") and still equals ``generate()``'s.
"""

from __future__ import annotations

import math

import msgspec
import torch


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    temperature: float = 0.0
    """0 = greedy (argmax)."""
    top_p: float = 1.0
    top_k: int = 0
    """Keep only the k most likely tokens before top-p (0 = off), as HF's TopKLogitsWarper."""
    seed: int = 0
    max_new_tokens: int = 32
    eos_token_ids: tuple[int, ...] = ()
    """A sequence stops after producing any of these."""
    pad_token_id: int = 0
    """Fed (and reported) for sequences that already stopped, as HF generate does."""
    repetition_penalty: float = 1.0
    """HF's ``repetition_penalty``: a token already in the sequence has its logit divided by
    this (multiplied, when negative); 1 = off, > 1 discourages repeating."""
    no_repeat_ngram_size: int = 0
    """HF's ``no_repeat_ngram_size``: never produce an n-gram of this size twice (0 = off)."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if self.no_repeat_ngram_size < 0:
            raise ValueError(f"no_repeat_ngram_size must be >= 0, got {self.no_repeat_ngram_size}")

    @property
    def uses_history(self) -> bool:
        """Whether sampling needs each sequence's tokens so far (``sample``'s ``history``)."""
        return self.repetition_penalty != 1.0 or self.no_repeat_ngram_size > 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed)


def step_generator(seed: int, micro_batch: int, step: int) -> torch.Generator:
    """The generator of one step's draw: a function of its position, never of what ran before."""
    mixed = (seed * 0x9E3779B97F4A7C15 + micro_batch * 0xBF58476D1CE4E5B9 + step * 0x94D049BB133111EB) % (1 << 63)
    return torch.Generator().manual_seed(mixed)


def penalize_repetition(scores: torch.Tensor, history: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF's ``RepetitionPenaltyLogitsProcessor``: each token present in a row's ``history``
    [B, L] (once, however often) gets its score divided by ``penalty`` (multiplied if < 0)."""
    vocab = scores.shape[-1]
    ids = history.clamp(max=vocab)  # ids past the head's vocabulary cannot be produced: a dropped column
    padded = torch.nn.functional.pad(scores, (0, 1))
    seen = torch.gather(padded, 1, ids)
    seen = torch.where(seen < 0, seen * penalty, seen / penalty)
    return padded.scatter(1, ids, seen)[..., :vocab]


def ban_repeated_ngrams(scores: torch.Tensor, history: torch.Tensor, n: int) -> torch.Tensor:
    """HF's ``NoRepeatNGramLogitsProcessor``: a token that would complete an ``n``-gram the
    row's ``history`` already holds gets ``-inf``."""
    length, vocab = history.shape[1], scores.shape[-1]
    if length < n:
        return scores
    scores = scores.clone()
    for row, tokens in enumerate(history.tolist()):
        prefix = tuple(tokens[length - n + 1:]) if n > 1 else ()
        banned = {tokens[i + n - 1] for i in range(length - n + 1) if tuple(tokens[i:i + n - 1]) == prefix}
        banned = {t for t in banned if t < vocab}  # ids past the head's vocabulary cannot be produced
        if banned:
            scores[row, sorted(banned)] = float("-inf")
    return scores


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
           history: torch.Tensor | None = None) -> torch.Tensor:
    """Next token per row of ``logits`` [B, V] as int64 [B]. ``history`` [B, L]: each row's
    tokens so far (prompt included), needed when ``params.uses_history``."""
    logits = logits.float()
    if params.uses_history:
        if history is None or history.shape[0] != logits.shape[0]:
            raise ValueError("a repetition penalty or n-gram ban needs each sequence's tokens so far")
        if params.repetition_penalty != 1.0:
            logits = penalize_repetition(logits, history, params.repetition_penalty)
        if params.no_repeat_ngram_size > 0:
            logits = ban_repeated_ngrams(logits, history, params.no_repeat_ngram_size)
    if params.greedy:
        return logits.argmax(dim=-1)
    scores = logits / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, sorted_index = torch.sort(scores, descending=False, dim=-1)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - params.top_p)
        remove_sorted[..., -1:] = False  # keep the most likely token
        remove = remove_sorted.scatter(1, sorted_index, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
