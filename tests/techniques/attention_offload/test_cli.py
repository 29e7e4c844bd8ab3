"""``edgeshard attention-offload run``: a Lamina split on local agents, recorded in the workspace
with every lane's timeline (replayable in Sessions), greedy text equal to HF generate."""

from __future__ import annotations

import collections
import json

from core.cli import main
from core.runs.generation import load_tokenizer
from core.sessions.store import SessionStore
from tests.core.hf_reference import hf_greedy_new_tokens


def test_the_run_verb_runs_on_local_agents_and_records_every_lane(tiny_llama_dir, tmp_path, capsys):
    workspace = tmp_path / "ws.sqlite"
    rc = main(["attention-offload", "run", "--model", tiny_llama_dir, "--local", "--compute", "c0", "--memory",
               "m0,m1", "--prompt", "the cat sat", "--prompt", "hello", "--max-new-tokens", "4",
               "--workspace", str(workspace), "--events", str(tmp_path / "events.jsonl")])
    out = capsys.readouterr().out
    assert rc == 0 and "recorded as run" in out
    tok = load_tokenizer(tiny_llama_dir)
    enc = tok(["the cat sat", "hello"], return_tensors="pt", padding=True)
    expected = [tok.decode([t for t in row if t != 2], skip_special_tokens=True)
                for row in hf_greedy_new_tokens(tiny_llama_dir, enc, 4)]
    assert f"[0] the cat sat{expected[0]}" in out and f"[1] hello{expected[1]}" in out
    with SessionStore(workspace) as store:
        (session,) = store.sessions()
        (run,) = store.runs(session.id)
        assert run.status == "completed" and run.settings["technique"] == "attention-offload"
        items = store.timeline(run.id)
        lanes = collections.Counter((i.event.device, i.event.kind) for i in items if i.event is not None)
        assert {d for d, _ in lanes} == {"c0", "m0", "m1"}
        assert lanes[("m0", "compute")] == lanes[("m1", "compute")] == 4 * 4  # 4 steps × 4 layers
        assert sum(1 for i in items if i.tokens is not None) == 4
    written = collections.Counter(json.loads(line)["type"] for line in (tmp_path / "events.jsonl").read_text().splitlines())
    assert written == {"timeline": sum(1 for i in items if i.event is not None), "tokens": 4}


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
