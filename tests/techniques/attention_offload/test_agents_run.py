"""The dense side and the memory sides as real agents (issue 15): the coordinator loads the
dense stage kind with its memory agents as services, q/k/v and outputs travel over the agents'
data plane, and tokens equal HF generate (greedy) and the unsplit model (seeded)."""

from __future__ import annotations

import pytest
import torch
import transformers  # noqa: F401  (imported once here: agents' worker threads import it concurrently)

from agents.techniques.attention_offload.data_plane import DenseAgentExecutor, mask_mode, next_mask, resolve_mask
from agents.techniques.attention_offload.heads import HeadShape
from agents.protocol import SamplingSpec
from core.errors import RunFailed
from core.runs.coordinator import Coordinator, RunRequest
from core.runs.generation import load_tokenizer
from core.techniques.attention_offload.cost import layer_wire_bytes
from core.techniques.attention_offload.run import checkpoint_model, run_offload
from tests.core.hf_reference import hf_greedy_new_tokens, hf_seeded_new_tokens
from tests.core.in_process_agents import in_process_cluster

PROMPTS = ["the cat sat", "a longer prompt about the river", "hello"]
MAX_NEW = 6


@pytest.fixture(scope="module")
def cluster():
    with in_process_cluster(["dense", "mem-0", "mem-1"]) as (coordinator, agents):
        yield coordinator, {a.device: a for a in agents}


def _request(model_dir, sampling=SamplingSpec(), max_new=MAX_NEW):
    enc = load_tokenizer(model_dir)(PROMPTS, return_tensors="pt", padding=True)
    req = RunRequest(input_ids=tuple(map(tuple, enc["input_ids"].tolist())),
                     attention_mask=tuple(map(tuple, enc["attention_mask"].tolist())),
                     max_new_tokens=max_new, eos_token_ids=(2,), pad_token_id=0, sampling=sampling)
    return enc, req


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_dense_agent_and_two_memory_agents_give_the_tokens_of_hf_generate(cluster, tiny_model_dirs, family):
    coordinator, agents = cluster
    model_dir = tiny_model_dirs[family]
    enc, req = _request(model_dir)
    result = run_offload(coordinator, model_dir, "dense", ["mem-0", "mem-1"], req)
    assert [list(t) for t in result.tokens] == [list(t) for t in hf_greedy_new_tokens(model_dir, enc, MAX_NEW)]
    executor = agents["dense"]._loaded.executor
    assert isinstance(executor, DenseAgentExecutor)
    assert executor.router.calls == MAX_NEW * HeadShape.of(model_dir).layers


def test_the_dense_side_holds_no_key_or_value_and_the_memory_sides_hold_the_whole_cache(tiny_llama_dir):
    """After a prefill, the KV cache is on the attention sides, by the model's own geometry
    (layers × 2 × kv heads × tokens × head dim × 4 B), and no tensor is in the dense side's cache (any
    attribute of any of its layers, not only ``keys``/``values``) though it tracks the length."""
    from agents.techniques.attention_offload.heads import DenseExecutor, attention_stores

    enc, _ = _request(tiny_llama_dir)
    stores = attention_stores(tiny_llama_dir, 2)
    shape = HeadShape.of(tiny_llama_dir)
    dense = DenseExecutor(tiny_llama_dir, 0, shape.layers + 2, sides=stores)
    dense.prefill(0, enc["input_ids"], enc["attention_mask"])
    rows, tokens = enc["input_ids"].shape
    assert sum(s.kv_bytes() for s in stores) == shape.layers * 2 * shape.kv_heads * rows * tokens * shape.head_dim * 4
    cache = dense._groups[0].cache
    assert cache.get_seq_length() == tokens
    held = [name for layer in cache.layers for name, v in vars(layer).items() if isinstance(v, torch.Tensor)]
    assert held == []


def test_seeded_sampling_gives_transformers_generate_with_the_same_draws(cluster, tiny_llama_dir):
    coordinator, _ = cluster
    spec = SamplingSpec(temperature=0.9, top_p=0.9, seed=5)
    enc, req = _request(tiny_llama_dir, spec)
    result = run_offload(coordinator, tiny_llama_dir, "dense", ["mem-0", "mem-1"], req)
    rows = tuple(range(len(PROMPTS)))  # one batch: one draw per step over every row
    expected = hf_seeded_new_tokens(tiny_llama_dir, enc, MAX_NEW, [rows], temperature=0.9, top_p=0.9, seed=5)
    assert [tuple(t) for t in result.tokens] == [tuple(t) for t in expected]


def test_the_timeline_has_dense_spans_transfers_and_attention_spans_on_the_memory_agents(cluster, tiny_llama_dir):
    coordinator, _ = cluster
    _, req = _request(tiny_llama_dir, max_new=3)
    result = run_offload(coordinator, tiny_llama_dir, "dense", ["mem-0", "mem-1"], req)
    layers = HeadShape.of(tiny_llama_dir).layers
    by = lambda device, kind: [e for e in result.events if e.device == device and e.kind == kind]  # noqa: E731
    for mem in ("mem-0", "mem-1"):
        attention = by(mem, "compute")
        assert len(attention) == 3 * layers  # one per layer and step (prefill + 2 decode steps)
        assert {e.step for e in attention} == {0, 1, 2}
        sends = [e for e in by("dense", "send") if e.peer == mem]
        assert len(sends) == 3 * layers and all(e.nbytes > 0 for e in sends)
        assert len(by(mem, "send")) == 3 * layers
    # dense segments: one before each layer's attention and one after the last, per step
    assert len(by("dense", "compute")) == 3 * (layers + 1)


def test_the_agents_are_free_after_a_run_and_a_second_run_works(cluster, tiny_llama_dir):
    coordinator, agents = cluster
    enc, req = _request(tiny_llama_dir, max_new=2)
    expected = [list(t) for t in hf_greedy_new_tokens(tiny_llama_dir, enc, 2)]
    first = run_offload(coordinator, tiny_llama_dir, "dense", ["mem-0", "mem-1"], req).tokens
    assert all(agents[m]._state.value == "idle" for m in ("mem-0", "mem-1"))
    second = run_offload(coordinator, tiny_llama_dir, "dense", ["mem-1", "mem-0"], req).tokens
    assert [list(t) for t in first] == [list(t) for t in second] == expected


def test_memory_agents_that_are_the_dense_one_or_repeated_are_refused(cluster, tiny_llama_dir):
    coordinator, _ = cluster
    _, req = _request(tiny_llama_dir, max_new=1)
    with pytest.raises(RunFailed, match="different devices"):
        run_offload(coordinator, tiny_llama_dir, "dense", ["dense"], req)
    with pytest.raises(RunFailed, match="different devices"):
        run_offload(coordinator, tiny_llama_dir, "dense", ["mem-0", "mem-0"], req)


def test_the_mask_is_sent_only_when_the_memory_side_cannot_derive_it():
    prefill = torch.tensor([[[[False, True, False], [False, True, True]]]])
    assert mask_mode(None, prefill) == "full"
    assert mask_mode(prefill, prefill) == "same"
    step = torch.tensor([[[[False, True, True, True]]]])
    assert mask_mode(prefill, step) == "next"
    assert torch.equal(resolve_mask(prefill, "next", None), step) and torch.equal(next_mask(prefill), step)
    assert mask_mode(prefill, torch.tensor([[[[True, True, True, True]]]])) == "full"
    assert mask_mode(prefill, None) == "none"


def test_decode_traffic_is_the_predicted_tensors_exactly_plus_the_headers_the_cost_model_counts(
        cluster, tiny_llama_dir):
    coordinator, agents = cluster
    counted = {}
    for max_new in (1, 4):
        _, req = _request(tiny_llama_dir, max_new=max_new)
        run_offload(coordinator, tiny_llama_dir, "dense", ["mem-0", "mem-1"], req)
        router = agents["dense"]._loaded.executor.router
        counted[max_new] = (router.wire_bytes, router.header_bytes)
    model = checkpoint_model(tiny_llama_dir)
    batch, steps = len(PROMPTS), 3
    tensors = counted[4][0] - counted[1][0]
    headers = counted[4][1] - counted[1][1]
    assert tensors == steps * batch * model.layers * model.wire_bytes_per_token_layer()  # no mask bytes at all
    measured = (tensors + headers) / (steps * model.layers)
    assert measured / layer_wire_bytes(model, batch, 2) == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("heartbeat_timeout_s", [2.0, 60.0], ids=["heartbeats", "data-plane"])
def test_a_memory_agent_killed_mid_decode_fails_fast_naming_it_and_the_survivors_run_again(
        tiny_llama_dir, tmp_path, heartbeat_timeout_s):
    """Found by the coordinator's heartbeats, or (heartbeats too slow to notice) by the dense agent
    when the memory agent's data connection drops: either way well before the 60 s answer timeout."""
    import dataclasses

    from core.devices.local_cluster import LocalCluster
    from core.errors import MemoryAgentLost
    from tests.techniques.attention_offload.killing import kill_mid_decode

    _, req = _request(tiny_llama_dir, max_new=400)
    req = dataclasses.replace(req, eos_token_ids=())  # long enough to be mid-run when m1 dies
    with LocalCluster(tmp_path / "cluster", ["c0", "m0", "m1"]) as lc, \
            Coordinator(lc.endpoints, lc.keys, heartbeat_timeout_s=heartbeat_timeout_s) as co:
        co.wait_ready(timeout_s=30)
        error, seconds = kill_mid_decode(co, lc, "m1", lambda: run_offload(co, tiny_llama_dir, "c0", ["m0", "m1"], req))
        assert isinstance(error, MemoryAgentLost) and error.device == "m1" and seconds < 20
        assert "memory agent m1 was lost mid-run" in str(error) and "restart its agent" in str(error)
        enc, short = _request(tiny_llama_dir, max_new=3)
        again = run_offload(co, tiny_llama_dir, "c0", ["m0"], short)  # the survivors, no stuck hold
        assert [list(t) for t in again.tokens] == [list(t) for t in hf_greedy_new_tokens(tiny_llama_dir, enc, 3)]


def test_attend_frames_without_their_spec_and_masks_that_refer_to_nothing_are_refused():
    from agents.protocol import DataHeader, ProtocolError, decode_data, encode_data_header, options_slot
    from agents.techniques.attention_offload.messages import AttendSpec
    from agents.stage_input import StageInputError

    bare = DataHeader(run_id="r", kind="attend", phase="decode", step=1, micro_batch=0, sender="x", tensors=())
    with pytest.raises(ProtocolError, match="attend frames carry AttendSpec options"):
        decode_data([encode_data_header(bare)], 1 << 20)
    bad = DataHeader(run_id="r", kind="attended", phase="decode", step=1, micro_batch=0, sender="x", tensors=(),
                     options=options_slot(AttendSpec(layer=0, kv_start=2, kv_stop=1)))
    with pytest.raises(ProtocolError, match="kv_start"):
        decode_data([encode_data_header(bad)], 1 << 20)
    with pytest.raises(StageInputError, match="never got"):
        resolve_mask(None, "next", None)
