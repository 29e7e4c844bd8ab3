"""Token choice: greedy is argmax, top-p matches HF's TopPLogitsWarper, draws come only from the given generator."""

from __future__ import annotations

import msgspec
import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from agents.sampling import SamplingParams, sample


def test_greedy_picks_the_largest_logit_per_row():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    assert sample(logits, SamplingParams(), torch.Generator()).tolist() == [1, 0]


def test_top_p_never_draws_outside_the_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log().repeat(2000, 1)
    drawn = sample(logits, SamplingParams(temperature=1.0, top_p=0.7), torch.Generator().manual_seed(0))
    assert set(drawn.tolist()) == {0, 1}
    assert 0.55 < (drawn == 0).float().mean() < 0.70  # 0.5 / 0.8 renormalised


def test_top_p_keeps_the_same_tokens_as_hf_warper():
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(5)) * 3
    for top_p in (0.3, 0.8, 0.95):
        expected = TopPLogitsWarper(top_p)(None, TemperatureLogitsWarper(0.7)(None, logits.clone()))
        allowed = torch.isfinite(expected)
        draws = sample(logits.repeat(200, 1), SamplingParams(temperature=0.7, top_p=top_p),
                       torch.Generator().manual_seed(0)).view(200, 8).T
        assert allowed.gather(1, draws).all()
        if top_p == 0.3:
            assert allowed.sum(1).max() < 300


def test_top_k_keeps_the_same_tokens_as_hf_warper():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(8))
    allowed = torch.isfinite(TopKLogitsWarper(5)(None, logits.clone()))
    draws = sample(logits.repeat(300, 1), SamplingParams(temperature=2.0, top_k=5),
                   torch.Generator().manual_seed(0)).view(300, 6).T
    assert allowed.gather(1, draws).all()
    assert all(len(set(row.tolist())) == 5 for row in draws)


def test_tiny_top_p_is_greedy():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    drawn = sample(logits, SamplingParams(temperature=1.0, top_p=1e-6), torch.Generator().manual_seed(3))
    assert torch.equal(drawn, logits.argmax(-1))


def test_same_seed_same_draws_and_global_rng_untouched():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=1.0, seed=42)
    state = torch.random.get_rng_state()
    first = [sample(logits, params, g) for g in [params.make_generator()] for _ in range(5)]
    second = [sample(logits, params, g) for g in [params.make_generator()] for _ in range(5)]
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert torch.equal(state, torch.random.get_rng_state())


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_k", -1), ("top_p", 0.0), ("top_p", 1.5), ("max_new_tokens", 0)])
def test_invalid_sampling_params_are_rejected(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_travel_as_msgspec_json():
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=16, eos_token_ids=(2,), pad_token_id=0)
    assert msgspec.json.decode(msgspec.json.encode(params), type=SamplingParams) == params
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"temperature": -2}', type=SamplingParams)
