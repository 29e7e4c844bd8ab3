"""The paper's experiments in simulation: tables, findings, CSV and figures."""

import csv

import pytest

from core.runs.experiments import UnknownExperiment, run_experiment, write_outputs


@pytest.fixture(scope="module")
def source_result():
    return run_experiment("source")


def test_fig9_an_nx_source_leaves_edgeshard_almost_unchanged_but_not_cloud_edge_opt(source_result):
    by_claim = {f.claim.split(":")[0]: f for f in source_result.findings}
    gap = next(f for f in source_result.findings if f.claim.startswith("EdgeShard's AGX→NX latency gap"))
    assert gap.held
    assert "NX source" in by_claim


def test_outputs_are_a_csv_of_the_table_and_a_png_and_svg_per_figure(source_result, tmp_path):
    paths = write_outputs(source_result, tmp_path)
    names = {p.name for p in paths}
    assert {"source.csv", "source-findings.csv", "fig9-source.png", "fig9-source.svg"} <= names
    with open(tmp_path / "source.csv", encoding="utf-8") as fh:
        rows = list(csv.reader(fh))
    assert tuple(rows[0]) == source_result.columns and len(rows) == len(source_result.rows) + 1
    assert (tmp_path / "fig9-source.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in (tmp_path / "fig9-source.svg").read_text(encoding="utf-8")


def test_fig10_no_bubbles_is_never_slower_than_bubbles():
    result = run_experiment("pipelines")
    assert result.findings[0].held
    for row in result.rows:
        if row[3] not in ("OOM", "—"):
            assert float(row[4]) >= float(row[3])


def test_an_unknown_experiment_names_the_known_ones():
    with pytest.raises(UnknownExperiment, match="table-iv"):
        run_experiment("fig-99")
