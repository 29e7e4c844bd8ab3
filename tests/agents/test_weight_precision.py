"""int8/int4 stages: a chain of quantized ``StageExecutor``s gives exactly the tokens of the same HF
model quantized in one process by torchao itself (its ``quantize_`` on the model's decoder blocks,
transformers' own ``generate``), holds the bytes torchao's storage says, and refuses what it cannot
quantize; the wire carries the precision strictly."""

from __future__ import annotations

import functools

import msgspec
import pytest
import torch
import transformers
from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig
from torchao.quantization import Int8WeightOnlyConfig, quantize_

from agents.local_pipeline import generate_partitioned
from agents.protocol import PROTOCOL_VERSION, LoadShard, PeerSpec, ProtocolError, decode_control
from agents.sampling import SamplingParams
from agents.shard import StageExecutor
from agents.checkpoint_reader import CheckpointError
from core.models.checkpoints import ModelRecipe, make_model

PROMPTS = ["the cat sat", "a much longer prompt about the river", "hello"]
SPLIT = ((0, 2), (2, 4), (4, 6))
MAX_NEW = 12
REFERENCE_CONFIGS = {
    # torchao's own configs, written out here (not read from agents.weight_precision): the reference
    "int8": lambda: Int8WeightOnlyConfig(),
    "int4": lambda: PrototypeInt4WeightOnlyConfig(group_size=32, set_inductor_config=False),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    recipe = ModelRecipe(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3)
    return str(make_model(recipe, tmp_path_factory.mktemp("precision") / "tiny-llama"))


def encode(model_dir: str):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    return tok(PROMPTS, return_tensors="pt", padding=True)


@functools.cache
def hf_quantized_greedy(model_dir: str, weights: str) -> torch.Tensor:
    """transformers' generate on the whole model, its decoder blocks quantized by torchao."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    if weights != "fp":
        quantize_(model.model.layers, REFERENCE_CONFIGS[weights]())
    enc = encode(model_dir)
    out = model.generate(**enc, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0, eos_token_id=2)
    return out[:, enc["input_ids"].shape[1]:]


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_three_stage_quantized_chain_gives_exactly_the_tokens_of_torchaos_quantized_hf_model(model_dir, weights):
    enc = encode(model_dir)
    stages = [StageExecutor(model_dir, a, b, weights=weights) for a, b in SPLIT]
    got = generate_partitioned(stages, enc["input_ids"], enc["attention_mask"],
                               SamplingParams(max_new_tokens=MAX_NEW, eos_token_ids=(2,), pad_token_id=0)).tokens
    assert got.tolist() == hf_quantized_greedy(model_dir, weights).tolist()
    assert got.tolist() != hf_quantized_greedy(model_dir, "fp").tolist()  # quantizing changed what greedy picks


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_only_the_blocks_linear_weights_are_quantized(model_dir, weights):
    first, last = StageExecutor(model_dir, 0, 3, weights=weights), StageExecutor(model_dir, 3, 6, weights=weights)
    quantized = {type(m.weight).__name__ for layer in first._layers for m in layer.modules()
                 if isinstance(m, torch.nn.Linear)}
    assert quantized == {"Int8Tensor" if weights == "int8" else "Int4OpaqueTensor"}
    assert type(first._embed.weight) is torch.nn.Parameter and type(last._head.weight) is torch.nn.Parameter
    assert all(type(p) is torch.nn.Parameter for layer in first._layers for n, p in layer.named_parameters()
               if "norm" in n)


def test_quantized_stages_hold_fewer_bytes_int4_fewest(model_dir):
    held = {w: StageExecutor(model_dir, 1, 5, weights=w).memory_bytes() for w in ("fp", "int8", "int4")}
    assert held["int4"] < held["int8"] < held["fp"]


def test_a_gpt2_stage_refuses_quantized_weights_naming_what_to_use(tmp_path):
    gpt2 = make_model(ModelRecipe(family="gpt2", layers=2, hidden=64, heads=4, vocab=512, seed=1), tmp_path / "g")
    with pytest.raises(CheckpointError, match="int8 weights are supported for llama.*not gpt2.*fp weights"):
        StageExecutor(str(gpt2), 0, 2, weights="int8")


def test_int4_refuses_linears_whose_inputs_do_not_split_into_groups_of_32(tmp_path):
    odd = make_model(ModelRecipe(family="llama", layers=2, hidden=48, heads=4, kv_heads=2, vocab=512, seed=1),
                     tmp_path / "odd")
    with pytest.raises(CheckpointError, match="groups of 32.*use int8 or fp"):
        StageExecutor(str(odd), 0, 2, weights="int4")


def _load_frame(**fields) -> bytes:
    peer = {"device": "a", "stage": 0, "data_address": "tcp://127.0.0.1:1", "public_key": "k" * 40}
    return msgspec.msgpack.encode({"v": PROTOCOL_VERSION, "type": "load_shard", "model_dir": "/m", "stage": 0,
                                   "start": 0, "end": 3, "peers": [peer], **fields})


def test_load_shard_carries_the_weight_precision_and_defaults_to_fp():
    assert decode_control(_load_frame(weights="int4")).weights == "int4"
    assert decode_control(_load_frame()).weights == "fp"
    peers = (PeerSpec(device="a", stage=0, data_address="tcp://127.0.0.1:1", public_key="k" * 40),)
    assert LoadShard(model_dir="/m", stage=0, start=0, end=3, peers=peers, weights="int8").problem() == ""


@pytest.mark.parametrize("bad", ["int2", "", "INT8", 8])
def test_load_shard_refuses_an_unknown_weight_precision_before_any_work(bad):
    with pytest.raises(ProtocolError) as info:
        decode_control(_load_frame(weights=bad))
    assert info.value.code == "bad_message"
