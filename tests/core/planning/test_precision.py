"""The memory model at a stage's weight precision: what it predicts is what an agent's stage holds
after loading (int8/int4 quantized by torchao), a plan can fit only because of 4-bit weights, and
plans carry the precision (since version 2; version-1 plans load as fp)."""

from __future__ import annotations

import json

import msgspec
import pytest

from agents.shard import StageExecutor
from core import formats
from core.devices.cluster import Cluster, Device, Link
from core.devices.profile import DeviceTimes, Profile
from core.models.checkpoints import ModelRecipe, make_model
from core.models.units import load_model_spec
from core.planning.cost import evaluate
from core.planning.plan import PLAN_VERSION, ShardPlan, layout_problems, plan_from_boundaries, with_weights
from core.planning.precision import precision_problems, stage_weight_bytes
from core.planning.problem import PlanningProblem, Workload

RECIPES = {
    "llama": ModelRecipe(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3),
    "qwen2": ModelRecipe(family="qwen2", layers=4, hidden=96, heads=4, kv_heads=2, vocab=512, seed=4),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("precision-models")
    return {family: str(make_model(recipe, root / family)) for family, recipe in RECIPES.items()}


@pytest.mark.parametrize("family", list(RECIPES))
@pytest.mark.parametrize("weights", ["fp", "int8", "int4"])
def test_predicted_weight_bytes_are_the_bytes_a_loaded_stage_holds(model_dirs, family, weights):
    spec = load_model_spec(model_dirs[family], "fp32")
    for start, end in ((0, 2), (2, 6), (1, 5), (0, 6)):
        held = StageExecutor(model_dirs[family], start, end, weights=weights).memory_bytes()
        assert stage_weight_bytes(spec, start, end, weights) == held, (start, end)


def _problem(spec, memory_bytes):
    cluster = Cluster(devices=tuple(Device(id=d, memory_bytes=memory_bytes) for d in ("a", "b")),
                      links=(Link(src="a", dst="b", bandwidth_mbit_s=100.0, latency_ms=1.0),
                             Link(src="b", dst="a", bandwidth_mbit_s=100.0, latency_ms=1.0)))
    n = spec.num_units
    times = tuple(DeviceTimes(device=d, decode_batch_sizes=(1,), decode_s=tuple((0.001,) for _ in range(n)),
                              prefill_token_counts=(4,), prefill_s=tuple((0.004,) for _ in range(n)))
                  for d in ("a", "b"))
    return PlanningProblem(profile=Profile(model=spec, cluster=cluster, times=times), source="a", memory_headroom=0.0,
                           workload=Workload(prompt_tokens=4, generated_tokens=4, batch_size=1))


def test_a_plan_over_budget_at_fp32_fits_with_its_blocks_at_int4(model_dirs):
    spec = load_model_spec(model_dirs["llama"], "fp32")
    plan = plan_from_boundaries(spec.name, spec.num_units, ["a", "b"], [3])
    needed = max(m.total_bytes for m in evaluate(_problem(spec, 1 << 40), with_weights(plan, "int4")).memory)
    problem = _problem(spec, needed)
    assert not evaluate(problem, plan).feasible
    assert not evaluate(problem, with_weights(plan, "int8")).feasible
    assert evaluate(problem, with_weights(plan, "int4")).feasible


def test_a_version_1_plan_loads_with_every_stage_at_fp(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"format": "edgeshard.plan", "version": 1, "model": "m", "num_units": 6,
                                "stages": [{"device": "a", "start": 0, "end": 3}, {"device": "b", "start": 3, "end": 6}]}))
    assert [s.weights for s in formats.load(path, ShardPlan).stages] == ["fp", "fp"]


def test_a_plan_keeps_each_stages_precision_through_its_file(tmp_path):
    plan = plan_from_boundaries("m", 6, ["a", "b"], [3])
    plan = msgspec.structs.replace(plan, stages=(plan.stages[0], msgspec.structs.replace(plan.stages[1], weights="int4")))
    formats.save(tmp_path / "p.json", plan)
    loaded = formats.load(tmp_path / "p.json", ShardPlan)
    assert loaded.version == PLAN_VERSION and [s.weights for s in loaded.stages] == ["fp", "int4"]


def test_an_unknown_precision_or_a_quantized_technique_stage_is_a_layout_problem():
    plan = plan_from_boundaries("m", 6, ["a", "b"], [3])
    odd = msgspec.structs.replace(plan, stages=(msgspec.structs.replace(plan.stages[0], weights="int2"),
                                                msgspec.structs.replace(plan.stages[1], weights="int8",
                                                                        kind="expert-offload")))
    problems = layout_problems(odd)
    assert any("weights 'int2'" in p for p in problems)
    assert any("only layers stages take int8 weights" in p for p in problems)


def test_a_gpt2_model_cannot_be_planned_at_int8(tmp_path):
    gpt2 = make_model(ModelRecipe(family="gpt2", layers=2, hidden=64, heads=4, vocab=512, seed=1), tmp_path / "g")
    spec = load_model_spec(gpt2, "fp32")
    plan = with_weights(plan_from_boundaries("g", spec.num_units, ["a"], []), "int8")
    assert precision_problems(plan, spec) == ["stage 0 (a) asks for int8 weights: agents quantize llama, mistral, "
                                              "qwen2 models, this one is gpt2 (use fp)"]


def test_a_version_3_plan_loads_with_every_stage_on_the_cpu(tmp_path):
    path = tmp_path / "v3.json"
    path.write_text(json.dumps({"format": "edgeshard.plan", "version": 3, "model": "m", "num_units": 6,
                                "stages": [{"device": "a", "start": 0, "end": 3, "weights": "int8"},
                                           {"device": "b", "start": 3, "end": 6}]}))
    assert [s.torch_device for s in formats.load(path, ShardPlan).stages] == ["cpu", "cpu"]


def test_a_stage_on_an_unknown_torch_device_is_a_layout_problem_naming_the_device():
    plan = plan_from_boundaries("m", 6, ["a", "b"], [3])
    odd = msgspec.structs.replace(plan, stages=(plan.stages[0], msgspec.structs.replace(plan.stages[1],
                                                                                        torch_device="gpu0")))
    assert layout_problems(odd) == ["stage 1 (b): torch_device must be cpu, cuda or cuda:N, got 'gpu0'"]
