"""Quantized stages over three agent processes give exactly the tokens of the same model quantized
the same way in one process: torchao's ``quantize_`` on the HF model's decoder blocks (each block at
its stage's precision), transformers' own ``generate`` as the reference, greedy and seeded; each
agent holds the bytes the planner predicts for its stage."""

from __future__ import annotations

import msgspec
import pytest
import torch
import transformers
from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig
from torchao.quantization import Int8WeightOnlyConfig, quantize_

from agents.protocol import SamplingSpec
from agents.sampling import SamplingParams, sample, step_generator
from core.devices.local_cluster import LocalCluster
from core.models.checkpoints import ModelRecipe, make_model
from core.models.units import load_model_spec
from core.planning.plan import ShardPlan, plan_from_boundaries
from core.planning.precision import stage_weight_bytes
from core.runs.coordinator import Coordinator, RunRequest
from core.runs.generation import load_tokenizer

DEVICES = ["edge-a", "edge-b", "edge-c"]
BOUNDARIES = [2, 4]  # units 0-1 | 2-3 | 4-5: the blocks 0 | 1, 2 | 3
PROMPTS = ["the cat sat", "a much longer prompt about the river", "hello"]
MAX_NEW = 10
CONFIGS = {"int8": lambda: Int8WeightOnlyConfig(),
           "int4": lambda: PrototypeInt4WeightOnlyConfig(group_size=32, set_inductor_config=False)}
SEEDED = SamplingSpec(temperature=0.9, top_p=0.9, seed=5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    recipe = ModelRecipe(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3)
    return str(make_model(recipe, tmp_path_factory.mktemp("precision-runs") / "tiny-llama"))


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("precision-agents"), DEVICES) as cluster:
        with Coordinator(cluster.endpoints, cluster.keys) as co:
            co.wait_ready(60)
            yield co


def plan_at(weights: tuple[str, str, str]) -> ShardPlan:
    plan = plan_from_boundaries("tiny-llama", 6, DEVICES, BOUNDARIES)
    return msgspec.structs.replace(plan, stages=tuple(msgspec.structs.replace(s, weights=w)
                                                      for s, w in zip(plan.stages, weights)))


def encode(model_dir):
    return load_tokenizer(model_dir)(PROMPTS, return_tensors="pt", padding=True)


def agents_run(coordinator, plan, model_dir, sampling=SamplingSpec()):
    enc = encode(model_dir)
    coordinator.load(plan, model_dir, timeout_s=120)
    request = RunRequest(input_ids=tuple(map(tuple, enc["input_ids"].tolist())),
                         attention_mask=tuple(map(tuple, enc["attention_mask"].tolist())),
                         max_new_tokens=MAX_NEW, mode="sequential", micro_batches=1,
                         eos_token_ids=(2,), pad_token_id=0, sampling=sampling)
    return [list(t) for t in coordinator.run(plan, request).tokens]


class AgentsSeededDraw(transformers.LogitsProcessor):
    """Makes generate's greedy step pick the agents' seeded draw from the reference's own logits
    (agents.sampling: one generator per seed, micro-batch and step), so the model, its cache and its
    masks are transformers' while the draw is the one the run makes."""

    def __init__(self, spec: SamplingSpec, prompt_length: int):
        self.params = SamplingParams(temperature=spec.temperature, top_p=spec.top_p, seed=spec.seed)
        self.prompt_length = prompt_length

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.prompt_length
        token = sample(scores, self.params, step_generator(self.params.seed, 0, step))
        return torch.full_like(scores, float("-inf")).scatter_(1, token[:, None], 0.0)


def reference(model_dir, weights: tuple[str, str, str], sampling=SamplingSpec()):
    """The whole HF model, each decoder block quantized by torchao as its stage is, generating in one
    process; new tokens per sequence cut after the first EOS (as a run reports them)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    block_weights = {0: weights[0], 1: weights[1], 2: weights[1], 3: weights[2]}  # blocks are units 1..4
    for block, w in block_weights.items():
        if w != "fp":
            quantize_(model.model.layers[block], CONFIGS[w]())
    enc = encode(model_dir)
    length = enc["input_ids"].shape[1]
    extra = {} if sampling.temperature == 0 else {
        "logits_processor": transformers.LogitsProcessorList([AgentsSeededDraw(sampling, length)])}
    out = model.generate(**enc, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0, eos_token_id=2, **extra)
    rows = []
    for row in out[:, length:].tolist():
        rows.append(row[:row.index(2) + 1] if 2 in row else row)
    return rows


@pytest.mark.parametrize("weights", [("int8",) * 3, ("int4",) * 3, ("fp", "int8", "int4")],
                         ids=["int8", "int4", "fp-int8-int4"])
def test_quantized_stages_on_agent_processes_give_the_in_process_quantized_models_greedy_tokens(
        coordinator, model_dir, weights):
    assert agents_run(coordinator, plan_at(weights), model_dir) == reference(model_dir, weights)


@pytest.mark.parametrize("weights", [("int8",) * 3, ("int4",) * 3], ids=["int8", "int4"])
def test_quantized_stages_on_agent_processes_give_the_in_process_quantized_models_seeded_tokens(
        coordinator, model_dir, weights):
    got = agents_run(coordinator, plan_at(weights), model_dir, SEEDED)
    assert got == reference(model_dir, weights, SEEDED)
    if weights[0] == "int4":  # int8 moves no draw of this tiny model (tests/agents/test_weight_precision.py: it moves greedy tokens)
        assert got != reference(model_dir, ("fp",) * 3, SEEDED)


def test_fp_stages_still_give_the_unquantized_models_tokens(coordinator, model_dir):
    assert agents_run(coordinator, plan_at(("fp",) * 3), model_dir) == reference(model_dir, ("fp",) * 3)


def test_each_agent_holds_the_weight_bytes_the_planner_predicts_for_its_stages_precision(coordinator, model_dir):
    plan = plan_at(("int4", "int8", "fp"))
    coordinator.load(plan, model_dir, timeout_s=120)
    status = coordinator.status()
    spec = load_model_spec(model_dir, "fp32")
    for s in plan.stages:
        assert status[s.device].memory_bytes == stage_weight_bytes(spec, s.start, s.end, s.weights), s.device


def test_stages_placed_on_the_cpu_by_the_plan_give_generates_tokens(coordinator, model_dir):
    plan = plan_at(("fp",) * 3)
    plan = msgspec.structs.replace(plan, stages=tuple(msgspec.structs.replace(s, torch_device="cpu")
                                                      for s in plan.stages))
    coordinator.load(plan, model_dir, timeout_s=120)
    enc = encode(model_dir)
    request = RunRequest(input_ids=tuple(map(tuple, enc["input_ids"].tolist())),
                         attention_mask=tuple(map(tuple, enc["attention_mask"].tolist())),
                         max_new_tokens=MAX_NEW, mode="sequential", micro_batches=1,
                         eos_token_ids=(2,), pad_token_id=0)
    assert [list(t) for t in coordinator.run(plan, request).tokens] == reference(model_dir, ("fp",) * 3)


def test_a_cuda_stage_for_an_agent_without_one_is_refused_by_name_before_any_load(coordinator, model_dir):
    from agents.protocol import ErrorReply, LoadShard, PeerSpec
    from core.errors import DeviceUnavailable

    status = coordinator.status()
    assert all(st.accelerators == () for st in status.values())  # this CI host's torch is a CPU build
    with pytest.raises(DeviceUnavailable, match="edge-b: stage 1 asked to compute on cuda, but torch sees no CUDA"):
        coordinator.load(plan_at(("fp",) * 3), model_dir, torch_devices={"edge-b": "cuda"})
    planned = plan_at(("fp",) * 3)  # the plan's own choice (Stage.torch_device) is checked the same way
    planned = msgspec.structs.replace(planned, stages=(*planned.stages[:2], msgspec.structs.replace(
        planned.stages[2], torch_device="cuda:0")))
    with pytest.raises(DeviceUnavailable, match="edge-c: stage 2 asked to compute on cuda:0"):
        coordinator.load(planned, model_dir)
    # the agent's own entrance refuses it too (a request that did not come through that check)
    peer = PeerSpec(device="edge-a", stage=0, data_address=status["edge-a"].data_address,
                    public_key=status["edge-a"].public_key)
    reply = coordinator.request_async("edge-a", LoadShard(model_dir=model_dir, stage=0, start=0, end=6, peers=(peer,),
                                                          torch_device="cuda:1")).result(30)
    assert isinstance(reply, ErrorReply) and reply.code == "no_device" and "cuda:1" in reply.message
