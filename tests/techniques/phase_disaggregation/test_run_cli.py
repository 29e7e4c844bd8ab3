"""`edgeshard epd make-model | profile | run` on real local agents: the run's tokens equal the
single-process model, it is recorded beside its simulation, and bad inputs exit with a clear error."""

from __future__ import annotations

import json

import pytest

from core.cli import main
from core.devices.local_cluster import LocalCluster
from core.formats import save
from core.techniques.phase_disaggregation.types import PhaseCosts, PoolConfig, Request, Workload


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("epd-cli")
    assert main(["epd", "make-model", "--out", str(tmp / "llava")]) == 0
    save(tmp / "pools.json", PoolConfig(encode=("local-0",), prefill=("local-1",), decode=("local-2",),
                                        decode_batch=1))
    save(tmp / "workload.json", Workload(requests=tuple(
        Request(id=i, arrival_s=(0.0, 0.05, 1.0)[i], images=1, tiles_per_image=2, prompt_tokens=5, output_tokens=4)
        for i in range(3))))  # the last arrives at 1 s: the run is still on when the first events are written
    with LocalCluster(tmp / "cluster", 3) as lc:
        yield tmp, lc


@pytest.fixture(scope="module")
def ran(setup):
    """``epd profile`` then ``epd run --check --json --events`` once, the run on a thread while the events
    file is read: (its JSON object, the folder, whether the file had a line while the run was still on)."""
    import contextlib
    import io
    import threading
    import time

    from core.formats import load

    tmp, lc = setup
    common = ["--agents", str(lc.agents_file), "--model", str(tmp / "llava"), "--pools", str(tmp / "pools.json")]
    lines = io.StringIO()
    with contextlib.redirect_stderr(lines):  # every agent of the file measured: no --pools, no --devices
        assert main(["epd", "profile", "--agents", str(lc.agents_file), "--model", str(tmp / "llava"),
                     "--out", str(tmp / "costs.json"), "--repeats", "2"]) == 0
    (tmp / "profile-stderr.txt").write_text(lines.getvalue())
    assert load(tmp / "costs.json", PhaseCosts).mm_tokens_per_tile == 16
    printed, codes, events = io.StringIO(), [], tmp / "events.jsonl"
    with contextlib.redirect_stdout(printed):
        run = threading.Thread(target=lambda: codes.append(main([
            "epd", "run", *common, "--workload", str(tmp / "workload.json"), "--costs", str(tmp / "costs.json"),
            "--check", "--workspace", str(tmp / "ws.sqlite"), "--json", "--events", str(events)])))
        run.start()
        seen_while_running = False
        while run.is_alive() and not seen_while_running:
            seen_while_running = events.exists() and events.read_text().count("\n") > 0 and run.is_alive()
            time.sleep(0.01)
        run.join()
    assert codes == [0]
    return json.loads(printed.getvalue().strip().splitlines()[-1]), tmp, seen_while_running


def test_profile_then_run_checks_tokens_and_records_the_run_beside_its_simulation(ran):
    from core.sessions.store import SessionStore

    out, tmp, _ = ran
    assert out["tokens_equal"] is True and out["requests"] == 3
    assert out["ttft_p50_s"] > 0 and out["simulated_ttft_p50_s"] > 0
    with SessionStore(tmp / "ws.sqlite") as store:
        runs = store.runs()
        assert [r.kind for r in runs] == ["measured", "predicted"]
        assert all(r.settings["technique"] == "phase-disaggregation" for r in runs)
        # one recording path: the simulation carries what the real run does, but the real tokens
        assert set(runs[0].settings) - set(runs[1].settings) == {"tokens"}
        assert len(store.tokens(runs[0].id)) == 12


def test_profile_times_every_phase_on_every_agent_as_the_studio_does_saying_each_step(ran):
    from core.formats import load

    _, tmp, _ = ran
    costs = load(tmp / "costs.json", PhaseCosts)
    assert [d.device for d in costs.devices] == ["local-0", "local-1", "local-2"]
    assert "every phase timed on every agent" in costs.source
    lines = (tmp / "profile-stderr.txt").read_text().splitlines()
    for i, first in enumerate(("local-0", "local-1", "local-2")):  # one rotation per agent, each phase on each
        assert any(line.startswith("loading the phases on " + first) and line.endswith(f"({i + 1}/3)")
                   for line in lines), lines
    assert {f"timing {phase} on {d}" for phase in ("encode", "prefill", "decode")
            for d in ("local-0", "local-1", "local-2")} <= set(lines)


def test_search_plans_for_the_devices_the_costs_were_measured_on(ran, capsys):
    _, tmp, _ = ran
    assert main(["epd", "search", "--costs", str(tmp / "costs.json"), "--workload", str(tmp / "workload.json"),
                 "--trials", "3", "--json"]) == 0
    best = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["best"]
    assert set(best["encode"] + best["prefill"] + best["decode"]) <= {"local-0", "local-1", "local-2"}


def test_run_with_costs_sets_each_devices_phases_simulated_with_its_own_costs_beside_measured(ran):
    from core.formats import load

    out, tmp, _ = ran
    costs = load(tmp / "costs.json", PhaseCosts)
    phases = {(f["device"], f["phase"]): f for f in out["phases"]}
    assert set(phases) == {("local-0", "encode"), ("local-1", "prefill"), ("local-2", "decode")}
    # the prefill's prediction is local-1's own cost for a request's tokens (5 prompt + 2 tiles x 16)
    assert phases[("local-1", "prefill")]["predicted_s"] == pytest.approx(costs.prefill_s(5 + 32, "local-1"))
    assert all(f["measured_s"] > 0 and f["ratio"] == pytest.approx(f["predicted_s"] / f["measured_s"])
               for f in phases.values())


def test_run_json_prints_every_requests_tokens_as_llavas_own_generate_gives_them(ran):
    from core.formats import load
    from core.techniques.phase_disaggregation.runtime import prepare_requests, reference_tokens

    out, tmp, _ = ran
    workload = load(tmp / "workload.json", Workload)
    expected = reference_tokens(tmp / "llava", prepare_requests(tmp / "llava", workload))  # Llava's generate()
    assert {o["request"]: tuple(o["tokens"]) for o in out["outputs"]} == expected
    assert all(len(o["tokens"]) == 4 and isinstance(o["text"], str) for o in out["outputs"])


def test_run_events_writes_the_runs_timeline_and_every_token(ran):
    _, tmp, _ = ran
    lines = [json.loads(line) for line in (tmp / "events.jsonl").read_text().splitlines()]
    assert {line["type"] for line in lines} == {"timeline", "tokens"}
    assert sum(len(line["value"]["token_ids"]) for line in lines if line["type"] == "tokens") == 12


def test_run_events_are_written_as_they_happen_not_when_the_run_ends(ran):
    assert ran[2]


def test_run_json_counts_the_agents_wire_bytes_beside_the_simulated_transfers(ran):
    """EPD's data plane: the encode agent's multimodal tokens to the prefill agent, its KV cache to the
    decode agent, counted by the agents' sockets; the simulator's transfers (the cost model) beside them."""
    out, _, _ = ran
    wire = out["wire"]
    assert wire["per_link"]["local-0->local-1"]["measured"] > 0 and wire["per_link"]["local-1->local-2"]["measured"] > 0
    assert wire["predicted_bytes"] > 0 and 0.5 < wire["measured_over_predicted"] < 2.0
    assert wire["measured_bytes"] == sum(link["measured"] for link in wire["per_link"].values())


def test_each_link_carries_what_the_cost_model_counts_with_the_frames_headers_and_the_handoff(ran):
    """The KV link (prefill -> decode) measured 2.08x its prediction while the multimodal link agreed
    (1.016x): a greedy run's handoff carried 20 KB of unused sampler state a request. The prediction now
    counts each frame's header and the handoff beside each KV cache, so each link is within 1 %."""
    out, _, _ = ran
    for link in ("local-0->local-1", "local-1->local-2"):
        figures = out["wire"]["per_link"][link]
        assert 0.99 <= figures["measured"] / figures["predicted"] <= 1.01, (link, figures)


def test_a_sampled_runs_handoff_carries_the_sampler_state_and_the_cost_model_counts_it(setup, ran):
    """A sampled prefill hands the decode agent its generator's state (5,056 B packed into float32s beside
    the first token): the KV link carries that much more a request than a greedy run's, and so does the
    prediction (``handoff_bytes``)."""
    import contextlib
    import io

    greedy, tmp, _ = ran
    _, lc = setup
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["epd", "run", "--agents", str(lc.agents_file), "--model", str(tmp / "llava"), "--pools",
                     str(tmp / "pools.json"), "--workload", str(tmp / "workload.json"), "--costs",
                     str(tmp / "costs.json"), "--temperature", "0.8", "--seed", "5", "--workspace",
                     str(tmp / "ws-sampled.sqlite"), "--json"]) == 0
    sampled = json.loads(printed.getvalue().strip().splitlines()[-1])["wire"]["per_link"]["local-1->local-2"]
    before = greedy["wire"]["per_link"]["local-1->local-2"]
    more = sampled["measured"] - before["measured"]
    assert more == sampled["predicted"] - before["predicted"] and 3 * 5056 <= more < 3 * (5056 + 16)
    assert 0.99 <= sampled["measured"] / sampled["predicted"] <= 1.01


def test_the_profiled_kv_bytes_per_token_are_the_configs_layers_k_and_v_kv_heads_and_head_dim(ran):
    """By hand from TINY_LLAVA: 2 layers x (K, V) x 2 KV heads (GQA: not the 4 attention heads) x head dim
    64 / 4 x 4 B float32 = 512 B a prompt token; a request's prompt is its text and its image's tokens."""
    from core.formats import load
    from core.models.multimodal import TINY_LLAVA as r

    out, tmp, _ = ran
    assert (r.layers, r.kv_heads, r.hidden // r.heads) == (2, 2, 16)
    costs = load(tmp / "costs.json", PhaseCosts)
    assert costs.kv_token_bytes == 2 * 2 * 2 * 16 * 4 == 512
    assert costs.mm_token_bytes == r.hidden * 4
    tokens = 3 * (5 + 2 * 16)  # three requests: 5 prompt tokens (<bos> included) and 2 tiles of 16 tokens
    # the cost model's KV bytes, and beside each of the 3 caches the greedy handoff (8 B) and two headers
    assert tokens * 512 + 3 * 8 < out["wire"]["per_link"]["local-1->local-2"]["predicted"] < tokens * 512 + 3 * 400


def test_a_missing_image_file_is_a_clear_error_and_nothing_is_sent(setup, capsys):
    tmp, lc = setup
    rc = main(["epd", "run", "--agents", str(lc.agents_file), "--model", str(tmp / "llava"), "--pools",
               str(tmp / "pools.json"), "--workload", str(tmp / "workload.json"), "--images",
               str(tmp / "nope.png"), "--workspace", str(tmp / "ws2.sqlite")])
    err = capsys.readouterr().err
    assert rc != 0 and "nope.png" in err and "no such image file" in err and "Traceback" not in err


def test_a_model_directory_that_is_not_a_llava_is_refused_by_name(setup, capsys):
    tmp, lc = setup
    rc = main(["epd", "run", "--agents", str(lc.agents_file), "--model", str(tmp), "--pools",
               str(tmp / "pools.json"), "--workload", str(tmp / "workload.json"), "--workspace",
               str(tmp / "ws3.sqlite")])
    err = capsys.readouterr().err
    assert rc != 0 and "config.json" in err and "Traceback" not in err
