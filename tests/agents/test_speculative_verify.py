"""A verify trip's rollback on real layer-sharding stages (``agents.shard.StageExecutor.decode_positions``
/ ``rewind``), in process: after a rejected run of proposals, every stage's KV cache is what plain
decoding leaves."""

from __future__ import annotations

import pytest
import torch

from agents.shard import StageExecutor

PROMPT = [5, 17, 99, 3, 250, 11]


@pytest.fixture(scope="module")
def stages(tiny_llama_dir):
    """Two pipelines over the same checkpoint (6 units in 3 stages): one decodes plainly, one speculates."""
    return [[StageExecutor(tiny_llama_dir, a, b) for a, b in ((0, 2), (2, 4), (4, 6))] for _ in range(2)]


def through(pipeline, step) -> torch.Tensor:
    x = None
    for i, ex in enumerate(pipeline):
        x = step(ex, x if i else None)
    return x


def test_a_rejected_run_of_proposals_leaves_every_stage_cache_as_plain_decoding(stages):
    plain, speculative = stages
    ids = torch.tensor([PROMPT])
    mask = torch.ones_like(ids)
    first = [through(p, lambda ex, x: ex.prefill(0, ids if x is None else x, mask)).argmax(-1) for p in stages]
    assert torch.equal(first[0], first[1])
    tokens = [int(first[0])]
    for _ in range(3):  # plain greedy decoding: three tokens, one trip each
        last = torch.tensor([tokens[-1:]])
        tokens.append(int(through(plain, lambda ex, x: ex.decode(0, last if x is None else x)).argmax(-1)))
    wrong = [(t + 1) % 512 for t in tokens[1:4]]  # proposals the target rejects at once
    keep = len(PROMPT)
    verdict = through(speculative, lambda ex, x: ex.decode_positions(0, torch.tensor([[tokens[0], *wrong]]) if x is None else x,
                                                        keep)).argmax(-1)[0].tolist()
    assert verdict[0] == tokens[1] and verdict[0] != wrong[0]  # rejected at the first proposal; the bonus is plain's
    # the next trip proposes the right tokens over the rolled-back cache: all accepted
    verdict = through(speculative, lambda ex, x: ex.decode_positions(0, torch.tensor([tokens[:3]]) if x is None else x,
                                                        keep)).argmax(-1)[0].tolist()
    assert verdict[:2] == tokens[1:3]
    for a, b in zip(plain, speculative):  # plain saw prompt + 3 tokens; speculative the same after the rewind
        pa, pb = a._groups[0], b._groups[0]
        assert pb.mask.shape == pa.mask.shape == (1, keep + 3)
        for la, lb in zip(pa.cache.layers, pb.cache.layers):
            assert la.keys.shape[-2] == lb.keys.shape[-2] == keep + 3
            torch.testing.assert_close(lb.keys, la.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lb.values, la.values, rtol=1e-5, atol=1e-5)


def test_a_reserved_cache_rewinds_in_place_and_decodes_positions_as_plain_decoding_would(tiny_llama_dir):
    from agents.protocol import KvReservation

    reserved = StageExecutor(tiny_llama_dir, 0, 6, kv=KvReservation(groups=1, sequences=1, context_tokens=32))
    plain = StageExecutor(tiny_llama_dir, 0, 6)
    ids = torch.tensor([PROMPT])
    for ex in (reserved, plain):
        ex.prefill(0, ids, torch.ones_like(ids))
    reserved.decode_positions(0, torch.tensor([[9, 9, 9]]), len(PROMPT))  # proposals, then rejected
    x = torch.tensor([[7, 8]])
    torch.testing.assert_close(reserved.decode_positions(0, x, len(PROMPT)), plain.decode_positions(0, x, len(PROMPT)),
                               rtol=1e-5, atol=1e-5)


def test_a_rewind_past_the_cached_positions_is_refused(tiny_llama_dir):
    from agents.stage_input import StageInputError

    ex = StageExecutor(tiny_llama_dir, 0, 6)
    ex.prefill(0, torch.tensor([PROMPT]), torch.ones(1, len(PROMPT), dtype=torch.long))
    with pytest.raises(StageInputError, match="cannot keep"):
        ex.rewind(0, len(PROMPT) + 1)


def test_an_emulated_device_stage_is_verified_slowed_like_its_decode_steps(tiny_llama_dir):
    from agents.emulation import SlowedStage

    slowed, plain = SlowedStage(StageExecutor(tiny_llama_dir, 0, 6), 1.0), StageExecutor(tiny_llama_dir, 0, 6)
    ids = torch.tensor([PROMPT])
    for ex in (slowed, plain):
        ex.prefill(0, ids, torch.ones_like(ids))
    x = torch.tensor([[7, 8, 9]])
    torch.testing.assert_close(slowed.decode_positions(0, x, len(PROMPT)), plain.decode_positions(0, x, len(PROMPT)))
