"""agents.step_inputs: a stage's rotary table and its direct block calls give exactly what
transformers' own modules give (the reference: the rotary module's forward, the block called as a module)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from agents.step_inputs import RotaryTable, block_forward


def config(**rope) -> LlamaConfig:
    return LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                     **rope})


def left_padded_positions(rows: int, width: int) -> torch.Tensor:
    mask = torch.ones(rows, width, dtype=torch.long)
    for i in range(rows):
        mask[i, : i % 3] = 0
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rotary_table_gives_the_rotary_modules_own_cos_and_sin_bit_for_bit(dtype):
    rotary = LlamaRotaryEmbedding(config())
    table = RotaryTable(rotary)
    hidden = torch.zeros(5, 1, 64, dtype=dtype)
    prompt = left_padded_positions(5, 7)
    steps = [prompt] + [prompt[:, -1:] + k for k in range(1, 40)]  # a prefill, then one position a step
    for positions in steps:
        got = table.embeddings(hidden, positions, int(positions.max()) + 1)
        want = rotary(hidden, position_ids=positions)
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want))
    assert table.usable and table.checked  # checked once, then every step was looked up


def test_a_rotary_type_that_rescales_with_the_length_is_never_tabled():
    rotary = LlamaRotaryEmbedding(config(rope_type="dynamic", factor=2.0))
    table = RotaryTable(rotary)
    positions = torch.tensor([[3], [700]])
    got = table.embeddings(torch.zeros(2, 1, 64), positions, 701)
    assert not table.usable and table.cos is None
    assert all(torch.equal(a, b) for a, b in zip(got, rotary(torch.zeros(2, 1, 64), position_ids=positions)))


def block_inputs():
    torch.manual_seed(0)
    cfg = config()
    cfg._attn_implementation = "sdpa"
    block = LlamaDecoderLayer(cfg, 0).eval()
    hidden = torch.randn(3, 4, 64)
    positions = torch.arange(4)[None].expand(3, -1)
    return block, hidden, {"position_ids": positions,
                           "position_embeddings": LlamaRotaryEmbedding(cfg)(hidden, position_ids=positions)}


def test_a_block_called_directly_gives_what_the_module_call_gives():
    block, hidden, kwargs = block_inputs()
    with torch.inference_mode():
        direct = block_forward(block)(hidden, **kwargs)
        module = block(hidden, **kwargs)
    assert block_forward(block) is not block and torch.equal(direct, module)


def test_a_block_with_a_hook_is_called_through_the_module_so_the_hook_runs():
    block, hidden, kwargs = block_inputs()
    seen = []
    block.register_forward_hook(lambda *_: seen.append(True))
    assert block_forward(block) is block
    with torch.inference_mode():
        block_forward(block)(hidden, **kwargs)
    assert seen == [True]


def test_a_rotary_module_that_answers_in_another_shape_is_asked_every_step():
    class Unbatched(torch.nn.Module):  # [positions, D], no batch dimension: not a table's rows
        rope_type = "default"

        def forward(self, x, position_ids):
            angle = position_ids.float()[..., None].expand(*position_ids.shape, 8)
            return angle.cos().flatten(0, -2), angle.sin().flatten(0, -2)

    rotary = Unbatched()
    table = RotaryTable(rotary)
    positions = torch.tensor([[4], [9]])
    got = table.embeddings(torch.zeros(2, 1, 8), positions, 10)
    assert not table.usable and all(torch.equal(a, b) for a, b in zip(got, rotary(None, positions)))


def test_a_decode_steps_grown_mask_and_positions_are_a_fresh_count_through_room_refills_and_replaced_masks():
    """``_GroupState.grow`` (a view of a buffer of ones, the last positions plus one) gives what appending an
    attended column and counting the attended columns gives, past its buffer's end and after something else
    (a join's extend, a shrink's keep_rows, a speculative rewind's view of the buffer) replaced the mask."""
    from agents.shard import MASK_ROOM, _GroupState

    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]])
    state, reference = _GroupState(cache=None, mask=mask), mask
    for step in range(3 * MASK_ROOM):
        if step == MASK_ROOM // 2:  # replaced elsewhere: rows kept, leading columns dropped
            reference = state.mask = reference[[0, 2], 1:].clone()
        if step == MASK_ROOM:  # a rewind: a view of the buffer itself, its last columns cut
            state.mask, reference = state.mask[:, :-3], reference[:, :-3]
        positions = state.grow()
        reference = torch.cat([reference, torch.ones(reference.shape[0], 1, dtype=torch.long)], dim=1)
        assert torch.equal(state.mask, reference)
        assert torch.equal(positions, reference.sum(-1, keepdim=True) - 1)
