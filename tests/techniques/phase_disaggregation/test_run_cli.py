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
        Request(id=i, arrival_s=0.05 * i, images=1, tiles_per_image=2, prompt_tokens=5, output_tokens=4)
        for i in range(3))))
    with LocalCluster(tmp / "cluster", 3) as lc:
        yield tmp, lc


def test_profile_then_run_checks_tokens_and_records_the_run_beside_its_simulation(setup, capsys):
    from core.formats import load
    from core.sessions.store import SessionStore

    tmp, lc = setup
    common = ["--agents", str(lc.agents_file), "--model", str(tmp / "llava"), "--pools", str(tmp / "pools.json")]
    assert main(["epd", "profile", *common, "--out", str(tmp / "costs.json"), "--repeats", "2"]) == 0
    assert load(tmp / "costs.json", PhaseCosts).mm_tokens_per_tile == 16
    capsys.readouterr()
    rc = main(["epd", "run", *common, "--workload", str(tmp / "workload.json"), "--costs", str(tmp / "costs.json"),
               "--check", "--workspace", str(tmp / "ws.sqlite"), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["tokens_equal"] is True and out["requests"] == 3
    assert out["ttft_p50_s"] > 0 and out["simulated_ttft_p50_s"] > 0
    with SessionStore(tmp / "ws.sqlite") as store:
        runs = store.runs()
        assert [r.kind for r in runs] == ["measured", "predicted"]
        assert all(r.settings["technique"] == "phase-disaggregation" for r in runs)
        # one recording path: the simulation carries what the real run does, but the real tokens
        assert set(runs[0].settings) - set(runs[1].settings) == {"tokens"}
        assert len(store.tokens(runs[0].id)) == 12


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
