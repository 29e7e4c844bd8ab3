"""EPD agents check a request's KV cache against their memory budget before they take it: over agent
processes with emulated budgets, a prefill whose prompt's KV or a decode whose context and output
tokens would exceed the budget (beside the weights) is refused with ``ShardOverBudget`` naming the
device, the need and the budget, and the agent stays ready; a request within the budget runs."""

from __future__ import annotations

import pytest

from agents.emulation import DeviceEmulation
from agents.protocol import AgentState
from core.errors import ShardOverBudget
from core.techniques.phase_disaggregation.memory import phase_weights
from core.techniques.phase_disaggregation.runtime import load_pools, prepare_requests, reference_tokens, run_epd
from core.techniques.phase_disaggregation.types import PoolConfig, Request, Workload

POOLS = PoolConfig(encode=("e",), prefill=("p",), decode=("d",), decode_batch=1)
KV_TOKEN = 2 * 2 * 2 * 16 * 4  # the tiny Llava: layers × (k, v) × kv heads × head dim × float32
ROOM = {"p": 120, "d": 400}  # tokens of KV cache each budget leaves beside the text model's weights (the decode
# agent's holds any prompt the prefill agent's does: a refusal is the prefill's, not one raced by the decode's)


def one(tiles: int, output: int) -> Workload:
    return Workload(requests=(Request(id=0, arrival_s=0.0, images=1, tiles_per_image=tiles, prompt_tokens=6,
                                      output_tokens=output),))


@pytest.fixture(scope="module")
def link(tmp_path_factory, model):
    from core.devices.agent_link import AgentLink
    from core.devices.local_cluster import LocalCluster

    budget = {d: DeviceEmulation(memory_budget_bytes=phase_weights(model).text_bytes + room * KV_TOKEN)
              for d, room in ROOM.items()}
    emulation = {"e": DeviceEmulation(memory_budget_bytes=phase_weights(model).encode_bytes + (1 << 20)), **budget}
    with LocalCluster(tmp_path_factory.mktemp("epd-budget"), ["e", "p", "d"], emulation=emulation) as lc, \
            AgentLink(lc.endpoints, lc.keys, heartbeat_timeout_s=30.0, request_timeout_s=60.0) as link:
        link.wait_ready(timeout_s=30)
        load_pools(link, model, POOLS)
        yield link


def test_a_request_within_the_budget_runs(link, model):
    work = one(tiles=2, output=6)  # 2 × 16 multimodal tokens and the prompt, 6 out: well inside both
    prepared = prepare_requests(model, work)
    assert run_epd(link, model, work, POOLS, prepared=prepared, load=False).tokens == reference_tokens(model, prepared)


def test_a_prompt_whose_kv_cache_exceeds_the_prefill_agents_budget_is_refused_naming_need_and_budget(link, model):
    work = one(tiles=8, output=2)  # 8 × 16 multimodal tokens and the prompt: over 120
    tokens = len(prepare_requests(model, work)[0].input_ids)
    with pytest.raises(ShardOverBudget) as refused:
        run_epd(link, model, work, POOLS, load=False)
    message = str(refused.value)
    assert refused.value.device == "p" and "over_budget" in message
    assert f"prompt of {tokens} tokens needs {tokens * KV_TOKEN / 2**20:.1f} MiB of KV cache" in message
    assert "device p has a 0.8 MiB memory budget" in message
    assert link.status_of(["p"])["p"].state == AgentState.READY


def test_a_decode_whose_context_and_output_exceed_the_decode_agents_budget_is_refused_before_it_joins(link, model):
    work = one(tiles=2, output=400)  # fits the prefill (under 120 prompt tokens), not with 400 more
    context = len(prepare_requests(model, work)[0].input_ids) + 400
    with pytest.raises(ShardOverBudget) as refused:
        run_epd(link, model, work, POOLS, load=False)
    message = str(refused.value)
    assert refused.value.device == "d" and "request 0 needs" in message
    budget = (phase_weights(model).text_bytes + ROOM["d"] * KV_TOKEN) / 2**20
    assert f"(1 row(s) of its batch × {context} tokens)" in message
    assert f"device d has a {budget:.1f} MiB memory budget" in message
    assert link.status_of(["d"])["d"].state == AgentState.READY


def test_a_prefill_sent_to_an_encode_agent_with_a_budget_is_refused_by_name_not_measured(link):
    from agents.techniques.phase_disaggregation.messages import PrefillPrompt
    from core.errors import RunFailed

    with pytest.raises(RunFailed, match="serves encode_tiles, not prefill_prompt"):
        link.request("e", PrefillPrompt(request=1, input_ids=(1, 2, 3)))
    assert link.status_of(["e"])["e"].state == AgentState.READY
