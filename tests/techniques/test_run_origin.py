"""A technique's run keeps its origin (the technique's own problem and plan) in the workspace, and a
replay is predicted from it exactly as the live run was: the ghosts the Run screen (or the technique's
own recording) drew, computed here from the original values and compared with what the reopened
workspace gives, no GUI involved."""

from __future__ import annotations

import msgspec
import pytest

from core.planning.plan import ShardPlan, Stage
from core.runs.batching import batching_settings
from core.runs.prediction import PlanOrigin, predict_origin_run
from core.sessions.origin import RecordedOrigin
from core.sessions.recording import record_run
from core.sessions.store import SessionStore
from core.techniques import technique_named
from core.techniques.run_origin import plan_origin, recorded_origin, replay_prediction

PROMPTS = ["the river", "hello there", "love is"]
MAX_NEW = 6


def _attention_offload():
    from core.techniques.attention_offload.run import dense_plan
    from core.techniques.attention_offload.scenarios import edge

    problem = edge()
    plan = technique_named("attention-offload").run_strategy(problem, "exact", "latency").plan
    return problem, plan, dense_plan("tiny-llama", 4, plan.compute[0])


def _expert_offload():
    from core.techniques.expert_offload.scenarios import paper_shaped

    problem = paper_shaped()
    plan = technique_named("expert-offload").run_strategy(problem, "edgemoe", "latency").plan
    return problem, plan, ShardPlan(model="demo-moe", num_units=2,
                                    stages=(Stage(device=plan.device, start=0, end=2, kind="expert-offload"),))


def _stored_and_reopened(tmp_path, technique: str, problem, plan, run_plan: ShardPlan, override: int | None):
    """Record the run as the Run screen's ``run_and_record`` does (a technique other than layer
    sharding recorded in mode "sequential"), close the workspace, and read it back as Sessions does."""
    origin = PlanOrigin(technique_named(technique), problem, plan)
    path = tmp_path / "ws.sqlite"
    with record_run(path, model=run_plan.model, mode="sequential", plan=run_plan, origin=recorded_origin(origin),
                    settings={"prompts": PROMPTS, "max_new_tokens": MAX_NEW, "technique": technique,
                              "mode": "sequential", **batching_settings(run_plan, override)}) as run:
        run.status = "completed"
    with SessionStore(path) as store:
        info = store.run(run.run_id)
        return origin, info, store.plan(info.plan_id), store.origin_of(run.run_id)


@pytest.mark.parametrize("technique, made", [("attention-offload", _attention_offload),
                                             ("expert-offload", _expert_offload)])
@pytest.mark.parametrize("override", [None, 2])
def test_a_replayed_technique_run_is_predicted_as_the_live_run_screen_predicted_it(tmp_path, technique, made,
                                                                                   override):
    problem, plan, run_plan = made()
    origin, info, stored_plan, stored = _stored_and_reopened(tmp_path, technique, problem, plan, run_plan, override)
    # what the Run screen drew: its mode combo's pipeline mode, the prompts, the operator's override
    live = predict_origin_run(origin, run_plan, "no-bubbles", len(PROMPTS), override, MAX_NEW)
    events, note = replay_prediction(info, None, stored_plan, stored)
    assert len(live.result.events) > 0
    assert events == tuple(live.result.events) and note == live.note
    assert plan_origin(stored).problem == problem and plan_origin(stored).plan == plan


def test_a_replayed_spatial_run_draws_the_prediction_its_recording_stored_beside_it(tmp_path):
    from core.techniques.spatial.run import SpatialRun, record
    from core.techniques.spatial.scenarios import paper_shaped
    from core.techniques.spatial.simulator import simulate

    problem = paper_shaped(nodes=2)
    plan = technique_named("spatial").run_strategy(problem, "even", "latency").plan
    ran = simulate(problem, plan, images=3)  # the images a run on agents would have reported
    measured = SpatialRun(scores=((0.0,),) * 3, events=ran.events, tokens=ran.tokens, figures=ran.figures)
    measured_id, predicted_id = record(str(tmp_path / "ws.sqlite"), "spatial", problem, plan, measured)
    with SessionStore(tmp_path / "ws.sqlite") as store:
        info, stored = store.run(measured_id), store.origin_of(measured_id)
        beside = store.events(predicted_id)
    events, note = replay_prediction(info, None, None, stored)
    assert note == "" and len(events) == len(beside) > 0
    key = lambda e: (e.start_s, e.device, e.kind, e.step)  # noqa: E731 (stored in arrival order)
    assert sorted(events, key=key) == sorted(beside, key=key)


def test_a_replayed_epd_run_draws_its_pools_simulated_for_its_problem(tmp_path):
    from core.techniques.phase_disaggregation.scenarios import image_heavy_problem
    from core.techniques.phase_disaggregation.simulator import simulate_pools

    problem = image_heavy_problem(devices=4, requests=6)
    pools = technique_named("phase-disaggregation").run_strategy(problem, "aggregated", "throughput").plan
    with SessionStore(tmp_path / "ws.sqlite") as store:
        run_id = store.create_run(store.create_session("epd"), model="llava", mode="pools", kind="measured",
                                  settings={"technique": "phase-disaggregation"})
        store.set_origin(run_id, RecordedOrigin.of("phase-disaggregation", problem, pools))  # as run_layout does
    with SessionStore(tmp_path / "ws.sqlite") as store:
        events, note = replay_prediction(store.run(run_id), None, None, store.origin_of(run_id))
    assert events == simulate_pools(problem.costs, problem.workload, pools, record=True).events and note == ""


def test_an_origin_of_a_technique_this_studio_lacks_predicts_nothing_saying_why(tmp_path):
    problem, plan, run_plan = _expert_offload()
    _, info, stored_plan, stored = _stored_and_reopened(tmp_path, "expert-offload", problem, plan, run_plan, None)
    gone = msgspec.structs.replace(stored, technique="retired-technique")
    events, note = replay_prediction(info, None, stored_plan, gone)
    assert events == () and note.startswith("No prediction: unknown technique 'retired-technique'")
    bad = msgspec.structs.replace(stored, plan=msgspec.Raw(b'{"format": "edgeshard.expert-offload-plan"}'))
    events, note = replay_prediction(info, None, stored_plan, bad)
    assert events == () and note.startswith("No prediction: the recorded MoE expert offloading (EdgeMoE) problem")


def test_an_attention_offload_prediction_takes_the_runs_prompt_width_in_place_of_the_problems():
    from core.techniques.attention_offload.simulator import simulate

    problem, plan, run_plan = _attention_offload()
    width = problem.workload.prompt_tokens + 23  # the run's prompts, not the profile's 16
    origin = PlanOrigin(technique_named("attention-offload"), problem, plan)
    live = predict_origin_run(origin, run_plan, "no-bubbles", len(PROMPTS), None, MAX_NEW, prompt_tokens=width)
    # the technique's simulator called directly on a problem whose workload has those prompts, one batch of 3
    run_problem = msgspec.structs.replace(problem, workload=msgspec.structs.replace(problem.workload,
                                                                                    prompt_tokens=width))
    direct = simulate(run_problem, msgspec.structs.replace(plan, batch=len(PROMPTS), in_flight=1),
                      generated_tokens=MAX_NEW)
    assert tuple(live.result.events) == direct.events
    before = predict_origin_run(origin, run_plan, "no-bubbles", len(PROMPTS), None, MAX_NEW)

    def prefill_s(events):
        return sum(e.end_s - e.start_s for e in events if e.kind == "compute" and e.step == 0)

    assert prefill_s(live.result.events) > prefill_s(before.result.events)  # longer prompts, longer prefill


def test_a_replay_is_predicted_with_the_prompt_width_its_run_recorded(tmp_path):
    problem, plan, run_plan = _attention_offload()
    width = problem.workload.prompt_tokens + 23
    origin = PlanOrigin(technique_named("attention-offload"), problem, plan)
    path = tmp_path / "ws.sqlite"
    with record_run(path, model=run_plan.model, mode="sequential", plan=run_plan, origin=recorded_origin(origin),
                    settings={"prompts": PROMPTS, "max_new_tokens": MAX_NEW, "technique": "attention-offload",
                              "mode": "sequential", "prompt_tokens": width,
                              **batching_settings(run_plan, None)}) as run:
        run.status = "completed"
    with SessionStore(path) as store:
        info = store.run(run.run_id)
        events, _ = replay_prediction(info, None, store.plan(info.plan_id), store.origin_of(run.run_id))
    live = predict_origin_run(origin, run_plan, "no-bubbles", len(PROMPTS), None, MAX_NEW, prompt_tokens=width)
    assert events == tuple(live.result.events)
    assert events != tuple(predict_origin_run(origin, run_plan, "no-bubbles", len(PROMPTS), None, MAX_NEW).result.events)
