"""An expert-offloading plan runs like any plan: ``edgeshard moe configure --run-plan`` then
``edgeshard run`` on real loopback agents over a generated Mixtral checkpoint; the tokens equal
HF generate's, the expert reads, hits and evictions arrive as ``io`` events on the device's
storage lane, and the run is recorded in the session store with them."""

from __future__ import annotations

import json

import pytest

from agents.techniques.expert_offload.activity import parse_expert_activity
from core import formats
from core.errors import EdgeShardError
from core.models.checkpoints import ModelRecipe, make_model
from core.planning.plan import ShardPlan, plan_from_boundaries
from core.runs.generation import load_tokenizer
from core.sessions.store import SessionStore
from core.techniques import technique_named
from core.techniques.expert_offload.problem import OffloadPlan
from tests.core.cli.test_cli_run import run_cli
from tests.core.hf_reference import hf_greedy_new_tokens

PROMPT = "the cat sat on the"
NEW = 5


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe-run")
    model = make_model(ModelRecipe(family="mixtral", layers=3, hidden=64, heads=4, kv_heads=2, vocab=512, seed=5,
                                   experts=8), folder / "tiny-mixtral")
    formats.save(folder / "offload.json", OffloadPlan(device="edge-0", slots=3, preload=1))
    code, out = run_cli(["moe", "configure", folder / "offload.json", model, "--run-plan", folder / "run.json",
                         "--bandwidth-mbps", "400"])
    assert code == 0, out
    code, out = run_cli(["moe", "scenario", "--out", folder / "problem.json"])  # the plan's problem (its origin)
    assert code == 0, out
    workspace = folder / "ws.sqlite"
    code, out = run_cli(["run", "--model", model, "--plan", folder / "run.json", "--local", "--prompt", PROMPT,
                         "--max-new-tokens", NEW, "--workspace", workspace, "--events", folder / "events.jsonl",
                         "--origin", folder / "problem.json", folder / "offload.json"])
    assert code == 0, out
    return model, folder, workspace, out


def test_configure_writes_a_one_stage_expert_offload_run_plan_and_the_buffer_options(ran):
    model, folder, _, _ = ran
    plan = formats.load(folder / "run.json", ShardPlan)
    assert [(s.device, s.start, s.end, s.kind) for s in plan.stages] == [("edge-0", 0, 5, "expert-offload")]
    options = json.loads((model / "expert-offload.json").read_text())
    assert (options["slots"], options["preload"], options["bandwidth_bps"]) == (3, 1, 400e6)


def test_edgeshard_run_of_the_plan_gives_hf_generates_tokens(ran):
    model, _, workspace, _ = ran
    with SessionStore(workspace) as store:
        [session] = store.sessions()
        [run] = store.runs(session.id)
        items = store.timeline(run.id)
    tok = load_tokenizer(str(model))
    enc = tok([PROMPT], return_tensors="pt", padding=True)
    got = [t.tokens.token_ids[0] for t in sorted((i for i in items if i.tokens is not None),
                                                 key=lambda i: i.tokens.step)]
    assert tuple(got) == tuple(hf_greedy_new_tokens(str(model), enc, NEW)[0])


def test_a_run_given_its_origin_replays_with_the_prediction_of_its_problem_and_plan(ran):
    from core.techniques.expert_offload.problem import OffloadProblem
    from core.techniques.expert_offload.simulator import simulate
    from core.techniques.run_origin import replay_prediction

    model, folder, workspace, _ = ran
    with SessionStore(workspace) as store:  # the workspace reopened, as Sessions loads a run
        [run] = store.runs(store.sessions()[0].id)
        predicted, note = replay_prediction(run, store.problem_of(run.id), store.plan(run.plan_id),
                                            store.origin_of(run.id))
    # independently: the files the run was given, EdgeMoE's simulator, one sequence of HF's prompt length
    width = load_tokenizer(str(model))([PROMPT], return_tensors="pt")["input_ids"].shape[1]
    expected = simulate(formats.load(folder / "problem.json", OffloadProblem), formats.load(folder / "offload.json",
                        OffloadPlan), "sequential", generated_tokens=NEW, prompt_tokens=width)
    assert predicted and note == ""
    assert predicted == expected.events


def test_an_origin_of_another_kind_is_refused_naming_the_file(ran, tmp_path, capsys):
    model, folder, _, _ = ran
    code, _ = run_cli(["run", "--model", model, "--plan", folder / "run.json", "--local", "--prompt", PROMPT,
                         "--workspace", tmp_path / "ws.sqlite", "--origin", folder / "offload.json",
                         folder / "offload.json"])
    assert code == 2 and "offload.json" in capsys.readouterr().err
    assert not (tmp_path / "ws.sqlite").exists()  # refused before the run was recorded (or an agent started)


def test_expert_activity_is_recorded_as_io_events_on_the_storage_lane(ran):
    _, folder, workspace, _ = ran
    with SessionStore(workspace) as store:
        [run] = store.runs(store.sessions()[0].id)
        events = [i.event for i in store.timeline(run.id) if i.event is not None]
    io = [e for e in events if e.kind == "io"]
    assert io and {e.device for e in io} == {"edge-0:storage"}
    outcomes = [parse_expert_activity(e.peer) for e in io]
    assert None not in outcomes
    seen = {o for _, _, o in outcomes}
    assert {"load", "hit", "evict"} <= seen  # 3 slots for 3 blocks x 8 experts: it must evict
    loads = [e for e, (_, _, o) in zip(io, outcomes) if o in ("load", "preload")]
    assert all(e.nbytes > 0 and e.end_s > e.start_s for e in loads)
    assert {b for b, _, _ in outcomes} <= {0, 1, 2} and {x for _, x, _ in outcomes} <= set(range(8))
    written = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]
    assert sum(1 for w in written if w["type"] == "timeline" and w["value"]["kind"] == "io") == len(io)


def test_a_quantised_plan_without_its_expert_files_is_refused(tmp_path, ran):
    from core.techniques.expert_offload.problem import BitOption

    model, _, _, _ = ran
    plan = OffloadPlan(device="edge-0", slots=3, bits=BitOption(name="int4", avg_bits=4.0, accuracy_loss=0.0))
    options = json.loads((model / "expert-offload.json").read_text())
    with pytest.raises(EdgeShardError, match="write the quantised experts first"):
        technique_named("expert-offload").run_plan(plan, model)
    assert json.loads((model / "expert-offload.json").read_text()) == options  # nothing written


def test_a_dense_checkpoint_is_refused_for_an_expert_offload_run(tmp_path):
    model = make_model(ModelRecipe(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=1),
                       tmp_path / "dense")
    with pytest.raises(EdgeShardError, match="needs a Mixtral"):
        technique_named("expert-offload").run_plan(OffloadPlan(device="d", slots=2), model)
    assert not (model / "expert-offload.json").exists()


@pytest.fixture(scope="module")
def ran_sharded(tmp_path_factory):
    """The same model layer-sharded over two loopback agents, each stage offloading its own blocks' experts."""
    folder = tmp_path_factory.mktemp("moe-run-sharded")
    model = make_model(ModelRecipe(family="mixtral", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=5,
                                   experts=8), folder / "tiny-mixtral")
    formats.save(folder / "sharded.json", plan_from_boundaries("tiny-mixtral", 6, ["edge-0", "edge-1"], [3]))
    formats.save(folder / "offload.json", OffloadPlan(device="edge-0", slots=2, preload=1))
    code, out = run_cli(["moe", "configure", folder / "offload.json", model, "--run-plan", folder / "run.json",
                         "--sharded", folder / "sharded.json"])
    assert code == 0, out
    workspace = folder / "ws.sqlite"
    code, out = run_cli(["run", "--model", model, "--plan", folder / "run.json", "--local", "--prompt", PROMPT,
                         "--max-new-tokens", NEW, "--workspace", workspace, "--json"])
    assert code == 0, out
    (folder / "printed.json").write_text(out)
    return model, folder, workspace


def test_a_layer_sharded_plan_runs_with_every_stage_offloading_its_experts_with_exact_tokens(ran_sharded):
    model, folder, workspace = ran_sharded
    plan = formats.load(folder / "run.json", ShardPlan)
    assert [(s.device, s.start, s.end, s.kind) for s in plan.stages] == [
        ("edge-0", 0, 3, "expert-offload"), ("edge-1", 3, 6, "expert-offload")]
    with SessionStore(workspace) as store:
        [run] = store.runs(store.sessions()[0].id)
        items = store.timeline(run.id)
    got = [t.tokens.token_ids[0] for t in sorted((i for i in items if i.tokens is not None),
                                                 key=lambda i: i.tokens.step)]
    enc = load_tokenizer(str(model))([PROMPT], return_tensors="pt", padding=True)
    assert tuple(got) == tuple(hf_greedy_new_tokens(str(model), enc, NEW)[0])
    blocks_of = {}
    for e in (i.event for i in items if i.event is not None and i.event.kind == "io"):
        block, _, outcome = parse_expert_activity(e.peer)
        blocks_of.setdefault(e.device, set()).add(block)
    # each agent read its own blocks' experts from storage: blocks 0-1 on edge-0, 2-3 on edge-1
    assert blocks_of == {"edge-0:storage": {0, 1}, "edge-1:storage": {2, 3}}


def test_run_json_prints_the_token_ids_and_text_of_hf_generate_and_the_recorded_run(ran_sharded):
    model, folder, workspace = ran_sharded
    printed = json.loads((folder / "printed.json").read_text())
    tok = load_tokenizer(str(model))
    expected = hf_greedy_new_tokens(str(model), tok([PROMPT], return_tensors="pt", padding=True), NEW)[0]
    assert printed["tokens"] == [list(expected)]
    assert printed["texts"] == [tok.decode([t for t in expected if t != 2], skip_special_tokens=True)]
    with SessionStore(workspace) as store:
        assert printed["run_id"] == store.runs(store.sessions()[0].id)[0].id
    assert printed["figures"]["tokens"] == NEW and printed["recoveries"] == []


def test_a_sharded_plan_for_another_model_is_refused(tmp_path, ran, capsys):
    model, _, _, _ = ran
    formats.save(tmp_path / "sharded.json", plan_from_boundaries("other", 9, ["a", "b"], [4]))
    formats.save(tmp_path / "offload.json", OffloadPlan(device="a", slots=2))
    code, out = run_cli(["moe", "configure", tmp_path / "offload.json", model, "--run-plan", tmp_path / "r.json",
                         "--sharded", tmp_path / "sharded.json"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot run on" in err and "9 units" in err
    assert not (tmp_path / "r.json").exists()
