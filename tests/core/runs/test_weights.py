"""Sending stage weights to real agents over the encrypted channel: each agent gets only
its stage's slice, runs from it exactly like the full checkpoint, keeps it by content hash
(a plan change re-sends only the stages that moved) and resumes an interrupted file."""

from __future__ import annotations

import pytest
import transformers  # noqa: F401  (imported once here: agents' worker threads import it concurrently)

from agents.agent import Agent
from agents.protocol import AgentState, PutWeights
from agents.transport import CurveKeys
from core.errors import RunFailed
from core.models.checkpoints import ModelRecipe, make_model
from core.planning.plan import plan_from_boundaries
from core.runs.coordinator import AgentEndpoint, Coordinator, RunRequest
from core.runs.generation import GenerationSettings, generate, load_tokenizer
from core.runs.weights import ship_stage_weights, stage_files
from tests.core.hf_reference import hf_greedy_new_tokens

DEVICES = ["src", "mid", "head"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    recipe = ModelRecipe(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3)
    return str(make_model(recipe, tmp_path_factory.mktemp("weights") / "tiny-llama"))


@pytest.fixture()
def cluster(tmp_path):
    keys = CurveKeys.generate()
    agents = [Agent(d, keys.public, weights_dir=tmp_path / "on-device" / d).start() for d in DEVICES]
    coordinator = Coordinator([AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents], keys)
    coordinator.open()
    yield coordinator, agents, tmp_path / "slices"
    coordinator.close()
    for a in agents:
        a.close()


def _size(files) -> int:
    return sum(f.size for f in files)


def test_agents_run_from_the_sent_slices_exactly_like_the_full_checkpoint(cluster, model_dir):
    coordinator, agents, cache = cluster
    plan = plan_from_boundaries("tiny-llama", 6, DEVICES, [2, 4])
    report = ship_stage_weights(coordinator, plan, model_dir, cache_dir=cache)
    # the agents are told a directory that does not exist: they can only load what was sent
    coordinator.load(plan, "/nowhere/tiny-llama", files=report.files)
    tok = load_tokenizer(model_dir)
    enc = tok(["the cat sat", "hello there"], return_tensors="pt", padding=True)
    req = RunRequest(input_ids=tuple(map(tuple, enc["input_ids"].tolist())),
                     attention_mask=tuple(map(tuple, enc["attention_mask"].tolist())), max_new_tokens=5,
                     mode="sequential", micro_batches=1, eos_token_ids=(2,), pad_token_id=0)
    assert list(coordinator.run(plan, req).tokens) == hf_greedy_new_tokens(model_dir, enc, 5)


def test_each_agent_receives_only_its_stages_slice_and_nothing_twice(cluster, model_dir):
    coordinator, _, cache = cluster
    plan = plan_from_boundaries("tiny-llama", 6, DEVICES, [2, 4])
    first = ship_stage_weights(coordinator, plan, model_dir, cache_dir=cache)
    for s in plan.stages:
        assert first.sent[s.device] == _size(stage_files(model_dir, s.start, s.end, cache))
    full = _size(stage_files(model_dir, 0, 6, cache))
    assert all(n < full for n in first.sent.values())
    again = ship_stage_weights(coordinator, plan, model_dir, cache_dir=cache)
    assert again.sent == dict.fromkeys(DEVICES, 0) and again.already_held == first.sent


def test_a_plan_change_re_sends_only_the_stages_whose_units_moved(cluster, model_dir):
    coordinator, _, cache = cluster
    ship_stage_weights(coordinator, plan_from_boundaries("tiny-llama", 6, DEVICES, [2, 4]), model_dir,
                       cache_dir=cache)
    moved = plan_from_boundaries("tiny-llama", 6, DEVICES, [2, 5])  # src keeps [0, 2)
    report = ship_stage_weights(coordinator, moved, model_dir, cache_dir=cache)
    assert report.sent["src"] == 0
    # config files are shared by every slice and already there: only the moved weights travel
    for dev, (start, end) in {"mid": (2, 5), "head": (5, 6)}.items():
        weights = next(f for f in stage_files(model_dir, start, end, cache) if f.name == "model.safetensors")
        assert report.sent[dev] == weights.size


def test_an_interrupted_file_is_resumed_from_the_bytes_the_agent_holds(cluster, model_dir):
    coordinator, _, cache = cluster
    plan = plan_from_boundaries("tiny-llama", 6, DEVICES, [2, 4])
    weights = next(f for f in stage_files(model_dir, 2, 4, cache) if f.name == "model.safetensors")
    head = weights.path.read_bytes()[:10_000]
    coordinator.request("mid", PutWeights(digest=weights.digest, offset=0, size=weights.size, data=head))
    report = ship_stage_weights(coordinator, plan, model_dir, cache_dir=cache)
    small = sum(f.size for f in stage_files(model_dir, 2, 4, cache) if f.name != "model.safetensors")
    assert report.sent["mid"] == weights.size - 10_000 + small
    coordinator.load(plan, "/nowhere/tiny-llama", files=report.files)


def test_a_corrupted_chunk_is_refused_with_the_device_named_and_the_agent_stays_up(cluster, model_dir):
    coordinator, agents, cache = cluster
    weights = next(f for f in stage_files(model_dir, 0, 2, cache) if f.name == "model.safetensors")
    data = bytearray(weights.path.read_bytes())
    data[-1] ^= 0xFF
    with pytest.raises(RunFailed, match=r"src: .*checksum mismatch"):
        coordinator.request("src", PutWeights(digest=weights.digest, offset=0, size=weights.size, data=bytes(data)))
    assert coordinator.status()["src"].state is AgentState.IDLE
    report = ship_stage_weights(coordinator, plan_from_boundaries("tiny-llama", 6, DEVICES, [2, 4]), model_dir,
                                cache_dir=cache)
    assert report.sent["src"] == _size(stage_files(model_dir, 0, 2, cache))


def test_generate_with_send_weights_streams_text_from_agents_without_the_checkpoint(cluster, model_dir, monkeypatch,
                                                                                     tmp_path):
    coordinator, _, _ = cluster
    monkeypatch.setenv("EDGESHARD_HOME", str(tmp_path / "home"))
    plan = plan_from_boundaries("tiny-llama", 6, DEVICES, [1, 3])
    out = generate(coordinator, plan, model_dir, ["the river"], GenerationSettings(max_new_tokens=4, send_weights=True))
    assert out.result.tokens and len(out.result.tokens[0]) >= 1
    assert any((tmp_path / "home" / "stage-weights").iterdir())
    for a in coordinator.status().values():
        assert a.state is AgentState.READY
