"""A verify trip's rollback on real layer-sharding stages (``agents.techniques.speculative.verify``),
in process: after a rejected run of proposals, every stage's KV cache is what plain decoding leaves."""

from __future__ import annotations

import pytest
import torch

from agents.shard import StageExecutor
from agents.techniques.speculative.verify import verify

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
    verdict = through(speculative, lambda ex, x: verify(ex, 0, torch.tensor([[tokens[0], *wrong]]) if x is None else x,
                                                        keep)).argmax(-1)[0].tolist()
    assert verdict[0] == tokens[1] and verdict[0] != wrong[0]  # rejected at the first proposal; the bonus is plain's
    # the next trip proposes the right tokens over the rolled-back cache: all accepted
    verdict = through(speculative, lambda ex, x: verify(ex, 0, torch.tensor([tokens[:3]]) if x is None else x,
                                                        keep)).argmax(-1)[0].tolist()
    assert verdict[:2] == tokens[1:3]
    for a, b in zip(plain, speculative):  # plain saw prompt + 3 tokens; speculative the same after the rewind
        pa, pb = a._groups[0], b._groups[0]
        assert pb.mask.shape == pa.mask.shape == (1, keep + 3)
        for la, lb in zip(pa.cache.layers, pb.cache.layers):
            assert la.keys.shape[-2] == lb.keys.shape[-2] == keep + 3
            torch.testing.assert_close(lb.keys, la.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lb.values, la.values, rtol=1e-5, atol=1e-5)


def test_a_verify_step_on_a_stage_of_another_kind_is_refused():
    from agents.stage_input import StageInputError

    class Other(StageExecutor):
        def __init__(self):
            pass

    with pytest.raises(StageInputError, match="layer-sharding stages"):
        verify(Other(), 0, torch.tensor([[1]]), 0)


def test_an_emulated_device_stage_is_verified_slowed_like_its_decode_steps(tiny_llama_dir):
    from agents.emulation import SlowedStage

    slowed, plain = SlowedStage(StageExecutor(tiny_llama_dir, 0, 6), 1.0), StageExecutor(tiny_llama_dir, 0, 6)
    ids = torch.tensor([PROMPT])
    for ex in (slowed, plain):
        ex.prefill(0, ids, torch.ones_like(ids))
    x = torch.tensor([[7, 8, 9]])
    torch.testing.assert_close(verify(slowed, 0, x, len(PROMPT)), verify(plain, 0, x, len(PROMPT)))
