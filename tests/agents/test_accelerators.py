"""Where a stage computes (``LoadShard.torch_device``): the names a load may carry, the refusal of a
GPU an agent does not have, and the CPU path by name (what runs where no GPU exists)."""

import pytest
import torch

from agents.accelerators import cuda_devices, unavailable_device
from agents.checkpoint_reader import CheckpointError
from agents.protocol import LoadShard, PeerSpec, ProtocolError, decode_control, encode_control
from agents.shard import StageExecutor
from core.models.checkpoints import ModelRecipe, make_model

PEER = PeerSpec(device="a", stage=0, data_address="tcp://127.0.0.1:5", public_key="k" * 40)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    recipe = ModelRecipe(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3)
    return str(make_model(recipe, tmp_path_factory.mktemp("accel") / "tiny-llama"))


@pytest.mark.parametrize("name", ["cpu", "cuda", "cuda:0", "cuda:12"])
def test_a_load_may_name_the_cpu_or_a_cuda_device(name):
    msg = LoadShard(model_dir="m", stage=0, start=0, end=2, peers=(PEER,), torch_device=name)
    assert msg.problem() == ""


@pytest.mark.parametrize("name", ["gpu", "cuda:", "cuda:x", "CUDA", "cuda:123", "mps"])
def test_a_load_naming_another_device_is_refused_with_the_names_it_may_take(name):
    msg = LoadShard(model_dir="m", stage=0, start=0, end=2, peers=(PEER,), torch_device=name)
    assert msg.problem().startswith("torch_device must be cpu, cuda or cuda:N")


def test_a_frame_naming_another_device_is_refused_as_it_is_decoded():
    frame = encode_control(LoadShard(model_dir="m", stage=0, start=0, end=2, peers=(PEER,), torch_device="gpu"))
    with pytest.raises(ProtocolError, match="torch_device must be"):
        decode_control(frame)


def test_a_gpu_the_agent_does_not_have_is_named_with_what_it_has():
    assert unavailable_device("cpu", ()) == ""
    assert unavailable_device("cuda", ("cuda:0",)) == ""
    assert "torch sees no CUDA device there" in unavailable_device("cuda", ())
    assert "it has cuda:0" in unavailable_device("cuda:1", ("cuda:0",))


def test_this_cpu_build_reports_no_accelerator():
    assert torch.version.cuda is None and cuda_devices() == ()


def test_a_stage_on_the_cpu_by_name_computes_exactly_as_the_default_one(model_dir):
    x = torch.tensor([[5, 9, 31, 7]])
    mask = torch.ones_like(x)
    default, named = StageExecutor(model_dir, 0, 4), StageExecutor(model_dir, 0, 4, torch_device="cpu")
    assert torch.equal(default.prefill(0, x, mask), named.prefill(0, x, mask))
    assert torch.equal(default.decode(0, x[:, :1]), named.decode(0, x[:, :1]))


def test_int4_weights_on_a_gpu_are_refused_before_anything_is_read(model_dir):
    with pytest.raises(CheckpointError, match="int4 weights are packed for the CPU"):
        StageExecutor(model_dir, 0, 4, weights="int4", torch_device="cuda")
