"""EPD's memory model: weights per phase as the agents' executors hold them, tokens per pool, and a
search that keeps to the devices' memory."""

from __future__ import annotations

import weakref

import msgspec
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from core.techniques.phase_disaggregation.memory import device_memory, phase_weights
from core.techniques.phase_disaggregation.search import config_for, evaluate, search
from core.techniques.phase_disaggregation.types import EpdInputError, PhaseWeights
from tests.techniques.phase_disaggregation.conftest import image_heavy_problem, make_costs, one_request, single

WEIGHTS = PhaseWeights(encode_bytes=3 << 20, text_bytes=20 << 20)


def test_phase_weights_from_the_header_are_what_the_phase_executors_hold(model):
    from agents.techniques.phase_disaggregation.phases import EncodeExecutor, PrefillExecutor

    weights = phase_weights(model)
    assert weights.encode_bytes == EncodeExecutor(str(model)).memory_bytes()
    assert weights.text_bytes == PrefillExecutor(str(model)).memory_bytes()


class LivePeak(TorchDispatchMode):
    """The most bytes of tensors made inside the block alive at once (each storage counted until it is
    freed): the reference the per-tile and per-token terms are checked against."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            storage = t.untyped_storage() if isinstance(t, torch.Tensor) else None
            if storage is not None and storage.nbytes() and storage.data_ptr() not in self.sizes.keys() | given:  # not a view
                self.sizes[storage.data_ptr()] = storage.nbytes()
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._freed, storage.data_ptr())
        return out

    def _freed(self, key: int) -> None:
        self.live -= self.sizes.pop(key, 0)


@pytest.fixture(scope="module")
def clip_sized(tmp_path_factory):
    """A Llava whose tower has a real CLIP's proportions (65 positions, MLP 2 × hidden) and a text model
    whose MLP is wider than its hidden size."""
    from core.models.multimodal import MultimodalRecipe, make_multimodal_model

    recipe = MultimodalRecipe(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=352, vision_layers=3,
                              vision_hidden=96, vision_heads=4, tile=64, patch=8)
    return make_multimodal_model(recipe, tmp_path_factory.mktemp("llava-sized") / "m")


def test_the_encode_term_is_the_peak_of_what_an_encode_holds_live(clip_sized):
    from agents.techniques.phase_disaggregation.phases import EncodeExecutor

    encode = EncodeExecutor(str(clip_sized))
    arrived = 2 * 3 * encode.tile ** 2 * 4  # the tile's bytes and tensor: made before the encode, not in it
    per_tile = phase_weights(clip_sized).encode_bytes_per_tile - arrived
    for tiles in (1, 4):
        pixels = torch.randn(tiles, 3, encode.tile, encode.tile)
        with torch.inference_mode(), LivePeak() as live:
            encode.encode(pixels)
        assert live.peak == pytest.approx(tiles * per_tile, rel=0.1)


def test_the_prefill_term_is_the_peak_of_what_a_prefill_holds_live_beside_its_kv_cache(clip_sized):
    from agents.sampling import SamplingParams
    from agents.techniques.phase_disaggregation.phases import PrefillExecutor

    prefill = PrefillExecutor(str(clip_sized))
    kv_per_token = prefill.layers * 2 * prefill.kv_heads * prefill.head_dim * 4
    per_token = phase_weights(clip_sized).prefill_bytes_per_token
    for tokens in (64, 256):
        with LivePeak() as live:
            prefill.prefill_prompt([5] * tokens, torch.empty(0, 128), SamplingParams(), torch.Generator())
        assert live.peak == pytest.approx(tokens * (per_token + kv_per_token), rel=0.15)


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
    # the encode device: its tokens twice (the tensor and the bytes sent)
    assert one[problem.devices[0]] == WEIGHTS.encode_bytes + 2 * 2 * 4 * costs.mm_tokens_per_tile * costs.mm_token_bytes


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
