"""A greedy last stage takes its tokens through numpy's argmax (``agents.sampling.greedy_tokens``): the same
tokens as torch's own argmax (the reference), ties to the first maximum, NaN and infinities included; a greedy
run's sampler takes that path only when nothing else shapes the logits."""

from __future__ import annotations

import pytest
import torch

from agents.protocol import SamplingSpec
from agents.sampling import greedy_tokens
from agents.stage_run import default_sampler


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_tokens_are_torchs_argmax_with_ties_and_non_finite_logits(dtype):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 4096, generator=g).to(dtype)
    logits[1, 7] = logits[1, 4000] = 50  # a tie: the first one
    logits[2] = 0  # every token ties
    logits[3, 11] = float("inf")
    logits[4, 9] = float("nan")  # torch's argmax takes a NaN as the largest
    logits[5] = float("-inf")
    logits[5, 100] = -1e30
    want = logits.float().argmax(dim=-1)
    got = greedy_tokens(logits)
    assert got.dtype == torch.int64 and torch.equal(got, want)


def test_greedy_tokens_keep_the_leading_dimensions():
    logits = torch.randn(4, 1, 64, generator=torch.Generator().manual_seed(5))
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))


def test_a_greedy_sampler_with_a_logit_bias_still_applies_it():
    logits = torch.zeros(2, 8)
    logits[:, 3] = 1.0
    plain = default_sampler(SamplingSpec())(logits, None)
    biased = default_sampler(SamplingSpec(logit_bias=((5, 2.0),)))(logits, None)
    assert plain.tolist() == [3, 3] and biased.tolist() == [5, 5]
