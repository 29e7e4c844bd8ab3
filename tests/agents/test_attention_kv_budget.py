"""A memory side's KV cache within its budget: a hold's reservation is allocated (resident) up
front and gives the tokens of HF ``generate()``; a step beyond it, or growth beyond a budget, is
refused before anything is written or allocated, naming what was reserved and what was needed."""

from __future__ import annotations

import pytest
import torch

from agents.local_pipeline import generate_partitioned
from agents.protocol import KvReservation
from agents.sampling import SamplingParams
from agents.stage_input import ReservationExceeded
from agents.techniques.attention_offload.heads import (
    AttentionStore,
    DenseExecutor,
    HeadShape,
    reserved_kv_bytes,
    split_heads,
)
from tests.agents.test_shard_equivalence import MAX_NEW, encode, hf_greedy


def test_reserved_memory_sides_give_the_tokens_of_hf_generate_and_hold_their_reservation(tiny_llama_dir):
    ids, mask = encode(tiny_llama_dir)
    expected, _ = hf_greedy(tiny_llama_dir)
    shape = HeadShape.of(tiny_llama_dir)
    kv = KvReservation(groups=1, sequences=ids.shape[0], context_tokens=ids.shape[1] + MAX_NEW)
    stores = [AttentionStore(shape, heads, reservation=kv) for heads in split_heads(shape.kv_heads, 2)]
    held = [s.kv_bytes() for s in stores]
    assert held == [2 * shape.layers * 1 * shape.head_dim * ids.shape[0] * (ids.shape[1] + MAX_NEW) * 4] * 2
    dense = DenseExecutor(tiny_llama_dir, 0, 6, sides=stores)
    result = generate_partitioned([dense], ids, mask, SamplingParams(max_new_tokens=MAX_NEW, eos_token_ids=(2,),
                                                                     pad_token_id=0))
    assert torch.equal(result.tokens, expected)
    assert [s.kv_bytes() for s in stores] == held  # the run took nothing beyond the reservation


def _kv(batch: int, tokens: int, heads: int = 1, dim: int = 16):
    return torch.randn(batch, heads, tokens, dim), torch.randn(batch, heads, tokens, dim)


def test_a_step_beyond_the_reserved_context_is_refused_naming_the_reservation_and_the_need():
    shape = HeadShape(layers=2, q_heads=4, kv_heads=2, head_dim=16)
    store = AttentionStore(shape, range(0, 1), reservation=KvReservation(groups=1, sequences=2, context_tokens=5))
    q = torch.randn(2, 2, 4, 16)
    store.attend(0, 0, q, *_kv(2, 4), None, 0.25)
    with pytest.raises(ReservationExceeded, match=r"2 sequences of 5 tokens\) cannot take 2 sequences of 6 tokens"):
        store.attend(0, 0, q[:, :, :2], *_kv(2, 2), None, 0.25)
    with pytest.raises(ReservationExceeded, match="micro-batches' KV caches reserved"):
        store.attend(1, 0, q, *_kv(2, 4), None, 0.25)  # a second group: one was reserved
    assert store.kv_bytes() == reserved_kv_bytes(shape, range(0, 1), KvReservation(groups=1, sequences=2,
                                                                                    context_tokens=5))


def test_growth_beyond_the_budget_is_refused_before_the_cache_grows():
    shape = HeadShape(layers=1, q_heads=2, kv_heads=1, head_dim=16)
    step = 2 * 1 * 1 * 8 * 16 * 4  # keys and values of 8 tokens, one sequence
    store = AttentionStore(shape, range(0, 1), budget_bytes=3 * step)
    store.attend(0, 0, torch.randn(1, 2, 8, 16), *_kv(1, 8), None, 0.25)
    with pytest.raises(ReservationExceeded, match=r"need 0\.00 MiB.*over the 0\.00 MiB memory budget"):
        store.attend(0, 0, torch.randn(1, 2, 8, 16), *_kv(1, 8), None, 0.25)  # old + new copy: 4 steps' worth
    assert store.kv_bytes() == step and store.cached_tokens(0) == 8
