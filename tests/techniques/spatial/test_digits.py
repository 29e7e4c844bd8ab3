"""The demo's digit CNN: its shipped weights label the shipped held-out digits right, read as agents read them."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from agents.techniques.spatial.network import load_network, run_partitioned, weight_names
from core.models.demo_models import shipped
from core.techniques.spatial.digits import DIGITS_CNN, digits_cnn, label_of_file
from core.techniques.spatial.images import load_images

FOLDER = shipped("cnn")


def test_the_shipped_cnn_labels_the_shipped_held_out_digits_right_with_a_plain_forward():
    ref = digits_cnn(FOLDER)
    files = sorted((FOLDER / "images").glob("*.png"))
    assert sorted(label_of_file(f) for f in files) == list(range(10))
    # a plain torch forward of the same weights (torch's own conv2d / max_pool2d / linear), not the strip code
    tensors = load_file(str(FOLDER / "digits-cnn.safetensors"))
    x = load_images(files, ref.image)
    plain = _plain_forward(tensors, x)
    assert plain.argmax(1).tolist() == [label_of_file(f) for f in files]
    assert ref.labels == tuple(str(d) for d in range(10))


def _plain_forward(t, x):
    import torch.nn.functional as F

    spec = DIGITS_CNN.spec()
    for i, layer in enumerate(spec.layers):
        w = {k.split(".", 2)[2]: v.float() for k, v in t.items() if k.startswith(f"layers.{i}.")}
        if layer.kind == "pool":
            x = F.max_pool2d(x, 2)
        elif layer.kind == "conv":
            x = F.relu(F.conv2d(x, w["0.weight"], w["0.bias"], padding=layer.k // 2))
        else:
            y = F.relu(F.conv2d(x, w["0.weight"], w["0.bias"], padding=1))
            x = F.relu(F.conv2d(y, w["1.weight"], w["1.bias"], padding=1) + x)
    x = x.mean(dim=(2, 3))
    return F.linear(x, t["head.0.weight"].float(), t["head.0.bias"].float())


def test_strips_over_three_devices_give_the_whole_networks_scores():
    net = digits_cnn(FOLDER).build()
    x = load_images(sorted((FOLDER / "images").glob("*.png"))[:2], 32)
    groups = ((0, 4), (4, 8), (8, 16))
    widths = ((6, 5, 5), (3, 3, 2), (1, 1, 0))
    assert torch.allclose(run_partitioned(net, x, groups, widths), net.forward(x), atol=1e-4)


def test_a_weights_file_without_a_tensor_is_refused_naming_it(tmp_path):
    tensors = load_file(str(FOLDER / "digits-cnn.safetensors"))
    missing = weight_names(DIGITS_CNN.spec())[3]
    save_file({k: v for k, v in tensors.items() if k != missing}, str(tmp_path / "w.safetensors"))
    with pytest.raises(ValueError, match=missing):
        load_network(DIGITS_CNN.spec(), str(tmp_path / "w.safetensors"))
