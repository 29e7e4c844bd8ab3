"""Through real agents: a run's stages reserve its KV cache at load, so the bytes are reported
before the first token, a plan whose weights fit but whose cache does not is refused at load,
and a loaded plan too small for the next run is reloaded instead of failing mid-run."""

from __future__ import annotations

import pytest
import transformers  # noqa: F401  (imported once here: agents' worker threads import it concurrently)

from agents.agent import Agent
from agents.emulation import DeviceEmulation
from agents.protocol import KvReservation
from agents.shard import StageExecutor
from agents.transport import CurveKeys
from core.errors import ShardOverBudget
from core.models.checkpoints import ModelRecipe, make_model
from core.planning.plan import plan_from_boundaries
from core.runs.batching import kv_covers, kv_reservation, split_micro_batches
from core.runs.coordinator import AgentEndpoint, Coordinator
from core.runs.generation import GenerationSettings, generate, load_tokenizer
from tests.core.hf_reference import hf_greedy_new_tokens

PROMPTS = ["the cat sat", "a much longer prompt about the river", "hello"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    recipe = ModelRecipe(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=11)
    return str(make_model(recipe, tmp_path_factory.mktemp("kv") / "tiny-llama"))


def _cluster(budgets: dict[str, int | None]):
    keys = CurveKeys.generate()
    agents = [Agent(d, keys.public, emulation=DeviceEmulation(memory_budget_bytes=b or 0)).start()
              for d, b in budgets.items()]
    co = Coordinator([AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents], keys)
    co.open()
    return co, agents


def _close(co, agents):
    co.close()
    for a in agents:
        a.close()


def _need(n_sequences, micro_batches, context):
    return kv_reservation(split_micro_batches(n_sequences, micro_batches), context)


def test_a_reservation_covers_runs_no_larger_than_it():
    loaded = _need(4, 2, 40)
    assert loaded == KvReservation(groups=2, sequences=2, context_tokens=40)
    assert kv_covers(loaded, _need(3, 2, 40)) and kv_covers(loaded, _need(2, 1, 12))
    assert not kv_covers(loaded, _need(4, 2, 41))
    assert not kv_covers(loaded, _need(6, 2, 40))
    assert not kv_covers(loaded, _need(6, 3, 40))
    assert kv_covers(KvReservation(), _need(64, 4, 4096))  # nothing reserved: the cache grows


def test_a_run_reports_its_reserved_kv_bytes_before_the_first_token_and_gives_hf_tokens(model_dir):
    co, agents = _cluster({"a": None, "b": None})
    try:
        co.wait_ready(30)
        plan = plan_from_boundaries("tiny-llama", 6, ["a", "b"], [3])
        tok = load_tokenizer(model_dir)
        enc = tok(PROMPTS, return_tensors="pt", padding=True)
        out = generate(co, plan, model_dir, PROMPTS, GenerationSettings(max_new_tokens=6, mode="bubbles",
                                                                        micro_batches=2))
        expected = hf_greedy_new_tokens(model_dir, enc, 6)
        assert [list(t) for t in out.result.tokens] == [list(t) for t in expected]
        kv = co.reserved_kv
        assert kv == KvReservation(groups=2, sequences=2, context_tokens=enc["input_ids"].shape[1] + 6)
        st = co.status()
        # "a" holds units [0, 3): embedding + 2 blocks; K and V of 2 kv heads x 16 dims in fp32
        assert st["a"].kv_reserved_bytes == 2 * 2 * 2 * kv.sequences * 2 * kv.context_tokens * 16 * 4
        assert st["b"].kv_reserved_bytes == 2 * 2 * 2 * kv.sequences * 2 * kv.context_tokens * 16 * 4
    finally:
        _close(co, agents)


def test_a_plan_whose_weights_fit_but_whose_kv_cache_does_not_is_refused_at_load(model_dir):
    long_run = KvReservation(groups=4, sequences=8, context_tokens=512)
    stage = StageExecutor(model_dir, 0, 3, kv=long_run)
    weights, cache = stage.memory_bytes(), stage.kv_reserved_bytes
    assert cache > 0
    co, agents = _cluster({"a": weights + cache // 2, "b": None})
    try:
        co.wait_ready(30)
        plan = plan_from_boundaries("tiny-llama", 6, ["a", "b"], [3])
        co.load(plan, model_dir, kv=KvReservation(groups=1, sequences=1, context_tokens=16))  # a short run fits
        with pytest.raises(ShardOverBudget, match=r"a.*reserved KV cache.*memory budget"):
            co.load(plan, model_dir, kv=long_run, timeout_s=60)
        assert co.status()["a"].memory_bytes == 0  # nothing stays loaded
    finally:
        _close(co, agents)


def test_a_loaded_plan_too_small_for_the_next_run_is_reloaded_not_failed_mid_run(model_dir):
    co, agents = _cluster({"a": None, "b": None})
    try:
        co.wait_ready(30)
        plan = plan_from_boundaries("tiny-llama", 6, ["a", "b"], [3])
        generate(co, plan, model_dir, PROMPTS[:1], GenerationSettings(max_new_tokens=2))
        short = co.reserved_kv
        out = generate(co, plan, model_dir, PROMPTS, GenerationSettings(max_new_tokens=8, mode="no-bubbles",
                                                                         micro_batches=3), load=False)
        assert co.reserved_kv.groups == 3 and co.reserved_kv.context_tokens > short.context_tokens
        tok = load_tokenizer(model_dir)
        expected = hf_greedy_new_tokens(model_dir, tok(PROMPTS, return_tensors="pt", padding=True), 8)
        assert [list(t) for t in out.result.tokens] == [list(t) for t in expected]
    finally:
        _close(co, agents)


@pytest.mark.parametrize("start,end", [(0, 3), (1, 5), (3, 6), (0, 1)])
def test_the_planners_kv_bytes_are_what_a_stage_reserves_at_load(model_dir, start, end):
    """The cost model's memory term (Σ kv_bytes_per_token · sequences · context) is the cache an
    agent really allocates, so a plan the solver fits also loads."""
    from core.models.units import load_model_spec

    spec = load_model_spec(model_dir, dtype="fp32")
    kv = KvReservation(groups=3, sequences=2, context_tokens=37)
    planned = sum(u.kv_bytes_per_token for u in spec.units[start:end]) * kv.groups * kv.sequences * kv.context_tokens
    assert StageExecutor(model_dir, start, end, kv=kv).kv_reserved_bytes == planned
