"""The agents and the simulator perform one schedule (agents.schedule): for every run mode,
1-4 micro-batches and 1-4 stages, each stage of a real run computes and sends the same
steps in the same order as the simulated run and as the schedule says, and the tokens
equal the unpartitioned model's. The micro-batch count reaches the agents from the plan
(the request does not name it)."""

from __future__ import annotations

import pytest
import transformers  # noqa: F401  (imported once here: agents' worker threads import it concurrently)

from agents.agent import Agent
from agents.protocol import RUN_MODES
from agents.schedule import Compute, Send, stage_operations
from agents.transport import CurveKeys
from core.models.checkpoints import ModelRecipe, make_model
from core.planning.plan import plan_from_boundaries
from core.runs.coordinator import AgentEndpoint, Coordinator, RunRequest, split_micro_batches
from core.runs.generation import load_tokenizer
from core.runs.simulator import simulate
from tests.core.hf_reference import hf_greedy_new_tokens
from tests.core.sessions_problems import make_problem

DEVICES = ["a", "b", "c", "d"]
BOUNDARIES = {1: [], 2: [2], 3: [2, 3], 4: [1, 3, 4]}
"""First unit of stages 1.. over the tiny model's 6 units (embedding, 4 blocks, head)."""
PROMPTS = ["the cat sat", "a much longer prompt about the river", "hello", "one two three four"]
NEW_TOKENS = 3
CASES = [(stages, mode, k) for stages in (1, 2, 3, 4) for mode in RUN_MODES for k in (1, 2, 3, 4)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    recipe = ModelRecipe(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=11)
    return str(make_model(recipe, tmp_path_factory.mktemp("schedule") / "tiny-llama"))


@pytest.fixture(scope="module")
def request_and_reference(model_dir):
    enc = load_tokenizer(model_dir)(PROMPTS, return_tensors="pt", padding=True)
    reference = hf_greedy_new_tokens(model_dir, enc, NEW_TOKENS)
    assert all(len(r) == NEW_TOKENS for r in reference), "an early EOS would shorten the schedule"
    return enc, reference


@pytest.fixture(scope="module")
def cluster(model_dir):
    """Four agents and one coordinator for every case; a case loads its plan if needed."""
    keys = CurveKeys.generate()
    agents = [Agent(d, keys.public).start() for d in DEVICES]
    coordinator = Coordinator([AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents], keys)
    coordinator.open()
    yield coordinator
    coordinator.close()
    for a in agents:
        a.close()


def _order(events, device, kind):
    mine = sorted((e for e in events if e.device == device and e.kind == kind), key=lambda e: e.start_s)
    return [(e.phase, e.step, e.micro_batch) for e in mine]


def _scheduled(ops, kind):
    return [(op.phase, op.step, op.micro_batch) for op in ops if isinstance(op, kind)]


@pytest.mark.parametrize("stages, mode, k", CASES, ids=[f"{s}stages-{m}-{k}mb" for s, m, k in CASES])
def test_agents_and_simulator_perform_the_same_operations_in_the_same_order_per_stage(
        cluster, model_dir, request_and_reference, stages, mode, k):
    enc, reference = request_and_reference
    devices = DEVICES[:stages]
    plan = plan_from_boundaries("tiny-llama", 6, devices, BOUNDARIES[stages], micro_batches=k)
    if not cluster.is_loaded(plan, model_dir):
        cluster.load(plan, model_dir)
    request = RunRequest(input_ids=tuple(map(tuple, enc["input_ids"].tolist())),
                         attention_mask=tuple(map(tuple, enc["attention_mask"].tolist())),
                         max_new_tokens=NEW_TOKENS, mode=mode, eos_token_ids=(2,), pad_token_id=0)
    real = cluster.run(plan, request)
    assert list(real.tokens) == reference
    assert {t.micro_batch for t in real.token_events} == set(range(k)), "the plan's count reached the source"

    problem = make_problem({d: 0.001 * (i + 1) for i, d in enumerate(devices)}, blocks=4,
                           generated_tokens=NEW_TOKENS)
    sizes = tuple(len(g) for g in split_micro_batches(len(PROMPTS), k))
    sim_plan = plan_from_boundaries(problem.profile.model.name, 6, devices, BOUNDARIES[stages])
    simulated = simulate(problem, sim_plan, mode, micro_batch_sizes=sizes, generated_tokens=NEW_TOKENS)

    schedule = stage_operations([(s.start, s.end) for s in plan.stages], mode, len(sizes), NEW_TOKENS)
    for j, device in enumerate(devices):
        for kind, op in (("compute", Compute), ("send", Send)):
            expected = _scheduled(schedule[j], op)
            assert _order(real.events, device, kind) == expected, (device, kind, "agents")
            assert _order(simulated.events, device, kind) == expected, (device, kind, "simulator")
