"""Which file holds each tensor: one torch-free discovery for the agents' reader and the studio."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from agents.checkpoint_files import CheckpointError, tensor_files
from agents.checkpoint_reader import CheckpointReader


def test_a_single_file_lists_the_tensors_safetensors_itself_lists(tmp_path):
    save_file({"a.weight": torch.zeros(2, 3), "b.bias": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        expected = set(f.keys())
    assert tensor_files(tmp_path) == {n: tmp_path / "model.safetensors" for n in expected}
    assert CheckpointReader(tmp_path).names() == sorted(expected)


def test_an_index_maps_names_to_its_shards_without_opening_them(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001.safetensors", "b": "model-00002.safetensors"}}))
    assert tensor_files(tmp_path) == {"a": tmp_path / "model-00001.safetensors",
                                      "b": tmp_path / "model-00002.safetensors"}


@pytest.mark.parametrize("index, why", [("{", "invalid index"), ('{"weight_map": [1]}', "not an object"),
                                        ('{"weight_map": {"a": 3}}', "not an object of file names"),
                                        ('{"other": {}}', "invalid index")])
def test_an_unreadable_index_is_refused_naming_it(tmp_path, index, why):
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match=why):
        tensor_files(tmp_path)


def test_a_corrupt_single_file_is_refused_by_the_agents_reader_too(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        CheckpointReader(tmp_path)


def test_no_weights_says_which_formats_are_supported(tmp_path):
    with pytest.raises(CheckpointError, match="only safetensors checkpoints are supported"):
        tensor_files(tmp_path)


def test_finding_the_files_imports_no_torch(tmp_path):
    save_file({"a": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    code = ("import sys; from agents.checkpoint_files import tensor_files; "
            f"assert list(tensor_files({str(tmp_path)!r})) == ['a']; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
