"""``edgeshard epd``: the verbs end to end on real files, and clean one-line errors on bad input."""

from __future__ import annotations

import json

from core.cli import main
from core.formats import load
from core.techniques.phase_disaggregation.types import PoolConfig, Workload


def _files(tmp_path):
    w, c = tmp_path / "w.json", tmp_path / "c.json"
    assert main(["epd", "workload", "--rate", "1", "--requests", "30", "--images", "4..8", "--seed", "2",
                 "--out", str(w)]) == 0
    assert main(["epd", "costs", "--out", str(c)]) == 0
    return w, c


def test_workload_search_simulate_round_trip(tmp_path, capsys):
    w, c = _files(tmp_path)
    assert len(load(w, Workload).requests) == 30
    pools = tmp_path / "p.json"
    assert main(["epd", "search", "--costs", str(c), "--workload", str(w), "--devices", "5", "--trials", "4",
                 "--out", str(pools), "--json"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["strategy"] for r in row["rows"]] == ["search", "aggregated", "pd-only"]
    assert row["rows"][0]["goodput_rps"] >= max(r["goodput_rps"] for r in row["rows"][1:])
    assert len(load(pools, PoolConfig).devices) <= 5
    assert main(["epd", "simulate", "--costs", str(c), "--workload", str(w), "--pools", str(pools), "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["requests"] == 30 and sim["ttft_p50_s"] > 0


def test_a_file_of_the_wrong_format_is_one_line_naming_it(tmp_path, capsys):
    w, c = _files(tmp_path)
    capsys.readouterr()
    assert main(["epd", "simulate", "--costs", str(w), "--workload", str(w), "--pools", str(c)]) == 2
    err = capsys.readouterr().err
    assert "expected format 'edgeshard.epd-costs'" in err and "Traceback" not in err


def test_pools_using_devices_outside_the_budget_are_refused(tmp_path, capsys):
    from core.formats import save

    w, c = _files(tmp_path)
    save(tmp_path / "p.json", PoolConfig(encode=("e",), prefill=("p",), decode=("d",), irp_degree=1))
    assert main(["epd", "simulate", "--costs", str(c), "--workload", str(w), "--pools", str(tmp_path / "p.json")]) == 0
    capsys.readouterr()
    assert main(["epd", "search", "--costs", str(c), "--workload", str(w), "--trials", "1"]) == 2
    assert "--devices N or --device-names" in capsys.readouterr().err


def test_an_inverted_range_is_refused_while_parsing(tmp_path, capsys):
    try:
        main(["epd", "workload", "--images", "5..2", "--out", str(tmp_path / "x.json")])
    except SystemExit as e:
        assert e.code == 2
    assert "LO <= HI" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_a_simulated_run_is_recorded_and_replays(tmp_path, capsys):
    from core.sessions.replay import Replay
    from core.sessions.store import SessionStore

    w, c = _files(tmp_path)
    pools = tmp_path / "p.json"
    from core.formats import save

    save(pools, PoolConfig(encode=("e0", "e1"), prefill=("p",), decode=("d",), irp_degree=2))
    ws = tmp_path / "ws.sqlite"
    assert main(["epd", "simulate", "--costs", str(c), "--workload", str(w), "--pools", str(pools),
                 "--workspace", str(ws), "--json"]) == 0
    run_id = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["run_id"]
    with SessionStore(ws) as store:
        info = next(r for r in store.runs() if r.id == run_id)
        assert info.kind == "predicted"
        replay = Replay.from_store(store, run_id)
        assert replay.duration_s > 0
        assert {e.device for e in store.events(run_id)} >= {"e0", "e1", "p", "d"}


def test_search_layout_searches_only_the_chosen_layout(tmp_path, capsys):
    w, c = _files(tmp_path)
    for layout in ("epd", "pd"):
        pools = tmp_path / f"{layout}.json"
        assert main(["epd", "search", "--costs", str(c), "--workload", str(w), "--devices", "4", "--trials", "3",
                     "--layout", layout, "--out", str(pools), "--json"]) == 0
        capsys.readouterr()
        assert load(pools, PoolConfig).disaggregation == layout


def test_search_layout_refuses_a_layout_the_devices_cannot_hold_in_one_line(tmp_path, capsys):
    w, c = _files(tmp_path)
    rc = main(["epd", "search", "--costs", str(c), "--workload", str(w), "--devices", "2", "--layout", "epd"])
    err = capsys.readouterr().err
    assert rc == 2 and "too few" in err and len(err.strip().splitlines()) == 1
