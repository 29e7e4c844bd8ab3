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


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_k", -1), ("top_p", 0.0), ("top_p", 1.5), ("max_new_tokens", 0),
                                         ("frequency_penalty", 2.5), ("presence_penalty", float("nan")),
                                         ("logit_bias", ((3, 101.0),))])
def test_invalid_sampling_params_are_rejected(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_travel_as_msgspec_json():
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=16, eos_token_ids=(2,), pad_token_id=0)
    assert msgspec.json.decode(msgspec.json.encode(params), type=SamplingParams) == params
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"temperature": -2}', type=SamplingParams)


def _openai_penalized(logits: torch.Tensor, generated: list[list[int]], frequency: float, presence: float,
                      bias: dict[int, float]) -> torch.Tensor:
    """OpenAI's documented rule, token by token: mu[j] -= c[j] * frequency + (c[j] > 0) * presence, then the bias."""
    out = logits.clone()
    for row, tokens in enumerate(generated):
        for j in set(tokens):
            out[row, j] -= tokens.count(j) * frequency + presence
        for j, b in bias.items():
            out[row, j] += b
    return out


def test_frequency_and_presence_penalties_and_logit_bias_follow_openais_rule_counting_only_generated_tokens():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(4)) * 3
    prompt = torch.tensor([[5, 5, 6], [7, 8, 9], [1, 1, 1]])
    generated = [[5, 9, 9, 9], [0, 1, 0, 2], [3, 3, 3, 3]]
    history = torch.cat([prompt, torch.tensor(generated)], dim=1)
    params = SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4, logit_bias=((2, 1.5), (39, -100.0)))
    expected = _openai_penalized(logits, generated, 0.7, -0.4, {2: 1.5, 39: -100.0})
    assert torch.equal(sample(logits, params, torch.Generator(), history, prompt_length=3),
                       expected.argmax(dim=-1))
    sampled = SamplingParams(temperature=0.9, seed=3, frequency_penalty=0.7, presence_penalty=-0.4,
                             logit_bias=((2, 1.5), (39, -100.0)))
    draws = sample(logits.repeat(200, 1), sampled, torch.Generator().manual_seed(1), history.repeat(200, 1), 3)
    reference = torch.multinomial((expected / 0.9).softmax(-1).repeat(200, 1), 1,
                                  generator=torch.Generator().manual_seed(1)).squeeze(1)
    assert torch.equal(draws, reference)  # the same distribution, drawn from the same generator


def test_a_logit_bias_of_100_forces_a_token_and_minus_100_bans_it():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(6))
    forced = sample(logits, SamplingParams(temperature=1.0, logit_bias=((17, 100.0),)), torch.Generator().manual_seed(0))
    assert forced.tolist() == [17, 17]
    best = logits.argmax(dim=-1)
    banned = sample(logits, SamplingParams(logit_bias=tuple((int(t), -100.0) for t in best)), torch.Generator())
    assert not (banned == best).any()


def test_the_repetition_penalty_scales_the_models_own_logits_before_the_bias_is_added():
    """The order (agents/sampling.py) decides this winner: token 0's raw logit -0.5 is penalised by HF's rule
    (negative: times 2 = -1.0), then biased (+2.1 = 1.1 > 1.0). Biased first (1.6, positive) it would be
    divided (0.8 < 1.0) and token 1 would win."""
    raw = torch.tensor([[-0.5, 1.0, 0.0]])
    params = SamplingParams(repetition_penalty=2.0, logit_bias=((0, 2.1),))
    assert sample(raw, params, torch.Generator(), torch.tensor([[0]])).tolist() == [0]


def test_penalties_without_the_generated_tokens_are_refused():
    with pytest.raises(ValueError, match="tokens so far"):
        sample(torch.zeros(1, 4), SamplingParams(presence_penalty=0.5), torch.Generator())
