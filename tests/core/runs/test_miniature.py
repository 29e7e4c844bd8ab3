"""The paper's setup in miniature (core.runs.miniature): the testbed's shape, the error
without root, and a reduced measured run on a real netns testbed."""

from __future__ import annotations

import os

import pytest

from core.devices import testbed as tb
from core.runs.miniature import MiniatureSetup, link_caps, measure_miniature

from ..conftest import needs_root


def test_only_the_source_cloud_pair_is_slow_and_the_others_spread_around_50_mbit_from_a_fixed_seed():
    setup = MiniatureSetup(name="mt", edges=3, slow_link_mbit=0.5)
    caps = {(c.src, c.dst): c.bandwidth_mbit_s for c in link_caps(setup).links}
    assert len(caps) == 4 * 3
    assert caps[("mt1", "mt4")] == caps[("mt4", "mt1")] == 0.5
    others = [v for k, v in caps.items() if set(k) != {"mt1", "mt4"}]
    assert all(40 <= v <= 60 for v in others) and len(set(others)) > 1
    assert link_caps(setup) == link_caps(setup)


def test_without_root_the_miniature_says_it_needs_root_before_building_anything(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(tb.TestbedError, match="needs root"):
        measure_miniature(MiniatureSetup(name="mtnoroot"))


def test_the_cli_without_root_prints_the_error_not_a_traceback(monkeypatch, capsys, tmp_path):
    from core.cli import main

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    rc = main(["experiment", "miniature", "--out", str(tmp_path), "--quiet"])
    err = capsys.readouterr().err
    assert rc != 0 and "needs root" in err and "Traceback" not in err


@pytest.mark.netns
@needs_root
def test_on_a_netns_testbed_every_method_is_measured_beside_its_prediction_and_edgeshard_is_predicted_no_slower():
    from core.runs.experiments import miniature_result

    # Reduced: 2 edges + cloud, 4 layers, few tokens. The measured figures are not compared:
    # one round of 8 tokens on a shared 2-core box is noise-bound (CI once measured the very
    # same plan at 57 and 76 ms); bench/ and `edgeshard experiment miniature` report them.
    setup = MiniatureSetup(name=f"t{os.getpid() % 0xFFFFF:x}y", edges=2, layers=4, hidden=512, new_tokens=8,
                           rounds=1, edge_slowdown=6.0, throughput_batch=2, time_limit_s=10, profile_repeats=2,
                           link_first_probe_kib=32)  # the assertions hold for any profile: a shorter one
    m = measure_miniature(setup)
    for r in m.rows:
        assert r.status == "ok", r
        for measured, predicted in ((r.measured_ms, r.predicted_ms), (r.measured_tps, r.predicted_tps)):
            assert measured is not None and measured > 0 and predicted is not None and predicted > 0, r
        assert r.tokens_equal_edge_solo, r
    solo, es = m.row("edge-solo"), m.row("edgeshard")
    print(f"miniature: Edge-Solo {solo.measured_ms:.1f} ms (predicted {solo.predicted_ms:.1f}), "
          f"EdgeShard {es.measured_ms:.1f} ms (predicted {es.predicted_ms:.1f})")
    assert es.predicted_ms <= solo.predicted_ms
    table = miniature_result(m)
    assert [row[0] for row in table.rows] == ["Edge-Solo", "Cloud-Edge-Even", "Cloud-Edge-Opt", "EdgeShard"]
    assert tb.leftovers(setup.name) == []
