"""EdgeMoE's agent side (agents.techniques.expert_offload): experts on storage, a bounded buffer, preloading.

Real Mixtral checkpoints (generated), real safetensors partial reads, real agents and the real
coordinator; tokens compared with HF generate of the unsplit model (greedy, batch 3)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers  # noqa: F401  (imported once here: agents' worker threads import it concurrently)

from agents.checkpoint_reader import CheckpointError
from agents.techniques.expert_offload.offload import ExpertBuffer, ExpertOffloadExecutor, ExpertStore
from agents.techniques.expert_offload.options import OffloadOptions
from agents.local_pipeline import generate_partitioned
from agents.sampling import SamplingParams
from agents.shard import StageExecutor
from core.models.checkpoints import ModelRecipe, make_model
from core.planning.plan import plan_from_boundaries
from core.runs.coordinator import RunRequest
from core.runs.generation import load_tokenizer
from tests.agents.test_shard_equivalence import encode, hf_generate
from tests.core.hf_reference import hf_greedy_new_tokens
from tests.core.in_process_agents import in_process_cluster

EXPERTS = 8
LAYERS = 4
MAX_NEW = 10
PARAMS = SamplingParams(max_new_tokens=MAX_NEW, eos_token_ids=(2,), pad_token_id=0)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    recipe = ModelRecipe(family="mixtral", layers=LAYERS, hidden=64, heads=4, kv_heads=2, vocab=512, seed=7,
                         experts=EXPERTS)
    return str(make_model(recipe, tmp_path_factory.mktemp("moe") / "tiny-mixtral"))


def _offloaded(moe_dir, start=0, end=LAYERS + 2, **options) -> ExpertOffloadExecutor:
    return ExpertOffloadExecutor(moe_dir, start, end, **options)


@pytest.mark.parametrize("policy", ["edgemoe", "lru", "lfu"])
def test_full_precision_tokens_equal_hf_generate_with_a_buffer_smaller_than_one_layer(moe_dir, policy):
    ids, mask = encode(moe_dir)
    expected, _ = hf_generate(moe_dir, MAX_NEW)
    executor = _offloaded(moe_dir, slots=3, policy=policy, preload=2)
    try:
        result = generate_partitioned([executor], ids, mask, PARAMS)
    finally:
        executor.close()
    assert torch.equal(result.tokens, expected)
    assert executor.stats()["misses"] > 0  # experts really came from storage


def test_the_stage_never_holds_more_experts_than_its_buffer(moe_dir):
    ids, mask = encode(moe_dir)
    executor = _offloaded(moe_dir, slots=3, preload=2)
    try:
        generate_partitioned([executor], ids, mask, PARAMS)
    finally:
        executor.close()
    stats = executor.stats()
    assert stats["peak_slots"] == 3
    assert stats["peak_expert_bytes"] <= 3 * executor.expert_bytes()
    whole = StageExecutor(moe_dir, 0, LAYERS + 2)
    experts_in_model = LAYERS * EXPERTS * executor.expert_bytes()
    assert whole.memory_bytes() - executor.resident_bytes() == experts_in_model  # no expert weight is resident
    assert executor.memory_bytes() == executor.resident_bytes() + 3 * executor.expert_bytes()


def test_a_stage_reads_only_its_own_blocks_experts_and_composes_with_layer_sharding(moe_dir):
    ids, mask = encode(moe_dir)
    expected, _ = hf_generate(moe_dir, MAX_NEW)
    middle = _offloaded(moe_dir, 2, 4, slots=2)  # blocks 1 and 2
    try:
        chain = [StageExecutor(moe_dir, 0, 2), middle, StageExecutor(moe_dir, 4, LAYERS + 2)]
        result = generate_partitioned(chain, ids, mask, PARAMS)
    finally:
        middle.close()
    assert torch.equal(result.tokens, expected)
    assert middle.store.layers_read == {1, 2}
    assert not any(".experts." in name for name in middle.reader.read_names)  # resident part: no experts


def test_preloading_turns_misses_into_hits(moe_dir):
    ids, mask = encode(moe_dir)
    figures = {}
    for preload in (0, 3):
        executor = _offloaded(moe_dir, slots=12, preload=preload)
        try:
            generate_partitioned([executor], ids, mask, PARAMS)
        finally:
            executor.close()
        figures[preload] = executor.stats()
    assert figures[0]["preloads"] == 0 and figures[3]["preloads"] > 0
    assert figures[3]["preload_hits"] > 0


def test_storage_bandwidth_limit_makes_reads_take_bytes_over_bandwidth(moe_dir):
    store = ExpertStore(moe_dir, "model.layers.", torch.float32, bandwidth_bps=2e6)
    gate_up, down = store.read(0, 1)
    nbytes = (gate_up.numel() + down.numel()) * 4
    assert store.bytes_read == nbytes
    assert store.read_s >= nbytes / 2e6


def test_a_full_buffer_evicts_the_least_recently_used_under_lru():
    reads = []
    buffer = ExpertBuffer(2, lambda layer, e: reads.append((layer, e)) or (torch.zeros(1), torch.zeros(1)),
                          num_layers=4, policy="lru")
    for key in [(0, 0), (0, 1), (0, 0), (0, 2)]:
        buffer.acquire(key)
        buffer.release(key)
    assert buffer.held() == [(0, 0), (0, 2)] and buffer.evictions == 1


def test_edgemoe_eviction_keeps_the_experts_of_layers_about_to_run():
    buffer = ExpertBuffer(2, lambda layer, e: (torch.zeros(1), torch.zeros(1)), num_layers=4, policy="edgemoe")
    for key in [(1, 0), (3, 0), (0, 5)]:  # now at layer 0: layer 1 runs next, layer 3 last
        buffer.acquire(key)
        buffer.release(key)
    assert (1, 0) in buffer.held() and (3, 0) not in buffer.held()


@pytest.mark.parametrize("options, words", [
    ({"slots": 0}, "at least 1 slot"),
    ({"policy": "fifo"}, "eviction policy"),
    ({"preload": -1}, "preload"),
    ({"bandwidth_bps": 0}, "bandwidth"),
])
def test_bad_options_are_refused_naming_the_option(moe_dir, options, words):
    with pytest.raises(CheckpointError, match=words):
        _offloaded(moe_dir, **options)


def test_a_dense_model_is_refused(tiny_llama_dir):
    with pytest.raises(CheckpointError, match="Mixtral"):
        ExpertOffloadExecutor(tiny_llama_dir, 0, 6)


def test_a_stage_without_moe_blocks_is_refused(moe_dir):
    with pytest.raises(CheckpointError, match="no MoE block"):
        _offloaded(moe_dir, 0, 1)


@pytest.fixture
def coordinator_and_agents():
    with in_process_cluster(["a", "b"]) as cluster:
        yield cluster


def _assert_greedy_run_equals_hf(coordinator, plan, model_dir) -> None:
    """Three padded prompts, 6 greedy tokens over the agents: exactly HF generate()'s."""
    tok = load_tokenizer(str(model_dir))
    enc = tok(["the cat sat", "a longer prompt about the river", "hello"], return_tensors="pt", padding=True)
    result = coordinator.run(plan, RunRequest(
        input_ids=tuple(map(tuple, enc["input_ids"].tolist())),
        attention_mask=tuple(map(tuple, enc["attention_mask"].tolist())),
        max_new_tokens=6, eos_token_ids=(2,), pad_token_id=0))
    assert list(result.tokens) == hf_greedy_new_tokens(str(model_dir), enc, 6)


def test_an_agent_runs_the_expert_offload_stage_kind_from_the_coordinator_with_exact_tokens(
        coordinator_and_agents, moe_dir, tmp_path):
    coordinator, (first, second) = coordinator_and_agents
    model_dir = tmp_path / "tiny-mixtral"
    shutil.copytree(moe_dir, model_dir)
    plan = plan_from_boundaries("tiny-mixtral", LAYERS + 2, ["a", "b"], [3])
    coordinator.load(plan, str(model_dir), kind={"a": "layers", "b": "expert-offload"},
                     options={"b": OffloadOptions(slots=2, policy="edgemoe", preload=1)})
    executor = second._loaded.executor
    assert isinstance(getattr(executor, "inner", executor), ExpertOffloadExecutor)

    _assert_greedy_run_equals_hf(coordinator, plan, model_dir)
    stats = getattr(executor, "inner", executor).stats()
    assert stats["peak_slots"] <= 2 and stats["misses"] > 0


def test_two_agents_each_offloading_its_own_blocks_experts_give_exact_tokens(coordinator_and_agents, moe_dir,
                                                                             tmp_path):
    coordinator, agents = coordinator_and_agents
    model_dir = tmp_path / "tiny-mixtral"
    shutil.copytree(moe_dir, model_dir)
    plan = plan_from_boundaries("tiny-mixtral", LAYERS + 2, ["a", "b"], [3])  # blocks 0-1 on a, 2-3 on b
    options = OffloadOptions(slots=2, policy="edgemoe", preload=1)
    coordinator.load(plan, str(model_dir), kind="expert-offload", options={"a": options, "b": options})
    executors = [getattr(a._loaded.executor, "inner", a._loaded.executor) for a in agents]
    assert all(isinstance(e, ExpertOffloadExecutor) for e in executors)
    _assert_greedy_run_equals_hf(coordinator, plan, model_dir)
    assert [e.store.layers_read for e in executors] == [{0, 1}, {2, 3}]
    for e in executors:
        assert e.stats()["misses"] > 0 and e.stats()["peak_slots"] <= 2
        assert not any(".experts." in name for name in e.reader.read_names)


def test_quantised_experts_read_fewer_bytes_and_stay_close(moe_dir, tmp_path):
    from agents.techniques.expert_offload.offload import write_quantized_experts

    model_dir = tmp_path / "q"
    shutil.copytree(moe_dir, model_dir)
    write_quantized_experts(str(model_dir), {(layer, e): 4 for layer in range(LAYERS) for e in range(EXPERTS)})
    full, quant = _offloaded(moe_dir, slots=1), _offloaded(str(model_dir), slots=1)
    full.close(), quant.close()
    a, b = full.store.read(0, 3), quant.store.weights(0, 3, quant.store.read(0, 3))
    assert quant.store.bytes_read < full.store.bytes_read / 6  # 4-bit codes + fp32 scales vs fp32
    assert (a[0] - b[0]).abs().max() <= a[0].abs().amax(1).max() / 7 / 2 + 1e-6  # half an INT4 step
    ids, mask = encode(moe_dir)
    executor = ExpertOffloadExecutor(str(model_dir), 0, LAYERS + 2, slots=3)
    try:
        generate_partitioned([executor], ids, mask, PARAMS)
    finally:
        executor.close()
    packed = sum(t.numel() * t.element_size() for t in quant.store.read(0, 3))
    assert executor.stats()["peak_expert_bytes"] <= 3 * packed  # the buffer holds them packed


def test_full_precision_perplexity_through_the_buffer_equals_the_resident_models(moe_dir):
    from agents.techniques.expert_offload.offload import perplexity

    texts = [[5, 17, 99, 3, 42, 7], [8, 9, 10, 300]]
    offloaded = _offloaded(moe_dir, slots=2)
    try:
        assert perplexity(offloaded, texts) == pytest.approx(perplexity(StageExecutor(moe_dir, 0, LAYERS + 2), texts),
                                                             rel=1e-6)
    finally:
        offloaded.close()


def test_expert_bits_without_the_quantised_file_are_refused(moe_dir, tmp_path):
    model_dir = tmp_path / "nofile"
    shutil.copytree(moe_dir, model_dir)
    (model_dir / "expert-offload.json").write_text(json.dumps({"expert_bits": {"0.1": 4}}))
    with pytest.raises(CheckpointError, match="experts-quantized"):
        ExpertOffloadExecutor(str(model_dir), 0, LAYERS + 2)
    (model_dir / "expert-offload.json").write_text(json.dumps({"expert_bits": {"0.1": 3}}))
    with pytest.raises(CheckpointError, match="expert_bits"):
        ExpertOffloadExecutor(str(model_dir), 0, LAYERS + 2)


def test_prompt_processing_reads_each_picked_expert_once_per_block(moe_dir):
    """EdgeMoE's re-batching by expert: a prompt's tokens are grouped by the expert they picked, so a
    prefill reads every expert its router picked exactly once per block, even with a 1-slot buffer."""
    tok = load_tokenizer(moe_dir)
    ids = torch.tensor([tok("the cat sat on the mat while a river ran through the long green valley")["input_ids"]])
    executor = _offloaded(moe_dir, slots=1, preload=0)
    try:
        executor.prefill(0, ids, torch.ones_like(ids))
        picked = executor.predictor.frequency
        loads = [key for outcome, key, *_ in executor.buffer.take_activity() if outcome == "load"]
    finally:
        executor.close()
    assert ids.shape[1] >= 12 and picked.sum() == ids.shape[1] * 2 * LAYERS  # every token picked top-2 in each block
    for block in range(LAYERS):
        distinct = {int(e) for e in picked[block].nonzero().flatten()}
        assert sorted(e for b, e in loads if b == block) == sorted(distinct)  # each once, none twice
