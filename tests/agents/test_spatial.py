"""The agent's strip compute (agents.techniques.spatial.network): any strips with halos equal the whole network."""

from __future__ import annotations

import random

import pytest
import torch

from agents.techniques.spatial.network import (
    Layer,
    build_network,
    group_input_ranges,
    resnet_style,
    run_partitioned,
    vgg16,
)

NETS = {"vgg16": lambda: vgg16(32, 8, 10), "resnet-style": lambda: resnet_style(32, 8, 10)}


def _random_widths(rng: random.Random, width: int, n: int) -> list[int]:
    cuts = sorted(rng.randint(0, width) for _ in range(n - 1))
    bounds = [0, *cuts, width]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _random_groups(rng: random.Random, n: int) -> list[tuple[int, int]]:
    cuts = sorted(rng.sample(range(1, n), rng.randint(0, n - 1)))
    bounds = [0, *cuts, n]
    return list(zip(bounds, bounds[1:]))


@pytest.mark.parametrize("name", sorted(NETS))
def test_any_strips_and_fused_groups_equal_the_single_device_forward(name):
    spec = NETS[name]()
    net = build_network(spec, seed=3)
    x = torch.randn(2, 3, spec.image, spec.image, generator=torch.Generator().manual_seed(0))
    ref = net.forward(x)
    rng = random.Random(7)
    for _ in range(6):
        groups = _random_groups(rng, len(spec.layers))
        widths = [_random_widths(rng, spec.layers[e - 1].w_out, rng.randint(1, 4)) for _, e in groups]
        out = run_partitioned(net, x, groups, widths)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_a_strip_cut_without_its_halo_differs_from_the_whole_layer():
    spec = vgg16(32, 8, 10)
    net = build_network(spec, seed=3)
    x = torch.randn(1, 3, 32, 32)
    whole = net.layer_cols(0, x, 0, 0, 32)
    no_halo = torch.cat([torch.relu(torch.nn.functional.conv2d(x[..., a:b], *net.params[0][0], padding=1))
                         for a, b in ((0, 16), (16, 32))], dim=-1)
    assert (no_halo - whole).abs().max() > 1e-3


@pytest.mark.parametrize("layer", [Layer("conv", 2, 2, 12, 12, k=3), Layer("conv", 2, 2, 12, 12, k=7),
                                   Layer("pool", 2, 2, 12, 12), Layer("res", 2, 2, 12, 12)])
def test_the_columns_a_strip_needs_are_exactly_the_columns_its_outputs_depend_on(layer):
    spec = type(vgg16())(name="one", image=12, layers=(layer,), head_in=1, fc=(1,), flatten=True)
    net = build_network(spec, seed=1)
    x = torch.randn(1, 2, 12, 12)
    base = net.layer_cols(0, x, 0, 0, layer.w_out)
    for lo, hi in ((0, 1), (2, 4), (layer.w_out - 2, layer.w_out)):
        depends = set()
        for col in range(12):
            y = x.clone()
            y[..., col] += 10.0
            if (net.layer_cols(0, y, 0, 0, layer.w_out) - base)[..., lo:hi].abs().max() > 0:
                depends.add(col)
        a, b = group_input_ranges([layer], lo, hi)[0]
        assert depends == set(range(a, b))


def test_vgg16_unit_table_matches_the_published_size():
    spec = vgg16()
    conv = sum(layer.flops() for layer in spec.layers)
    params = sum(layer.param_bytes() for layer in spec.layers) + spec.head_param_bytes()
    assert 15.3e9 < conv / 2 < 15.6e9  # the paper's ~15.5 G counts multiply-adds; the formula has the 2
    assert params // 4 == 138_357_544  # torchvision's VGG16 parameter count
    assert spec.head_param_bytes() / params > 0.85  # FC layers hold most of the storage


def test_a_conv_sweep_times_layer_strips_with_their_flops_weight_and_activation_bytes():
    from agents.protocol import ConvSweepOptions
    from agents.techniques.spatial.network import STRIP_SHAPES, Layer, conv_sweep, layer_features

    timings = conv_sweep(ConvSweepOptions(sizes=(8, 16), channels=(4,), repeats=1))
    swept = [(Layer("conv", 4, 4, s, s), 0, s) for s in (8, 16)]
    want = [layer_features(layer, layer.needs(lo, hi)[1] - layer.needs(lo, hi)[0], hi - lo)
            for layer, lo, hi in swept + list(STRIP_SHAPES)]
    assert [s[:3] for s in timings.layer_samples] == want
    assert all(s[3] > 0 for s in timings.layer_samples)
    assert [f for f, _ in timings.samples] == [f for f, _, _ in want[:2]]


@pytest.mark.parametrize("shape", [(1, 32, 96, 48), (2, 3, 7, 9), (1, 5, 6, 2)])
def test_the_strip_max_pool_equals_torchs_bit_for_bit(shape):
    from agents.techniques.spatial.network import max_pool_2x2

    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    x[0, 0, 0, 0] = float("nan")  # propagated like torch's
    assert torch.equal(max_pool_2x2(x).nan_to_num(7.0), torch.nn.functional.max_pool2d(x, 2).nan_to_num(7.0))


def test_a_strip_through_a_pool_does_not_use_torchs_max_pool_kernel(monkeypatch):
    """torch's CPU max_pool2d took 9-14x the elementwise maximum on one thread here, and grew faster
    than the bytes it reads: the strip path (what agents run and profile) must not call it."""
    spec = vgg16(32, 8, 10)
    net = build_network(spec, seed=1)
    pool = next(i for i, layer in enumerate(spec.layers) if layer.kind == "pool")
    x = torch.randn(1, spec.layers[pool].c_in, spec.layers[pool].h_in, 8)
    want = torch.nn.functional.max_pool2d(x, 2)

    def refused(*args, **kwargs):
        raise AssertionError("the strip path called torch's max_pool2d")

    monkeypatch.setattr(torch.nn.functional, "max_pool2d", refused)
    monkeypatch.setattr(torch, "max_pool2d", refused)
    with torch.inference_mode():
        assert torch.equal(net.strip(pool, pool + 1, x, 4, 2, 6), want)
