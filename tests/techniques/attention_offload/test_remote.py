"""Memory sides as real agents: a dense side sends each layer's q, k, v to two local agents over
CurveZMQ (AttendHeads, raw frames) and gets HF generate()'s tokens; bad requests are refused by
name and the agents stay up."""

from __future__ import annotations

import pytest
import torch

from agents.techniques.attention_offload.heads import DenseExecutor, HeadShape, split_heads
from agents.local_pipeline import generate_partitioned
from agents.protocol import Ping, Pong, ProtocolError, decode_control, encode_control
from agents.techniques.attention_offload.messages import AttendHeads
from agents.sampling import SamplingParams
from core.devices.agent_link import AgentLink
from core.devices.local_cluster import LocalCluster
from core.errors import RunFailed
from core.techniques.attention_offload.remote import RemoteAttentionSide
from tests.agents.test_shard_equivalence import MAX_NEW, encode, hf_greedy


@pytest.fixture(scope="module")
def link(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("attention-offload"), 2) as lc:
        with AgentLink(lc.endpoints, lc.keys, heartbeat_timeout_s=30.0, request_timeout_s=60.0) as link:
            link.wait_ready(timeout_s=30)
            yield link


def _remote_sides(link, model_dir):
    shape = HeadShape.of(model_dir)
    return [RemoteAttentionSide(link, f"local-{i}", model_dir, heads)
            for i, heads in enumerate(split_heads(shape.kv_heads, 2))]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_two_memory_agents_give_the_tokens_and_logits_of_hf_generate(link, tiny_model_dirs, family):
    model_dir = tiny_model_dirs[family]
    ids, mask = encode(model_dir)
    expected_tokens, expected_logits = hf_greedy(model_dir)
    sides = _remote_sides(link, model_dir)
    dense = DenseExecutor(model_dir, 0, 6, sides=sides)
    result = generate_partitioned([dense], ids, mask,
                                  SamplingParams(max_new_tokens=MAX_NEW, eos_token_ids=(2,), pad_token_id=0),
                                  keep_logits=True)
    assert torch.equal(result.tokens, expected_tokens)
    torch.testing.assert_close(torch.stack(result.step_logits, dim=1), expected_logits, atol=1e-5, rtol=1e-4)
    assert dense.kv_bytes() == 0 and all(s.wire_bytes > 0 for s in sides)


def test_the_bytes_on_the_wire_per_decoded_token_and_layer_are_the_predicted_plus_framing(link, tiny_llama_dir):
    ids, mask = encode(tiny_llama_dir)
    shape = HeadShape.of(tiny_llama_dir)
    sides = _remote_sides(link, tiny_llama_dir)
    dense = DenseExecutor(tiny_llama_dir, 0, 6, sides=sides)
    dense.prefill(7, ids, mask)
    before = sum(s.wire_bytes for s in sides)
    dense.decode(7, torch.zeros((ids.shape[0], 1), dtype=torch.long))
    per = (sum(s.wire_bytes for s in sides) - before) / (ids.shape[0] * shape.layers)
    predicted = shape.wire_elements_per_token_layer() * 4
    mask_bytes = ids.shape[1] + 1  # the uint8 mask row of one query over the cache
    assert predicted <= per <= (predicted + mask_bytes) * 1.6  # msgpack framing of 2 small messages per side
    dense.drop(7)


def test_wrong_sizes_are_refused_at_decode_and_a_wrong_layer_by_the_agent_which_answers_after(link, tiny_llama_dir):
    bad = AttendHeads(model_dir=tiny_llama_dir, kv_start=0, kv_stop=1, group=0, layer=0, q_shape=(1, 2, 1, 16),
                      kv_shape=(1, 1, 1, 16), query=b"\0" * 8, key=b"\0" * 64, value=b"\0" * 64)
    with pytest.raises(ProtocolError, match="query holds 8 bytes"):
        decode_control(encode_control(bad))
    wrong_heads = AttendHeads(model_dir=tiny_llama_dir, kv_start=0, kv_stop=2, group=0, layer=99,
                              q_shape=(1, 4, 1, 16), kv_shape=(1, 2, 1, 16), query=b"\0" * 256, key=b"\0" * 128,
                              value=b"\0" * 128)
    with pytest.raises(RunFailed, match="attention"):
        link.request("local-0", wrong_heads, timeout_s=20)
    assert isinstance(link.request("local-0", Ping(), timeout_s=20), Pong)
