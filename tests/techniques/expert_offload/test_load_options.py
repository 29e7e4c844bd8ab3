"""An expert-offload stage's settings travel in its load message (issue 30 item 3): the agent builds the
stage from ``LoadShard.options`` (not from ``expert-offload.json`` beside its copy of the checkpoint),
checks the hashes of the files it reads, receives those files with shipped weights, and a recovery
keeps the stage's kind and settings. Real agents (in this process: what is checked is the loaded
executor's state) over a generated Mixtral."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers  # noqa: F401  (imported once here: agents' worker threads import it concurrently)

from agents.agent import Agent
from agents.techniques.expert_offload.offload import write_quantized_experts
from agents.transport import CurveKeys
from core.errors import RunFailed
from core.models.checkpoints import ModelRecipe, make_model
from core.planning.plan import ShardPlan, Stage, plan_from_boundaries
from core.runs.coordinator import AgentEndpoint, Coordinator
from core.runs.recovery import RecoveryImpossible, keep_stage_settings
from core.runs.weights import ship_stage_weights
from core.techniques import technique_named
from core.techniques.expert_offload.problem import OffloadPlan

LAYERS, EXPERTS = 3, 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A Mixtral with two experts quantised and an activation profile beside it, configured for 2 LRU slots."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("moe-options")
    model = make_model(ModelRecipe(family="mixtral", layers=LAYERS, hidden=64, heads=4, kv_heads=2, vocab=512,
                                   seed=5, experts=EXPERTS), folder / "tiny-mixtral")
    write_quantized_experts(str(model), {(0, 1): 4, (2, 3): 8})
    save_file({"transitions": torch.ones(LAYERS - 1, EXPERTS, EXPERTS)}, str(model / "expert-profile.safetensors"))
    return model


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    keys = CurveKeys.generate()
    store = tmp_path_factory.mktemp("on-device")
    agents = [Agent(d, keys.public, weights_dir=store / d).start() for d in ("edge-0", "edge-1")]
    coordinator = Coordinator([AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents], keys)
    coordinator.open()
    yield coordinator, {a.device: a for a in agents}
    coordinator.close()
    for a in agents:
        a.close()


def _run_plan(model) -> ShardPlan:
    return technique_named("expert-offload").run_plan(OffloadPlan(device="edge-0", slots=2, policy="lru",
                                                                  preload=0), model)


def _executor(agent):
    executor = agent._loaded.executor
    return getattr(executor, "inner", executor)


def test_the_stage_runs_the_settings_of_its_load_message_not_a_stale_file_beside_the_checkpoint(cluster, model,
                                                                                                  tmp_path):
    coordinator, agents = cluster
    plan = _run_plan(model)
    copy = tmp_path / "device-copy"  # the device's own copy of the checkpoint, with a stale options file
    shutil.copytree(model, copy)
    (copy / "expert-offload.json").write_text(json.dumps({"slots": 7, "policy": "lfu", "preload": 3}))
    coordinator.load(plan, str(copy), kind={"edge-0": "expert-offload"})
    executor = _executor(agents["edge-0"])
    assert (executor.slots, executor.policy, executor.preload_count) == (2, "lru", 0)
    assert executor.store.expert_bits == {(0, 1): 4, (2, 3): 8}
    assert executor.predictor.transitions.sum() == (LAYERS - 1) * EXPERTS * EXPERTS  # the profile was read


def test_a_quantised_experts_file_other_than_the_plans_is_refused_at_load(cluster, model, tmp_path):
    coordinator, _ = cluster
    plan = _run_plan(model)
    copy = tmp_path / "stale"
    shutil.copytree(model, copy)
    write_quantized_experts(str(copy), {(0, 1): 2, (2, 3): 8})  # another adaptation: other codes
    with pytest.raises(RunFailed, match="experts-quantized.safetensors is not the file the plan was made with"):
        coordinator.load(plan, str(copy), kind={"edge-0": "expert-offload"})


def test_an_expert_offload_load_without_its_settings_is_refused(cluster, model):
    coordinator, _ = cluster
    bare = ShardPlan(model="tiny-mixtral", num_units=LAYERS + 2,
                     stages=(Stage(device="edge-0", start=0, end=LAYERS + 2, kind="expert-offload"),))
    with pytest.raises(RunFailed, match="settings travel in its load message"):
        coordinator.load(bare, str(model), kind={"edge-0": "expert-offload"})


def test_shipped_weights_carry_every_file_the_stage_reads(cluster, model, tmp_path):
    coordinator, agents = cluster
    plan = _run_plan(model)
    report = ship_stage_weights(coordinator, plan, model, cache_dir=tmp_path / "slices")
    assert {n for n, _ in report.files["edge-0"]} >= {"experts-quantized.safetensors", "expert-profile.safetensors"}
    coordinator.load(plan, "/nowhere/tiny-mixtral", files=report.files, kind={"edge-0": "expert-offload"})
    executor = _executor(agents["edge-0"])
    assert executor.store.expert_bits == {(0, 1): 4, (2, 3): 8}
    assert executor.store.read(0, 1)[0].dtype == torch.uint8  # read packed from the shipped quantised file


def test_a_stage_file_changed_since_planning_is_refused_before_anything_is_sent(cluster, model, tmp_path):
    coordinator, _ = cluster
    plan = _run_plan(model)
    copy = tmp_path / "changed"
    shutil.copytree(model, copy)
    (copy / "expert-profile.safetensors").write_bytes(b"not the profile")
    with pytest.raises(RunFailed, match="expert-profile.safetensors is not the file the plan was made with"):
        ship_stage_weights(coordinator, plan, copy, cache_dir=tmp_path / "slices")


# ----- recovery keeps the kind and the settings (a pure decision over plans) ----------------------------
OPTIONS = {"kind": "expert-offload", "slots": 2, "policy": "lru", "preload": 0}


def _plan(*stages) -> ShardPlan:
    return ShardPlan(model="m", num_units=7, stages=tuple(Stage(device=d, start=a, end=b, kind=k, options=o)
                                                          for d, a, b, k, o in stages))


def test_a_recovered_one_stage_expert_offload_plan_keeps_its_kind_and_settings_on_every_new_stage():
    old = _plan(("a", 0, 7, "expert-offload", OPTIONS))
    replanned = plan_from_boundaries("m", 7, ["b", "c"], [3])  # what the layer solver gives: plain layers
    kept = keep_stage_settings(old, replanned)
    assert [(s.device, s.kind, s.options) for s in kept.stages] == [("b", "expert-offload", OPTIONS),
                                                                   ("c", "expert-offload", OPTIONS)]
    embedding_alone = keep_stage_settings(old, plan_from_boundaries("m", 7, ["b", "c"], [1]))
    assert [(s.kind, s.options) for s in embedding_alone.stages] == [("layers", None), ("expert-offload", OPTIONS)]


def test_a_recovered_mixed_plan_gives_the_kind_to_the_stages_holding_its_blocks_only():
    old = _plan(("a", 0, 1, "layers", None), ("b", 1, 6, "expert-offload", OPTIONS), ("c", 6, 7, "layers", None))
    kept = keep_stage_settings(old, plan_from_boundaries("m", 7, ["a", "c"], [1]))
    assert [(s.kind, s.options) for s in kept.stages] == [("layers", None), ("expert-offload", OPTIONS)]


def test_a_plan_with_two_different_stage_settings_is_not_re_split():
    other = dict(OPTIONS, slots=3)
    old = _plan(("a", 0, 3, "expert-offload", OPTIONS), ("b", 3, 7, "expert-offload", other))
    with pytest.raises(RecoveryImpossible, match="different kinds or settings"):
        keep_stage_settings(old, plan_from_boundaries("m", 7, ["c"], []))


def test_a_run_that_loses_a_device_resumes_on_expert_offload_stages_with_their_settings_and_hf_tokens(model,
                                                                                                     tmp_path):
    """Two agents each offloading their own blocks' experts; one is closed mid-decode: the re-plan puts
    the whole model on the survivor as an expert-offload stage with the plan's buffer (not a layers
    stage with every expert resident), and the tokens are transformers' own generate's."""
    import threading

    from agents.protocol import LinkShape, SamplingSpec
    from agents.techniques.expert_offload.offload import ExpertOffloadExecutor
    from core.models.units import load_model_spec
    from core.planning.problem import Workload
    from core.planning.scenarios import DeviceSpec, synthetic_problem
    from core.runs.coordinator import RunRequest
    from core.runs.generation import load_tokenizer
    from core.runs.recovery import ExactReplanner
    from tests.core.hf_reference import hf_greedy_new_tokens

    from core.techniques.expert_offload.running import run_plan

    full = tmp_path / "tiny-mixtral"  # full-precision experts: transformers' generate is then the reference
    shutil.copytree(model, full, ignore=shutil.ignore_patterns("experts-quantized.safetensors", "expert-offload.json"))
    model = full
    sharded = plan_from_boundaries("tiny-mixtral", LAYERS + 2, ["edge-0", "edge-1"], [2])
    plan = run_plan(OffloadPlan(device="edge-0", slots=2, policy="lru", preload=0), model, sharded=sharded)
    spec = load_model_spec(str(model), "fp32", name="tiny-mixtral")
    problem = synthetic_problem([DeviceSpec(id=d, tflops=1.0, memory_bandwidth_gb_s=10.0, memory_gib=1.0)
                                 for d in ("edge-0", "edge-1")], spec,
                                workload=Workload(prompt_tokens=6, generated_tokens=24, batch_size=1))
    tok = load_tokenizer(str(model))
    enc = tok(["the cat sat on the"], return_tensors="pt")
    request = RunRequest(input_ids=tuple(map(tuple, enc["input_ids"].tolist())),
                         attention_mask=tuple(map(tuple, enc["attention_mask"].tolist())), max_new_tokens=24,
                         eos_token_ids=(), pad_token_id=0, sampling=SamplingSpec())
    keys = CurveKeys.generate()
    agents = {d: Agent(d, keys.public).start() for d in ("edge-0", "edge-1")}

    class CloseAt:
        def __init__(self):
            self.closed = threading.Event()

        def on_event(self, event):
            pass

        def on_tokens(self, tokens):
            if tokens.step >= 4 and not self.closed.is_set():
                self.closed.set()
                threading.Thread(target=agents["edge-1"].close, daemon=True).start()

    try:
        with Coordinator([AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents.values()], keys,
                         heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0) as co:
            co.load(plan, str(model), kind={s.device: s.kind for s in plan.stages},
                    links={d: LinkShape(latency_ms=15) for d in agents})
            closer = CloseAt()
            result = co.run(plan, request, closer, replan=ExactReplanner(problem))
            assert closer.closed.is_set() and result.recoveries and result.plan.devices() == ("edge-0",)
            assert [(s.kind, s.options) for s in result.plan.stages] == [("expert-offload", plan.stages[0].options)]
            executor = _executor(agents["edge-0"])
            assert isinstance(executor, ExpertOffloadExecutor) and (executor.slots, executor.policy) == (2, "lru")
            expected = hf_greedy_new_tokens(str(model), enc, 24, eos_token_id=None)
            assert [tuple(t) for t in result.tokens] == [tuple(t) for t in expected]
    finally:
        for a in agents.values():
            a.close()
