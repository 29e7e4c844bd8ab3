"""A stage allocates its KV cache at load for the planned context (as the paper's implementation
does): outputs are unchanged, the bytes are known before the first token, an over-budget plan is
refused at load, and a run beyond the reservation gets a clear error."""

from __future__ import annotations

import pytest
import torch

from agents.emulation import DeviceEmulation, ShardOverBudget
from agents.local_pipeline import generate_partitioned
from agents.protocol import KvReservation
from agents.sampling import SamplingParams
from agents.shard import StageExecutor, StageInputError
from core.models.checkpoints import FAMILIES
from tests.agents.test_shard_equivalence import PARTITIONS, PROMPTS, encode, hf_greedy

MAX_NEW = 10


def _reserved(model_dir, partition, context, groups=1, sequences=len(PROMPTS)):
    kv = KvReservation(groups=groups, sequences=sequences, context_tokens=context)
    return [StageExecutor(model_dir, a, b, kv=kv) for a, b in PARTITIONS[partition]]


@pytest.mark.parametrize("family", [f for f in FAMILIES if f in ("llama", "gpt2", "qwen2")])
def test_a_reserved_kv_cache_gives_the_tokens_and_logits_of_hf_generate(tiny_model_dirs, family):
    model_dir = tiny_model_dirs[family]
    ids, mask = encode(model_dir)
    expected_tokens, expected_logits = hf_greedy(model_dir)
    result = generate_partitioned(_reserved(model_dir, "3-uneven", ids.shape[1] + MAX_NEW), ids, mask,
                                  SamplingParams(max_new_tokens=MAX_NEW, eos_token_ids=(2,), pad_token_id=0),
                                  keep_logits=True)
    assert torch.equal(result.tokens, expected_tokens)
    torch.testing.assert_close(torch.stack(result.step_logits, dim=1), expected_logits, atol=1e-5, rtol=1e-4)


def test_the_reserved_bytes_are_known_at_load_and_follow_the_plan(tiny_llama_dir):
    from agents.checkpoint_reader import load_config

    cfg = load_config(tiny_llama_dir)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    stage = StageExecutor(tiny_llama_dir, 0, 3, kv=KvReservation(groups=2, sequences=3, context_tokens=40))
    assert stage.kv_reserved_bytes == 2 * 2 * 2 * 3 * kv_heads * 40 * head_dim * 4  # K+V, groups, 2 blocks, fp32
    assert StageExecutor(tiny_llama_dir, 0, 3).kv_reserved_bytes == 0
    assert StageExecutor(tiny_llama_dir, 0, 1, kv=KvReservation(groups=2, sequences=3, context_tokens=40)).kv_reserved_bytes == 0


def test_a_run_longer_than_the_reservation_is_refused_with_a_clear_error(tiny_llama_dir):
    ids, mask = encode(tiny_llama_dir)
    short = _reserved(tiny_llama_dir, "2-uneven", ids.shape[1] + 2)
    with pytest.raises(StageInputError, match="reserved at load holds"):
        generate_partitioned(short, ids, mask, SamplingParams(max_new_tokens=MAX_NEW))


def test_more_micro_batches_than_reserved_are_refused_and_a_dropped_one_frees_its_cache(tiny_llama_dir):
    ids, mask = encode(tiny_llama_dir)
    stage = StageExecutor(tiny_llama_dir, 0, 6, kv=KvReservation(groups=1, sequences=3, context_tokens=64))
    stage.prefill(0, ids, mask)
    with pytest.raises(StageInputError, match="in use"):
        stage.prefill(1, ids, mask)
    stage.drop(0)
    stage.prefill(1, ids, mask)  # the slot is back


def test_an_emulated_budget_counts_the_reserved_kv_cache_at_load():
    emulation = DeviceEmulation(memory_budget_bytes=10 * 2**20)
    emulation.check_shard("dev-a", 6 * 2**20, (0, 3))  # weights alone fit
    with pytest.raises(ShardOverBudget, match="reserved KV cache"):
        emulation.check_shard("dev-a", 6 * 2**20, (0, 3), kv_bytes=5 * 2**20)
