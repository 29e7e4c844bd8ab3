"""EPD's memory model: weights per phase as the agents' executors hold them, tokens per pool, and a
search that keeps to the devices' memory."""

from __future__ import annotations

import msgspec
import pytest

from core.techniques.phase_disaggregation.memory import device_memory, phase_weights
from core.techniques.phase_disaggregation.search import config_for, evaluate, search
from core.techniques.phase_disaggregation.types import EpdInputError, PhaseWeights
from tests.techniques.phase_disaggregation.conftest import image_heavy_problem, make_costs, one_request, single

WEIGHTS = PhaseWeights(encode_bytes=3 << 20, text_bytes=20 << 20)


def test_phase_weights_from_the_header_are_what_the_phase_executors_hold(model):
    from agents.techniques.phase_disaggregation.phases import EncodeExecutor, PrefillExecutor

    import torch

    weights = phase_weights(model)
    encode = EncodeExecutor(str(model))
    assert weights.encode_bytes == encode.memory_bytes()
    assert weights.text_bytes == PrefillExecutor(str(model)).memory_bytes()
    with torch.inference_mode():  # what one tile's encode keeps: every layer's hidden states
        out = encode.tower(torch.zeros(1, 3, encode.tile, encode.tile), output_hidden_states=True, return_dict=True)
    assert weights.encode_bytes_per_tile == sum(h.nbytes for h in out.hidden_states)


def test_a_decode_device_holds_the_text_model_and_one_kv_slot_per_sequence_of_its_batch():
    costs = make_costs()
    request = one_request(images=2, tiles=4, prompt=32, output=8)
    problem = msgspec.structs.replace(image_heavy_problem(devices=3), workload=single(request))
    context = 2 * 4 * costs.mm_tokens_per_tile + 32 + 8
    one, four = (device_memory(WEIGHTS, costs, problem.workload, config_for(problem, "epd", (1, 1, 1), decode_batch=b))
                 for b in (1, 4))
    decode = problem.devices[2]
    assert one[decode] == WEIGHTS.text_bytes + context * costs.kv_token_bytes
    assert four[decode] - one[decode] == 3 * context * costs.kv_token_bytes
    assert one[problem.devices[0]] == WEIGHTS.encode_bytes + 2 * 4 * costs.mm_tokens_per_tile * costs.mm_token_bytes


def test_an_aggregated_device_holds_the_text_model_once_beside_the_vision_tower():
    problem = image_heavy_problem(devices=3, requests=5)
    need = device_memory(WEIGHTS, problem.costs, problem.workload, config_for(problem, "aggregated", (3,)))
    epd = device_memory(WEIGHTS, problem.costs, problem.workload, config_for(problem, "epd", (1, 1, 1)))
    encode, prefill, decode = (epd[d] for d in problem.devices)
    assert need[problem.devices[0]] == encode + prefill + decode - WEIGHTS.text_bytes  # one text model, not two


def test_the_search_keeps_to_the_devices_memory_and_says_when_nothing_fits():
    base = image_heavy_problem(devices=4, requests=12)
    roomy = msgspec.structs.replace(base, weights=WEIGHTS)
    small = config_for(roomy, "epd", (1, 1, 2), decode_batch=1)
    budget = max(evaluate(roomy, small).memory_bytes, 1)
    problem = msgspec.structs.replace(roomy, memory_budget_bytes=budget)
    big = evaluate(problem, config_for(problem, "aggregated", (4,), decode_batch=64))
    assert not big.fits and big.goodput_rps == 0
    result = search(problem, trials=6, seed=0, seeds=[small])
    assert result.best.fits and result.best.memory_bytes <= budget
    with pytest.raises(EpdInputError, match="memory budget"):
        search(msgspec.structs.replace(problem, memory_budget_bytes=WEIGHTS.text_bytes), trials=3, seed=0)


def test_epd_search_plans_each_devices_memory_from_the_model_and_refuses_what_fits_nowhere(model, tmp_path, capsys):
    import json

    from core.cli import main

    w, c = tmp_path / "w.json", tmp_path / "c.json"
    assert main(["epd", "workload", "--rate", "1", "--requests", "8", "--seed", "2", "--out", str(w)]) == 0
    assert main(["epd", "costs", "--out", str(c)]) == 0
    args = ["epd", "search", "--costs", str(c), "--workload", str(w), "--devices", "4", "--trials", "4",
            "--model", str(model), "--json"]
    capsys.readouterr()
    assert main(args + ["--memory-mib", "1e6"]) == 0
    roomy = json.loads(capsys.readouterr().out)["rows"][0]
    assert roomy["fits"] and roomy["memory_bytes"] > phase_weights(model).text_bytes
    assert main(args + ["--memory-mib", "0.01"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the search's progress lines: one error line
    assert "none of the" in last and "0.01 MiB memory budget" in last
