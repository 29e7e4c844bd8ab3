"""Attention offloading split at the attention operator, in one process: dense sides (no KV
cache) and 1-3 attention sides (KV of their heads) give the tokens and logits of the unsplit
model's ``generate()``; the traffic per token and layer is Lamina's (2·h_q + 2·h_kv)·head_dim."""

from __future__ import annotations

import types

import pytest
import torch

from agents.techniques.attention_offload.heads import (
    AttentionStore,
    DenseExecutor,
    HeadRouter,
    HeadShape,
    attention_stores,
    split_heads,
)
from agents.checkpoint_reader import CheckpointError
from agents.local_pipeline import generate_partitioned
from agents.sampling import SamplingParams
from core.models.checkpoints import make_model
from tests.agents.conftest import tiny_recipe
from tests.agents.test_shard_equivalence import MAX_NEW, encode, hf_generate, hf_greedy

FAMILIES = ("llama", "qwen2", "mistral", "gpt2")
PARAMS = SamplingParams(max_new_tokens=MAX_NEW, eos_token_ids=(2,), pad_token_id=0)


@pytest.fixture(scope="module")
def four_kv_head_dirs(tmp_path_factory) -> dict[str, str]:
    """Checkpoints with 4 key/value heads, so 3 attention sides get an uneven 2/1/1 split."""
    root = tmp_path_factory.mktemp("kv4")
    return {f: str(make_model(tiny_recipe(f, kv_heads=4) if f != "gpt2" else tiny_recipe(f), root / f))
            for f in ("llama", "qwen2")}


def _offloaded(model_dir, sides, partition=((0, 6),)):
    stores = attention_stores(model_dir, sides)
    return [DenseExecutor(model_dir, a, b, sides=stores) for a, b in partition], stores


@pytest.mark.parametrize("sides", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_offloaded_attention_gives_the_tokens_and_logits_of_hf_generate(tiny_model_dirs, family, sides):
    model_dir = tiny_model_dirs[family]
    ids, mask = encode(model_dir)
    expected_tokens, expected_logits = hf_greedy(model_dir)
    dense, _ = _offloaded(model_dir, sides)
    result = generate_partitioned(dense, ids, mask, PARAMS, keep_logits=True)
    assert ids.shape[0] == 3 and torch.equal(result.tokens, expected_tokens)
    torch.testing.assert_close(torch.stack(result.step_logits, dim=1), expected_logits, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_three_attention_sides_with_uneven_heads_give_the_tokens_of_hf_generate(four_kv_head_dirs, family):
    model_dir = four_kv_head_dirs[family]
    ids, mask = encode(model_dir)
    expected_tokens, _ = hf_generate(model_dir)
    dense, stores = _offloaded(model_dir, 3)
    assert [len(s.kv_heads) for s in stores] == [2, 1, 1]
    assert torch.equal(generate_partitioned(dense, ids, mask, PARAMS).tokens, expected_tokens)


def test_dense_sides_sharded_by_layers_share_the_attention_sides(tiny_llama_dir):
    ids, mask = encode(tiny_llama_dir)
    expected_tokens, _ = hf_greedy(tiny_llama_dir)
    dense, _ = _offloaded(tiny_llama_dir, 2, partition=((0, 3), (3, 6)))
    assert torch.equal(generate_partitioned(dense, ids, mask, PARAMS).tokens, expected_tokens)


def test_the_dense_side_holds_no_kv_cache_and_the_attention_sides_hold_all_of_it(tiny_llama_dir):
    ids, mask = encode(tiny_llama_dir)
    shape = HeadShape.of(tiny_llama_dir)
    dense, stores = _offloaded(tiny_llama_dir, 2)
    seen = []

    def measure(step, _tokens):
        seen.append((dense[0].kv_bytes(), sum(s.kv_bytes() for s in stores), stores[0].cached_tokens(0)))

    generate_partitioned(dense, ids, mask, SamplingParams(max_new_tokens=MAX_NEW), on_step=measure)
    batch, prompt = ids.shape
    for step, (dense_bytes, memory_bytes, cached) in enumerate(seen):
        assert dense_bytes == 0
        assert cached == prompt + step
        assert memory_bytes == 2 * shape.layers * batch * shape.kv_heads * cached * shape.head_dim * 4
    assert sum(s.kv_bytes() for s in stores) == 0  # the run's end dropped its group everywhere


def test_the_traffic_per_decoded_token_and_layer_is_two_query_and_two_kv_heads_sizes(tiny_llama_dir):
    ids, mask = encode(tiny_llama_dir)
    shape = HeadShape.of(tiny_llama_dir)
    dense, _ = _offloaded(tiny_llama_dir, 2)
    router = dense[0].router
    dense[0].prefill(0, ids, mask)
    before = router.wire_bytes
    dense[0].decode(0, torch.zeros((ids.shape[0], 1), dtype=torch.long))
    per_token_layer = (router.wire_bytes - before) / (ids.shape[0] * shape.layers)
    assert per_token_layer == shape.wire_elements_per_token_layer() * 4
    assert shape.wire_elements_per_token_layer() == (2 * 4 + 2 * 2) * 16


def test_two_batches_in_flight_on_the_same_attention_sides_keep_their_own_caches(tiny_llama_dir):
    ids, mask = encode(tiny_llama_dir)
    expected_tokens, _ = hf_greedy(tiny_llama_dir)
    stores = attention_stores(tiny_llama_dir, 2)
    dense = DenseExecutor(tiny_llama_dir, 0, 6, sides=stores)
    batches = {0: (ids, mask, expected_tokens), 1: (ids.flip(0), mask.flip(0), expected_tokens.flip(0))}
    tokens = {g: [dense.prefill(g, i, m).argmax(-1)] for g, (i, m, _) in batches.items()}
    for _ in range(MAX_NEW - 1):
        for g in batches:  # interleaved, as batches in flight are
            tokens[g].append(dense.decode(g, tokens[g][-1][:, None]).argmax(-1))
    for g, (_, _, expected) in batches.items():
        eos = (expected == 2).long()
        until_eos = (eos.cumsum(1) - eos) == 0  # generate() pads after a row's EOS
        assert torch.equal(torch.stack(tokens[g], dim=1)[until_eos], expected[until_eos])


def test_more_attention_sides_than_key_value_heads_is_refused_naming_the_limit(tiny_llama_dir):
    with pytest.raises(CheckpointError, match="at most 2 memory devices"):
        attention_stores(tiny_llama_dir, 3)
    assert split_heads(5, 2) == [range(0, 3), range(3, 5)]


def test_attention_sides_that_do_not_cover_every_head_once_are_refused(tiny_llama_dir):
    shape = HeadShape.of(tiny_llama_dir)
    with pytest.raises(CheckpointError, match="cover 0..1 once each"):
        HeadRouter(shape, [AttentionStore(shape, range(0, 1))])
    with pytest.raises(CheckpointError, match="not inside"):
        AttentionStore(shape, range(1, 3))


def test_an_emulated_slowdown_stretches_the_dense_segments_not_the_waits_for_the_memory_agents(compute_clock):
    import agents.techniques.attention_offload.data_plane as ao
    from agents.emulation import DeviceEmulation

    events = []

    class Agent:
        emulation = DeviceEmulation(compute_slowdown=3.0)
        clock = staticmethod(compute_clock.perf_counter)

        def event(self, kind, phase, step, group, start, end, nbytes, peer):
            events.append((kind, round(end - start, 6)))

    router = ao.DataPlaneRouter.__new__(ao.DataPlaneRouter)  # its timing only: no sockets
    router.agent, router.step, router.group = Agent(), 1, 0
    router._open_segment()
    compute_clock.run(0.010, 0.010)  # dense work up to the first attention
    router._close_segment()
    compute_clock.run(0.500, 0.0)  # waiting for the memory agents' answers: not computation
    router._open_segment()
    compute_clock.run(0.002, 0.002)
    router._close_segment()
    assert compute_clock.slept == pytest.approx([0.020, 0.004])
    assert events == [("compute", 0.030), ("compute", 0.006)]


def test_a_dense_segment_that_waited_for_a_core_ends_three_times_its_cpu_time_after_it_began(compute_clock):
    """3x slower, a segment of 2 ms CPU that took 5 ms (3 ms waiting for a core another agent of
    the host used) lasts 6 ms in all, not 3 x 5 ms."""
    import agents.techniques.attention_offload.data_plane as ao
    from agents.emulation import DeviceEmulation

    agent = types.SimpleNamespace(emulation=DeviceEmulation(compute_slowdown=3.0), clock=compute_clock.perf_counter,
                                  event=lambda *a: None)
    router = ao.DataPlaneRouter.__new__(ao.DataPlaneRouter)  # its timing only: no sockets
    router.agent, router.step, router.group = agent, 1, 0
    router._open_segment()
    compute_clock.run(0.005, 0.002)
    router._close_segment()
    assert compute_clock.slept == pytest.approx([0.001])
