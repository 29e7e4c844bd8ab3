"""EdgeMoE's bit-width search (core.techniques.expert_offload.adaptation) over a synthetic loss:
global lower/upper widths from the uniform measurements, then the least important K experts at the
lower width, K raised while within the bound."""

from __future__ import annotations

import pytest

from core.techniques.expert_offload.adaptation import edgemoe_adaptation, global_widths

KEYS = [(b, e) for b in range(2) for e in range(4)]
COST = {2: 0.02, 4: 0.004, 8: 0.0005}
"""Loss one expert adds at each width (expert (b, e) costs (e + 1) times this)."""


def loss_of(scale: float = 1.0):
    def loss(bits_of):
        return scale * sum(COST[bits] * (key[1] + 1) for key, bits in bits_of.items())
    return loss


def test_the_upper_width_is_the_narrowest_uniform_one_within_the_bound_and_the_lower_the_next():
    assert global_widths({2: 0.40, 4: 0.04, 8: 0.01}, 0.05) == (2, 4)
    assert global_widths({2: 0.40, 4: 0.09, 8: 0.01}, 0.05) == (4, 8)
    assert global_widths({2: 0.03, 4: 0.01, 8: 0.0}, 0.05) == (2, 2)
    assert global_widths({2: 0.9, 4: 0.5, 8: 0.2}, 0.05) is None


def test_the_least_important_experts_go_to_int2_and_the_others_stay_int4():
    # uniform INT2 loses 0.4, INT4 0.08 (> 5 %): upper INT8, lower INT4
    result = edgemoe_adaptation(KEYS, loss_of(), 0.05)
    assert (result.lower, result.upper) == (4, 8)
    # INT8 everywhere loses 0.01; each expert moved to INT4 adds (e + 1) * 0.0035, least important first:
    # 5 of them lose 0.01 + 0.0035 * (1+1+2+2+3) = 0.0415, a 6th would make it 0.052
    low = sorted(key for key, bits in result.bits_of.items() if bits == 4)
    assert result.int_low == len(low) == 5 and result.loss <= 0.05
    assert low == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert all(bits == 8 for key, bits in result.bits_of.items() if key not in low)
    assert 4 < result.average_bits(len(KEYS)) < 8


def test_a_model_that_keeps_its_accuracy_at_int2_goes_all_int2_without_a_search():
    result = edgemoe_adaptation(KEYS, loss_of(0.1), 0.05)  # uniform INT2 loses 0.04
    assert (result.lower, result.upper, result.int_low) == (2, 2, 8)
    assert set(result.bits_of.values()) == {2} and not result.importance


def test_no_width_within_the_bound_keeps_every_expert_full_precision():
    result = edgemoe_adaptation(KEYS, loss_of(100.0), 0.05)
    assert result.bits_of == {} and result.upper is None and result.average_bits(len(KEYS)) == 32.0


def test_raising_k_stops_at_the_first_k_over_the_bound():
    calls = []

    def loss(bits_of):
        calls.append(dict(bits_of))
        low = sum(1 for b in bits_of.values() if b == 2)
        return {0: 0.0, 1: 0.01, 2: 0.06, 3: 0.02}.get(low, 1.0) if len(bits_of) == len(KEYS) else 0.001
    uniform = {2: 1.0, 4: 0.0, 8: 0.0}

    def measure(bits_of):
        if len(bits_of) == len(KEYS) and len(set(bits_of.values())) == 1:
            return uniform[next(iter(bits_of.values()))]
        return loss(bits_of)
    result = edgemoe_adaptation(KEYS, measure, 0.05)
    assert result.int_low == 1 and result.loss == pytest.approx(0.01)  # K = 3 would be within again: not tried
