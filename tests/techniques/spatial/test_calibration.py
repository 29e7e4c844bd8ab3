"""Calibrating the spatial cost model from runs: fitted from a run of a known "true" problem
(the simulator's events), the calibrated problem predicts that problem's other plans exactly."""

from __future__ import annotations

import pytest
from msgspec import structs

from core.techniques.spatial.calibration import calibrate
from core.techniques.spatial.cost import evaluate, sharing_factor
from core.techniques.spatial.partition import fused_plan, per_layer_plan
from core.techniques.spatial.problem import SpatialInputError, check
from core.techniques.spatial.simulator import simulate
from tests.techniques.spatial.conftest import make_problem


def _base():
    return make_problem((4.0, 2.0), 200.0, image=64, width_div=8)


def _truth(base):
    """What a real host adds: compute ×2 (×0.5 more when alone), 2 ms per message, 1 ms per tile, head ×3."""
    devices = tuple(structs.replace(d, time=structs.replace(d.time, a=d.time.a * 2, b=d.time.b * 2),
                                    fc_time=structs.replace(d.time, a=d.time.a * 3, b=d.time.b * 3),
                                    latency_s=2e-3) for d in base.devices)
    return structs.replace(base, devices=devices, tile_overhead_s=1e-3, concurrency_scale=(0.5, 1.0))


def test_a_calibrated_problem_predicts_the_true_problems_other_plans():
    base = _base()
    truth = _truth(base)
    probe, solo = per_layer_plan(base, "even", ["d0", "d1"]), per_layer_plan(base, "even", ["d0"])
    probe_run, solo_run = simulate(truth, probe, images=2), simulate(truth, solo, images=2)
    cal = calibrate(base, probe, probe_run.events, probe_run.figures.duration_s, solo=(solo, solo_run.events))
    assert cal.concurrency_scale == pytest.approx((0.5, 1.0))
    assert cal.tile_overhead_s == pytest.approx(1e-3) and cal.latency_s["d1"] == pytest.approx(2e-3)
    for plan in (per_layer_plan(base, "cbps", ["d0", "d1"]), fused_plan(base, ["d0", "d1"]), solo):
        want = simulate(truth, plan, images=3).figures.duration_s
        assert simulate(cal.problem, plan, images=3).figures.duration_s == pytest.approx(want, rel=1e-6)
        assert simulate(base, plan, images=3).figures.duration_s < 0.7 * want  # uncalibrated: far under


def test_probes_on_every_device_count_fit_the_sharing_per_count_and_the_gateways_work_per_worker():
    """A 2-core host: one and two computing devices run alike, three slow each other; each worker
    costs the gateway 0.5 ms per tile. Fitted from even probes on 1, 2 and 3 devices, the
    calibrated problem predicts the true one's other plans on 2 devices (linear sharing from alone to
    all, and one overhead per tile, could not)."""
    base = make_problem((4.0, 2.0, 1.0), 200.0, image=64, width_div=8)
    truth = structs.replace(_truth(base), concurrency_scale=(0.5, 0.5, 1.0), worker_overhead_s=5e-4)
    probes = {k: per_layer_plan(base, "even", ["d0", "d1", "d2"][:k]) for k in (1, 2, 3)}
    runs = {k: simulate(truth, p, images=2) for k, p in probes.items()}
    cal = calibrate(base, probes[3], runs[3].events, runs[3].figures.duration_s,
                    ladder=[(probes[k], runs[k].events, runs[k].figures.duration_s) for k in (1, 2)])
    assert cal.concurrency_scale == pytest.approx((0.5, 0.5, 1.0))
    assert (cal.tile_overhead_s, cal.worker_overhead_s) == pytest.approx((1e-3, 5e-4))
    for plan in (per_layer_plan(base, "cbps", ["d0", "d1"]), fused_plan(base, ["d0", "d1"]),
                 fused_plan(base, ["d0", "d1", "d2"])):
        want = simulate(truth, plan, images=3).figures.duration_s
        assert simulate(cal.problem, plan, images=3).figures.duration_s == pytest.approx(want, rel=1e-6)


def test_without_a_solo_run_no_host_sharing_is_assumed():
    base = _base()
    probe = per_layer_plan(base, "even", ["d0", "d1"])
    run = simulate(_truth(base), probe, images=1)
    cal = calibrate(base, probe, run.events, run.figures.duration_s)
    assert cal.problem.concurrency_scale == () and sharing_factor(cal.problem, 1) == 1.0


def test_a_run_without_images_cannot_calibrate():
    base = _base()
    with pytest.raises(SpatialInputError, match="no measured image"):
        calibrate(base, per_layer_plan(base, "even", ["d0", "d1"]), [], 0.0)


def test_host_sharing_slows_a_tile_by_how_many_devices_compute_it():
    base = _base()
    plan = per_layer_plan(base, "even", ["d0", "d1"])
    shared = structs.replace(base, concurrency_scale=(1.0, 2.0))
    alone = per_layer_plan(base, "even", ["d0"])
    assert evaluate(shared, alone).latency_s == pytest.approx(evaluate(base, alone).latency_s)
    compute = lambda p: sum(evaluate(p, plan).busy_s.values()) - evaluate(p, plan).head_s  # noqa: E731
    assert compute(shared) == pytest.approx(2 * compute(base))


@pytest.mark.parametrize("changes, why", [(dict(tile_overhead_s=-1.0), "tile_overhead_s"),
                                          (dict(concurrency_scale=(1.0, 0.0)), "concurrency_scale")])
def test_a_problem_with_a_bad_calibration_is_refused(changes, why):
    with pytest.raises(SpatialInputError, match=why):
        check(structs.replace(_base(), **changes))


def test_the_cli_calibrates_a_problem_on_agents_and_its_prediction_tracks_the_probe(tmp_path, capsys):
    from core.cli import main
    from core.devices.local_cluster import LocalCluster
    from core.formats import load, save
    from core.techniques.spatial.problem import SpatialProblem

    nominal = make_problem((4.0, 2.0), 10_000.0, image=64, width_div=8)  # 10 Gbit/s: the wire is ~µs
    base = structs.replace(nominal, gateway="local-0", devices=tuple(
        structs.replace(d, id=f"local-{i}") for i, d in enumerate(nominal.devices)))
    save(tmp_path / "p.json", base)
    with LocalCluster(tmp_path / "cluster", 2) as lc:
        rc = main(["spatial", "calibrate", str(tmp_path / "p.json"), "--agents", str(lc.agents_file),
                   "--images", "2", "--rounds", "1", "--out", str(tmp_path / "cal.json")])
    assert rc == 0 and "wrote" in capsys.readouterr().out
    cal = load(tmp_path / "cal.json", SpatialProblem)
    check(cal)
    assert len(cal.concurrency_scale) == 2 and cal.concurrency_scale[1] == 1.0
    assert cal.device("local-1").latency_s > 0  # framing, encryption and decoding cost more than the wire


def test_calibration_scales_a_per_layer_models_weight_and_activation_terms_too():
    def with_bytes(problem, factor):
        return structs.replace(problem, devices=tuple(structs.replace(d, time=structs.replace(
            d.time, a=d.time.a * factor, b=d.time.b * factor, per_weight_byte=1e-10 * factor,
            per_activation_byte=3e-10 * factor)) for d in problem.devices))

    base = with_bytes(_base(), 1.0)
    truth = with_bytes(_base(), 2.0)
    probe = per_layer_plan(base, "even", ["d0", "d1"])
    run = simulate(truth, probe, images=2)
    cal = calibrate(base, probe, run.events, run.figures.duration_s)
    plan = fused_plan(base, ["d0", "d1"])
    assert simulate(cal.problem, plan, images=2).figures.duration_s == pytest.approx(
        simulate(truth, plan, images=2).figures.duration_s, rel=1e-6)
