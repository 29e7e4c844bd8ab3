"""A run of expert-offload stages that loses a device is re-planned by expert offloading's own planner
(issue 30 item 3): the survivors are placed with its memory model (a block's resident tensors and a
buffer of ``slots`` experts, not every expert), so a survivor too small for the whole model with every
expert resident takes the run where layer sharding's re-plan finds none; the re-planned stage keeps
the kind and options (slots, policy) of the stages it replaces, and the tokens are transformers' own
generate's. Agents are separate processes; one is SIGKILLed mid-decode."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from core.models.checkpoints import ModelRecipe, make_model
from core.models.units import load_model_spec
from core.planning.plan import plan_from_boundaries
from core.planning.problem import Workload
from core.planning.scenarios import DeviceSpec, synthetic_problem
from core.runs.recovery import ExactReplanner, RecoveryImpossible, keep_stage_settings
from core.techniques import replanner_for
from core.techniques.expert_offload.problem import OffloadPlan
from core.techniques.expert_offload.recovery import OffloadReplanner
from core.techniques.expert_offload.running import run_plan

LAYERS, EXPERTS, SLOTS, DEVICES = 3, 4, 2, ("edge-0", "edge-1")


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    """(checkpoint, a 2-stage expert-offload plan, a problem whose edge-0 holds the resident model and a
    buffer of SLOTS experts but not every expert)."""
    model = make_model(ModelRecipe(family="mixtral", layers=LAYERS, hidden=64, heads=4, kv_heads=2, vocab=512,
                                   seed=5, experts=EXPERTS), tmp_path_factory.mktemp("moe-recovery") / "tiny-mixtral")
    sharded = plan_from_boundaries("tiny-mixtral", LAYERS + 2, list(DEVICES), [2])
    plan = run_plan(OffloadPlan(device="edge-0", slots=SLOTS, policy="lru", preload=0), model, sharded=sharded)
    spec = load_model_spec(str(model), "fp32", name="tiny-mixtral")
    experts = sum(u.param_bytes for u in spec.units) - sum(
        u.param_bytes for u in OffloadReplanner(synthetic_problem(
            [DeviceSpec(id=d, tflops=1.0, memory_bandwidth_gb_s=10.0, memory_gib=1.0) for d in DEVICES], spec),
            model).planning_problem(plan).profile.model.units)
    budget = sum(u.param_bytes for u in spec.units) - experts // 2  # half the experts short of the whole model
    problem = synthetic_problem([DeviceSpec(id=d, tflops=1.0, memory_bandwidth_gb_s=10.0, memory_gib=budget / 2**30)
                                 for d in DEVICES], spec,
                                workload=Workload(prompt_tokens=6, generated_tokens=24, batch_size=1))
    return model, plan, problem


def test_layer_shardings_replan_finds_no_plan_where_expert_offloadings_does(setting):
    model, plan, problem = setting
    with pytest.raises(RecoveryImpossible):
        ExactReplanner(problem)(plan, "edge-1", DEVICES)
    replanner = replanner_for(plan, problem, str(model))
    assert isinstance(replanner, OffloadReplanner)
    replanned = keep_stage_settings(plan, replanner(plan, "edge-1", DEVICES))  # as the coordinator gives it back
    assert replanned.devices() == ("edge-0",) and replanned.stages[0].options["slots"] == SLOTS  # it fits: kept


def _with_slots(plan, slots: int):
    import msgspec

    return msgspec.structs.replace(plan, stages=tuple(
        msgspec.structs.replace(s, options={**s.options, "slots": slots}) for s in plan.stages))


def test_a_run_that_loses_a_device_resumes_on_a_replanned_expert_offload_stage_with_hf_tokens(setting, tmp_path):
    """The run's buffer is SLOTS + 1 experts; the survivor holds the resident model and SLOTS: the resumed
    stage gets SLOTS (the largest buffer that fits) and the rest of the plan's options."""
    from agents.protocol import LinkShape, SamplingSpec
    from core.devices.local_cluster import LocalCluster
    from core.runs.coordinator import Coordinator, RunRequest
    from core.runs.generation import load_tokenizer
    from tests.core.hf_reference import hf_greedy_new_tokens

    model, fitting, _ = setting
    plan, problem = _with_slots(fitting, SLOTS + 1), _survivor_budget(setting, SLOTS + 0.5)
    tok = load_tokenizer(str(model))
    enc = tok(["the cat sat on the"], return_tensors="pt")
    request = RunRequest(input_ids=tuple(map(tuple, enc["input_ids"].tolist())),
                         attention_mask=tuple(map(tuple, enc["attention_mask"].tolist())), max_new_tokens=24,
                         eos_token_ids=(), pad_token_id=0, sampling=SamplingSpec())
    with LocalCluster(tmp_path / "cluster", list(DEVICES)) as cluster, \
            Coordinator(cluster.endpoints, cluster.keys, heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0) as co:
        killed = threading.Event()

        class KillAtStep4:
            def on_event(self, event):
                pass

            def on_tokens(self, tokens):
                if tokens.step >= 4 and not killed.is_set():
                    killed.set()
                    os.kill(cluster.pid_of("edge-1"), signal.SIGKILL)

        co.load(plan, str(model), kind={s.device: s.kind for s in plan.stages},
                links={d: LinkShape(latency_ms=15) for d in DEVICES})
        result = co.run(plan, request, KillAtStep4(), replan=replanner_for(plan, problem, str(model)))
    assert killed.is_set() and [r.failed for r in result.recoveries] == ["edge-1"]
    assert [(s.device, s.kind, s.options) for s in result.plan.stages] == [
        ("edge-0", "expert-offload", fitting.stages[0].options)]
    assert result.plan.stages[0].options["slots"] == SLOTS and result.plan.stages[0].options["policy"] == "lru"
    expected = hf_greedy_new_tokens(str(model), enc, 24, eos_token_id=None)
    assert [tuple(t) for t in result.tokens] == [tuple(t) for t in expected]


def _survivor_budget(setting, buffer_slots: float):
    """A problem whose devices hold the resident model and ``buffer_slots`` experts' worth of buffer."""
    model, plan, _ = setting
    spec = load_model_spec(str(model), "fp32", name="tiny-mixtral")
    resident = OffloadReplanner(synthetic_problem(
        [DeviceSpec(id=d, tflops=1.0, memory_bandwidth_gb_s=10.0, memory_gib=1.0) for d in DEVICES], spec),
        model).planning_problem(plan).profile.model
    expert = (sum(u.param_bytes for u in spec.units) - sum(u.param_bytes for u in resident.units)) // (LAYERS * EXPERTS)
    budget = sum(u.param_bytes for u in resident.units) + buffer_slots * expert
    return synthetic_problem([DeviceSpec(id=d, tflops=1.0, memory_bandwidth_gb_s=10.0, memory_gib=budget / 2**30)
                              for d in DEVICES], spec, workload=Workload(prompt_tokens=6, generated_tokens=24, batch_size=1))


def test_a_survivor_too_small_for_the_plans_expert_buffer_gets_the_largest_buffer_that_fits(setting):
    model, plan, _ = setting
    wide = _with_slots(plan, 4)
    replanned = keep_stage_settings(wide, OffloadReplanner(_survivor_budget(setting, 2.5), model)(wide, "edge-1", DEVICES))
    assert [(s.device, s.kind, s.options) for s in replanned.stages] == [
        ("edge-0", "expert-offload", {**plan.stages[0].options, "slots": 2})]


def test_a_survivor_that_cannot_hold_one_expert_slot_is_a_recovery_error_naming_the_buffer(setting):
    model, plan, _ = setting
    with pytest.raises(RecoveryImpossible, match=f"expert buffer of 1 slot; the plan's was {SLOTS}") as info:
        OffloadReplanner(_survivor_budget(setting, 0.5), model)(plan, "edge-1", DEVICES)
    assert info.value.device == "edge-1" and info.value.missing_bytes > 0
