"""A technique plugs in through the seam alone (core.techniques, agents.registry), and the
shared parts — registry, CLI, Compare, recording, replay, export, the agent — take it as it is."""

from __future__ import annotations

import json

import pytest

from core.cli import main
from core.sessions.export import chrome_trace
from core.sessions.recording import append_predicted
from core.sessions.replay import Replay
from core.sessions.store import SessionStore
from core.techniques import UnknownTechnique, register, technique_named, techniques, techniques_for, unregister
from tests.core.sessions_problems import make_model, make_problem
from tests.techniques import whole_model


@pytest.fixture
def plugged_in():
    register(whole_model.TECHNIQUE)
    yield whole_model.TECHNIQUE
    unregister(whole_model.TECHNIQUE.name)


def test_layer_sharding_is_the_shipped_technique_and_names_its_parts():
    t = technique_named("layer-sharding")
    assert t.exact == "edgeshard" and t.strategy_names()[0] == "edgeshard"
    assert {"edge-solo", "cloud-edge-opt"} <= set(t.strategies)
    assert t.stage_kinds == ("layers",) and "no-bubbles" in t.modes


def test_a_registered_technique_is_listed_and_offered_for_the_models_it_applies_to(plugged_in):
    assert plugged_in in techniques()
    llama = make_model()
    assert plugged_in in techniques_for(llama)
    gpt2 = type(llama)(name="g", family="gpt2", dtype="fp16", units=llama.units)
    assert plugged_in not in techniques_for(gpt2)


def test_an_unknown_technique_is_an_error_naming_the_known_ones():
    with pytest.raises(UnknownTechnique, match="layer-sharding"):
        technique_named("no-such-technique")


def test_compare_runs_a_plugged_in_techniques_strategies_exact_first(plugged_in):
    problem = make_problem({"fast": 0.001, "slow": 0.004})
    outs = plugged_in.compare(problem, "latency")
    assert [o.strategy for o in outs] == ["fastest-device", "source-only"]
    assert outs[0].status == "optimal" and outs[0].plan.device == "fast"
    assert outs[0].latency_s <= outs[1].latency_s


def test_the_cli_lists_and_compares_a_plugged_in_technique(plugged_in, tmp_path, capsys):
    from core.formats import save

    path = tmp_path / "problem.json"
    save(path, make_problem({"fast": 0.001, "slow": 0.004}))
    assert main(["techniques"]) == 0
    assert "whole-model: Whole model on one device" in capsys.readouterr().out
    assert main(["compare", str(path), "--technique", "whole-model", "--objective", "latency", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["problems"][0]["objectives"]["latency"]
    assert rows[0]["strategy"] == "fastest-device" and rows[0]["plan"]["device"] == "fast"
    assert main(["compare", str(path), "--technique", "nope"]) == 2
    assert "unknown technique 'nope'" in capsys.readouterr().err


def test_its_simulated_run_is_recorded_replayed_and_exported_by_the_shared_parts(plugged_in, tmp_path):
    problem = make_problem({"fast": 0.001, "slow": 0.004}, generated_tokens=5)
    plan = plugged_in.run_strategy(problem, plugged_in.exact, "latency").plan
    sim = plugged_in.simulate(problem, plan, "sequential")
    assert len(sim.events) == 5 and sim.figures.tokens == 5
    with SessionStore(tmp_path / "ws.sqlite") as store:
        run_id = store.create_run(store.create_session("seam"), model="tiny-test", mode="sequential",
                                  kind="predicted")
        append_predicted(store, run_id, sim.events, sim.tokens)
        store.finish_run(run_id, "completed", sim.figures)
        assert store.events(run_id) == list(sim.events) and store.tokens(run_id) == list(sim.tokens)
        replay = Replay.from_store(store, run_id)
        assert replay.duration_s == pytest.approx(sim.events[-1].end_s, abs=1e-6)
    trace = chrome_trace(sim.events, sim.tokens)
    boxes = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert len(boxes) == 5
