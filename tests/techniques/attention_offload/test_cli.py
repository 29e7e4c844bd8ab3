"""``edgeshard attention-offload run``: a Lamina split on local agents, recorded in the workspace
with every lane's timeline (replayable in Sessions) and, given the agents' profile, the problem and
plan that predict it (its replay's ghosts); greedy text equal to HF generate."""

from __future__ import annotations

import collections
import contextlib
import io
import json

import pytest

from core import formats
from core.cli import main
from core.runs.generation import load_tokenizer
from core.sessions.store import SessionStore
from tests.core.hf_reference import hf_greedy_new_tokens
from tests.gui.problems import make_problem

PROMPTS = ["the cat sat", "hello"]
NEW = 4


@pytest.fixture(scope="module")
def recorded(tiny_llama_dir, tmp_path_factory):
    """One run on three local agents named as the synthetic profile's devices, recorded with ``--profile``."""
    folder = tmp_path_factory.mktemp("offload-cli")
    formats.save(folder / "profile.json", make_problem().profile)
    args = ["attention-offload", "run", "--model", tiny_llama_dir, "--local", "--compute", "server", "--memory",
            "laptop,phone", "--max-new-tokens", str(NEW), "--workspace", str(folder / "ws.sqlite"),
            "--events", str(folder / "events.jsonl"), "--profile", str(folder / "profile.json")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(args + [a for p in PROMPTS for a in ("--prompt", p)])
    return rc, out.getvalue(), folder


def test_the_run_verb_runs_on_local_agents_and_records_every_lane(tiny_llama_dir, recorded):
    rc, out, folder = recorded
    assert rc == 0 and "recorded as run" in out
    tok = load_tokenizer(tiny_llama_dir)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    expected = [tok.decode([t for t in row if t != 2], skip_special_tokens=True)
                for row in hf_greedy_new_tokens(tiny_llama_dir, enc, NEW)]
    assert f"[0] the cat sat{expected[0]}" in out and f"[1] hello{expected[1]}" in out
    with SessionStore(folder / "ws.sqlite") as store:
        (session,) = store.sessions()
        (run,) = store.runs(session.id)
        assert run.status == "completed" and run.settings["technique"] == "attention-offload"
        items = store.timeline(run.id)
        lanes = collections.Counter((i.event.device, i.event.kind) for i in items if i.event is not None)
        assert {d for d, _ in lanes} == {"server", "laptop", "phone"}
        assert lanes[("laptop", "compute")] == lanes[("phone", "compute")] == 4 * 4  # 4 steps × 4 layers
        assert sum(1 for i in items if i.tokens is not None) == 4
    written = collections.Counter(json.loads(line)["type"] for line in (folder / "events.jsonl").read_text().splitlines())
    assert written == {"timeline": sum(1 for i in items if i.event is not None), "tokens": 4}


def test_a_run_with_the_agents_profile_replays_with_the_prediction_of_its_problem_and_split(tiny_llama_dir, recorded):
    from core.techniques.attention_offload.measured import problem_from_profile
    from core.techniques.attention_offload.problem import OffloadPlan, OffloadWorkload
    from core.techniques.attention_offload.run import checkpoint_model
    from core.techniques.attention_offload.simulator import simulate
    from core.techniques.run_origin import replay_prediction

    _, _, folder = recorded
    with SessionStore(folder / "ws.sqlite") as store:  # the workspace reopened, as Sessions loads a run
        (run,) = store.runs()
        plan = store.plan(run.plan_id)
        predicted, note = replay_prediction(run, store.problem_of(run.id), plan, store.origin_of(run.id))
    # independently: the profile's devices for this checkpoint, HF's padded prompt width, one batch of both
    width = int(load_tokenizer(tiny_llama_dir)(PROMPTS, return_tensors="pt", padding=True)["input_ids"].shape[1])
    problem = problem_from_profile(make_problem().profile, checkpoint_model(tiny_llama_dir),
                                   OffloadWorkload(prompt_tokens=width, generated_tokens=NEW),
                                   devices=("server", "laptop", "phone"))
    split = OffloadPlan(compute=("server",), memory=("laptop", "phone"), batch=len(PROMPTS), in_flight=1)
    assert predicted and note == ""
    assert predicted == simulate(problem, split, generated_tokens=NEW).events


def test_a_memory_list_naming_the_compute_device_is_refused_before_anything_starts(tiny_llama_dir, tmp_path,
                                                                                    capsys):
    rc = main(["attention-offload", "run", "--model", tiny_llama_dir, "--local", "--compute", "c0", "--memory",
               "m0,c0", "--prompt", "x", "--workspace", str(tmp_path / "ws.sqlite")])
    assert rc == 2 and "not the compute device" in capsys.readouterr().err
    assert not (tmp_path / "ws.sqlite").exists()


def test_two_compute_devices_run_rotational_staggering_with_the_text_of_hf_generate(tiny_llama_dir, tmp_path, capsys):
    prompts = ["the cat sat", "hello", "a river"]
    args = ["attention-offload", "run", "--model", tiny_llama_dir, "--local", "--compute", "c0,c1", "--memory",
            "m0,m1", "--max-new-tokens", "3", "--micro-batches", "3", "--workspace", str(tmp_path / "ws.sqlite"),
            "--json"]
    for p in prompts:
        args += ["--prompt", p]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    tok = load_tokenizer(tiny_llama_dir)
    enc = tok(prompts, return_tensors="pt", padding=True)
    expected = hf_greedy_new_tokens(tiny_llama_dir, enc, 3)
    assert out["tokens"] == [list(row) for row in expected]  # every token id, not a prefix of the text
    assert out["texts"] == [tok.decode([t for t in row if t != 2], skip_special_tokens=True) for row in expected]
    wire = out["wire"]  # the attention frames the agents' sockets sent, beside the cost model's layer_wire_bytes
    assert {"c0->m0", "m0->c0", "c1->m1", "m1->c1"} <= set(wire["per_link"])
    assert 0.9 < wire["measured_over_predicted"] < 1.1 and wire["control_bytes"] > 0
    assert any(key.endswith(" residual") for key in wire["per_link_and_kind"])  # the hand-overs, counted apart
    with SessionStore(tmp_path / "ws.sqlite") as store:
        (run,) = store.runs()
        assert run.figures["wire"] == wire
        devices = {i.event.device for i in store.timeline(run.id) if i.event is not None}
        assert devices == {"c0", "c1", "m0", "m1"} and run.settings["schedule"] == "rotational"


def test_a_profile_without_a_named_device_is_refused_before_anything_starts(tiny_llama_dir, tmp_path, capsys):
    formats.save(tmp_path / "profile.json", make_problem().profile)
    rc = main(["attention-offload", "run", "--model", tiny_llama_dir, "--local", "--compute", "c0", "--memory",
               "laptop", "--prompt", "x", "--workspace", str(tmp_path / "ws.sqlite"),
               "--profile", str(tmp_path / "profile.json")])
    assert rc == 2 and "has no device c0" in capsys.readouterr().err


def test_a_runs_prompt_width_is_its_longest_prompt_as_hf_pads_them(tiny_llama_dir):
    from core.runs.prediction import run_prompt_tokens

    enc = load_tokenizer(tiny_llama_dir)(PROMPTS, return_tensors="pt", padding=True)
    assert run_prompt_tokens(tiny_llama_dir, PROMPTS) == enc["input_ids"].shape[1] > 1
    assert run_prompt_tokens("", PROMPTS) is None and run_prompt_tokens(tiny_llama_dir, []) is None
