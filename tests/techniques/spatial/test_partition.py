"""Time model fit, partitioners and device count against closed forms and brute force."""

from __future__ import annotations

import itertools

import pytest

from core.techniques.spatial.cost import evaluate, group_times, single_device_seconds
from agents.techniques.spatial.network import Layer
from core.techniques.spatial.partition import (
    bodp_widths, cbps_widths, device_count_choices, even_widths, fused_plan, min_strip_width, per_layer_plan,
    proportional, with_best_device_count, without_slivers,
)
from core.techniques.spatial.problem import (
    CnnRef, SpatialDevice, SpatialInputError, SpatialPlan, SpatialProblem, TimeModel, fit_time_model,
)
from tests.techniques.spatial.conftest import make_problem


def test_the_time_model_fit_recovers_a_line_exactly():
    fit = fit_time_model([(x, 2e-10 * x + 3e-4) for x in (1e6, 4e6, 9e6, 2e7)])
    assert fit.a == pytest.approx(2e-10) and fit.b == pytest.approx(3e-4) and fit.median_rel_error < 1e-9


def test_a_fit_from_one_map_size_is_refused_with_what_to_do():
    with pytest.raises(SpatialInputError, match="two or more map sizes"):
        fit_time_model([(1e6, 1e-3), (1e6, 1.1e-3)])


def test_proportional_widths_sum_to_the_width_and_follow_the_weights():
    assert proportional(10, [3, 1, 1]) == (6, 2, 2)
    assert sum(proportional(17, [0.3, 0.2, 0.11])) == 17


def test_bodp_splits_by_compute_speed_alone():
    p = make_problem((4.0, 2.0, 2.0))
    spec = p.model.spec()
    assert bodp_widths(p, spec, 0, 1, ["d0", "d1", "d2"]) == (16, 8, 8)
    assert even_widths(p, spec, 0, 1, ["d0", "d1", "d2"]) == (11, 11, 10)


def _span(p, spec, s, e, devs, ws):
    return max(t.total_s for t in group_times(p, spec, s, e, devs, ws))


@pytest.mark.parametrize("bandwidth", [1000.0, 30.0, 3.0])
def test_cbps_is_no_slower_than_bodp_or_even_and_near_the_brute_force_optimum(bandwidth):
    p = make_problem((4.0, 2.0, 1.0), bandwidth)
    spec = p.model.spec()
    devs = ["d0", "d1", "d2"]
    for s in range(len(spec.layers)):
        w = spec.layers[s].w_out
        k = min_strip_width(spec.layers[s:s + 1])
        splits = [(a, b, w - a - b) for a in range(w + 1) for b in range(w + 1 - a)]
        best = min(_span(p, spec, s, s + 1, devs, ws) for ws in splits if all(x == 0 or x >= k for x in ws))
        cbps = _span(p, spec, s, s + 1, devs, cbps_widths(p, spec, s, s + 1, devs))
        assert cbps <= _span(p, spec, s, s + 1, devs, bodp_widths(p, spec, s, s + 1, devs)) + 1e-12
        assert cbps <= _span(p, spec, s, s + 1, devs, even_widths(p, spec, s, s + 1, devs)) + 1e-12
        assert cbps <= best * 1.05


def test_cbps_gives_a_slow_link_fewer_columns_than_bodp():
    p = make_problem((2.0, 2.0), 5.0)
    spec = p.model.spec()
    cbps = cbps_widths(p, spec, 0, 1, ["d0", "d1"])
    assert bodp_widths(p, spec, 0, 1, ["d0", "d1"]) == (16, 16) and cbps[1] < 16


def test_a_strip_must_give_every_convolution_two_columns_wherever_a_group_ends():
    conv, pool = Layer("conv", 8, 8, 12, 12), Layer("pool", 8, 8, 12, 12)
    assert min_strip_width([conv]) == 2 and min_strip_width([conv, conv]) == 2
    assert min_strip_width([conv, pool]) == 1  # 1 pooled column is 2 conv columns
    assert min_strip_width([pool]) == 1 and min_strip_width([Layer("conv", 8, 8, 12, 1)]) == 1


def test_a_sliver_is_topped_up_or_given_away_as_the_score_prefers():
    widest = lambda ws: max(ws)  # noqa: E731
    assert without_slivers((1, 5, 6), 2, widest) == (2, 5, 5)  # topped up from the widest strip
    assert without_slivers((1, 2, 3), 2, lambda ws: ws[0]) == (0, 3, 3)  # given away
    assert without_slivers((1, 1, 4), 2, widest) == (2, 2, 2)  # two slivers, the leftmost first
    assert without_slivers((3, 0, 5), 2, widest) == (3, 0, 5)
    assert without_slivers((1, 0), 2, widest) == (1, 0)  # a map narrower than the minimum


def _cluster_shaped(slowdowns, network="vgg16") -> SpatialProblem:
    """bench/spatial_partition.py's emulated cluster, on a per-layer model with weight and activation
    terms (the numbers of one profile on one thread): old CBPS gave its 8× gateway 1 column of the
    256-channel 6×6 convs, and BODP and fused left 1-column strips too."""
    devices = tuple(SpatialDevice(id=f"d{i}", time=TimeModel(a=1.04e-11 * f, b=4.5e-5 * f, per_weight_byte=1.14e-10 * f,
                                                              per_activation_byte=9.7e-11 * f),
                                  bandwidth_Bps=1000e6 / 8, latency_s=1e-3) for i, f in enumerate(slowdowns))
    return SpatialProblem(name="cluster", model=CnnRef(network=network, image=96, width_div=2, classes=10),
                          devices=devices, gateway="d0")


@pytest.mark.parametrize("slowdowns,network", [((8.0, 3.0, 4.0, 6.0), "vgg16"), ((8.0, 3.0, 6.0), "resnet-style")])
def test_no_partitioner_but_even_leaves_a_strip_narrower_than_its_minimum(slowdowns, network):
    p = _cluster_shaped(slowdowns, network)
    layers = p.model.spec().layers
    for plan in (per_layer_plan(p, "cbps"), per_layer_plan(p, "bodp"), fused_plan(p)):
        for (start, end), ws in zip(plan.groups, plan.widths):
            k = min_strip_width(layers[start:end])
            assert all(w == 0 or w >= k for w in ws), (plan.strategy, start, end, ws)
    assert all(max(ws) - min(ws) <= 1 for ws in per_layer_plan(p, "even").widths)  # even stays even


def test_fused_tiles_are_the_best_of_every_segmentation():
    p = make_problem((4.0, 2.0), 20.0, network="resnet-style")
    spec = p.model.spec()
    n = len(spec.layers)
    devs = ("d0", "d1")
    plan = fused_plan(p, devs)
    spans = {(a, b): _span(p, spec, a, b, devs, cbps_widths(p, spec, a, b, devs))
             for b in range(1, n + 1) for a in range(b)}
    brute = float("inf")
    for mask in itertools.product((0, 1), repeat=n - 1):
        bounds = [0, *[i + 1 for i, m in enumerate(mask) if m], n]
        t = sum(spans[a, b] for a, b in zip(bounds, bounds[1:]))
        brute = min(brute, t)
    assert sum(evaluate(p, plan).group_s) == pytest.approx(brute)


def test_fused_tiles_beat_a_scatter_per_layer_on_a_slow_link():
    p = make_problem((2.0, 2.0, 2.0), 10.0)
    assert evaluate(p, fused_plan(p)).latency_s < evaluate(p, per_layer_plan(p, "cbps")).latency_s
    assert len(fused_plan(p).groups) < len(p.model.spec().layers)


def test_one_device_costs_the_single_device_time():
    p = make_problem((3.0,))
    for name in ("cbps", "bodp", "even"):
        assert evaluate(p, per_layer_plan(p, name)).latency_s == pytest.approx(single_device_seconds(p))


def test_the_planner_uses_fewer_devices_as_bandwidth_falls():
    counts = []
    for mbps in (10000.0, 100.0, 10.0, 1.0, 0.1):
        p = make_problem((2.0, 2.0, 2.0, 2.0), mbps)
        counts.append(len(with_best_device_count(p, lambda q, d: per_layer_plan(q, "cbps", d)).devices))
    assert counts == sorted(counts, reverse=True) and counts[0] == 4 and counts[-1] == 1


def test_device_count_choices_start_with_the_gateway_alone():
    p = make_problem()
    choices = device_count_choices(p, lambda q, d: per_layer_plan(q, "cbps", d))
    assert [k for k, _, _ in choices] == [1, 2, 3] and choices[0][1].devices == ("d0",)


def test_a_plan_breaking_the_rules_is_refused_naming_each_rule(problem):
    good = per_layer_plan(problem, "even")
    bad = SpatialPlan(devices=("d0", "nope"), groups=((0, 2), (3, len(good.groups))), widths=((5, 5),))
    with pytest.raises(SpatialInputError) as err:
        evaluate(problem, bad)
    text = str(err.value)
    assert "'nope' is not in the problem" in text and "does not continue at layer 2" in text
    assert "width lists for 2 groups" in text


def _layer_samples(a, b, per_weight, per_act):
    from agents.techniques.spatial.network import STRIP_SHAPES, layer_features

    out = []
    for layer, lo, hi in STRIP_SHAPES:
        x0, x1 = layer.needs(lo, hi)
        f, w, m = layer_features(layer, x1 - x0, hi - lo)
        out.append((f, w, m, a * f + b + per_weight * w + per_act * m))
    return out


def test_the_per_layer_fit_recovers_flops_call_weight_and_activation_terms():
    from core.techniques.spatial.problem import fit_layer_time_model

    fit = fit_layer_time_model(_layer_samples(1e-11, 3e-5, 1.5e-10, 3e-10))
    assert (fit.a, fit.b, fit.per_weight_byte, fit.per_activation_byte) == pytest.approx(
        (1e-11, 3e-5, 1.5e-10, 3e-10), rel=1e-6)
    assert fit.median_rel_error < 1e-9


def test_the_per_layer_fit_drops_a_term_that_would_be_negative():
    from core.techniques.spatial.problem import fit_layer_time_model

    samples = [(f, w, m, y - 2e-11 * w) for f, w, m, y in _layer_samples(1e-11, 3e-5, 0.0, 3e-10)]
    fit = fit_layer_time_model(samples)
    assert fit.per_weight_byte == 0.0 and fit.a > 0 and fit.b >= 0 and fit.per_activation_byte > 0


def test_a_pool_strip_is_predicted_by_the_bytes_it_reads_not_its_flops():
    from msgspec import structs

    from core.techniques.spatial.cost import strip_time

    p = make_problem((4.0,), b=0.0)
    layers = p.model.spec().layers
    pool = next(i for i, layer in enumerate(layers) if layer.kind == "pool")
    dev = p.device("d0")
    flops_only = strip_time(layers[pool:pool + 1], dev, 0, 4, gateway=True).compute_s
    dev = structs.replace(dev, time=structs.replace(dev.time, per_activation_byte=1e-9))
    bytes_in_out = layers[pool].in_bytes(8) + layers[pool].out_bytes(4)
    assert strip_time(layers[pool:pool + 1], dev, 0, 4, gateway=True).compute_s == pytest.approx(
        flops_only + 1e-9 * bytes_in_out)


def test_a_fused_strip_pays_each_inner_layers_weights_and_its_halo_columns():
    from msgspec import structs

    from agents.techniques.spatial.network import group_input_ranges
    from core.techniques.spatial.cost import strip_time

    p = make_problem((4.0,), b=0.0)
    layers = p.model.spec().layers[:2]  # conv, conv: the first computes the second's halo
    dev = p.device("d0")
    dev = structs.replace(dev, time=structs.replace(dev.time, a=1e-12, per_weight_byte=1e-9,
                                                     per_activation_byte=2e-9))
    ranges = group_input_ranges(layers, 4, 8)
    assert ranges[1] == (3, 9)  # the inner layer computes one halo column each side
    want = sum(1e-12 * layer.flops(o1 - o0) + 1e-9 * layer.param_bytes()
               + 2e-9 * (layer.in_bytes(i1 - i0) + layer.out_bytes(o1 - o0))
               for layer, (i0, i1), (o0, o1) in zip(layers, ranges, ranges[1:]))
    assert strip_time(layers, dev, 4, 8, gateway=True).compute_s == pytest.approx(want)
