"""The spatial technique through the seam: registry, CLI, simulator, recording and replay."""

from __future__ import annotations

import json

import pytest

from core.cli import main
from core.formats import save
from core.sessions.recording import append_predicted
from core.sessions.replay import Replay
from core.sessions.store import SessionStore
from core.techniques import technique_named, techniques_for
from core.techniques.spatial.cost import evaluate
from core.techniques.spatial.partition import fused_plan, per_layer_plan
from core.techniques.spatial.scenarios import paper_shaped
from core.techniques.spatial.simulator import simulate
from tests.core.sessions_problems import make_model
from tests.techniques.spatial.conftest import make_problem


def test_spatial_is_a_builtin_technique_offered_only_for_cnns():
    t = technique_named("spatial")
    assert t.strategy_names() == ["fused", "bodp", "cbps", "even"] and t.stage_kinds == ("spatial-strip",)
    assert t not in techniques_for(make_model())


def test_compare_lines_up_every_partitioner(problem):
    outs = technique_named("spatial").compare(problem, "latency")
    assert [o.status for o in outs] == ["ok"] * 4
    fused = outs[0]
    assert fused.latency_s <= min(o.latency_s for o in outs[1:])
    assert fused.tokens_per_s == pytest.approx(1 / fused.latency_s)


def test_the_simulated_timeline_adds_up_to_the_cost_model(problem):
    plan = per_layer_plan(problem, "cbps")
    sim = simulate(problem, plan, images=3)
    cost = evaluate(problem, plan)
    assert sim.figures.tokens == 3 and sim.events[-1].end_s == pytest.approx(3 * cost.latency_s)
    first = [e for e in sim.events if e.step == 0]
    scattered = sum(e.nbytes for e in first if e.kind == "recv_wait")
    gathered = sum(e.nbytes for e in first if e.kind == "send")
    assert scattered + gathered == cost.moved_bytes
    assert all(e.peer == problem.gateway for e in first if e.kind != "compute")
    assert not any(e.device == problem.gateway and e.kind != "compute" for e in sim.events)


def test_a_fused_plan_scatters_once_per_tile():
    p = make_problem((2.0, 2.0), 5.0)
    plan = fused_plan(p)
    sim = simulate(p, plan, images=1)
    scatters = [e for e in sim.events if e.kind == "recv_wait"]
    assert len(scatters) == sum(1 for ws in plan.widths if ws[1])


def test_a_simulated_run_is_recorded_and_replayed_by_the_shared_store(problem, tmp_path):
    sim = simulate(problem, fused_plan(problem), images=2)
    with SessionStore(tmp_path / "ws.sqlite") as store:
        run_id = store.create_run(store.create_session("spatial"), model="vgg16-32-w8", mode="sequential",
                                  kind="predicted")
        append_predicted(store, run_id, sim.events, sim.tokens)
        store.finish_run(run_id, "completed", sim.figures)
        order = lambda e: (e.end_s, e.start_s, e.device, e.kind)  # noqa: E731  (stored as they end)
        assert sorted(store.events(run_id), key=order) == sorted(sim.events, key=order)
        assert Replay.from_store(store, run_id).duration_s == pytest.approx(sim.events[-1].end_s, abs=1e-6)


def test_the_paper_shaped_scenario_speeds_up_with_more_nodes():
    from core.techniques.spatial.cost import single_device_seconds

    speedups = []
    for nodes in (2, 4):
        p = paper_shaped(nodes)
        speedups.append(single_device_seconds(p) / evaluate(p, per_layer_plan(p, "cbps")).latency_s)
    assert 1.5 < speedups[0] < 2.0 and 3.0 < speedups[1] < 4.0


def test_the_cli_writes_compares_plans_and_simulates(tmp_path, capsys):
    problem = tmp_path / "p.json"
    assert main(["spatial", "scenario", "--nodes", "3", "--bandwidth-mbps", "100", "--out", str(problem)]) == 0
    assert main(["spatial", "compare", str(problem), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert [r["strategy"] for r in doc["strategies"]] == ["fused", "bodp", "cbps", "even"]
    assert all(r["speedup"] > 1 for r in doc["strategies"])
    plan = tmp_path / "plan.json"
    assert main(["spatial", "plan", str(problem), "--strategy", "even", "--out", str(plan)]) == 0
    assert main(["spatial", "simulate", str(problem), str(plan), "--images", "2"]) == 0
    assert "2 images in" in capsys.readouterr().out


def test_the_cli_names_a_bad_problem_in_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    save(bad, make_problem().__class__(model=make_problem().model, devices=make_problem().devices, gateway="zz"))
    assert main(["spatial", "compare", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "gateway 'zz' is not one of the devices" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exit_:
        main(["spatial", "scenario", "--nodes", "0", "--out", str(bad)])
    assert exit_.value.code == 2 and "--nodes: must be an integer in [1, 64]" in capsys.readouterr().err
