"""The configuration search over the simulator, against the baselines."""

from __future__ import annotations

import pytest

from core.reporting import Cancelled, RecordingReporter
from core.techniques.phase_disaggregation.baselines import aggregated, pd_only, run_strategy
from core.techniques.phase_disaggregation.search import SearchProgress, config_for, params_of, search
from core.techniques.phase_disaggregation.types import EpdInputError
from tests.techniques.phase_disaggregation.conftest import image_heavy_problem


def test_search_beats_both_baselines_where_only_irp_meets_the_ttft_slo():
    problem = image_heavy_problem()
    agg, pd = aggregated(problem), pd_only(problem)
    result = search(problem, trials=10, seed=1, seeds=[agg.config, pd.config])
    assert result.best.goodput_rps >= max(agg.goodput_rps, pd.goodput_rps)
    assert result.best.goodput_rps > pd.goodput_rps
    assert result.best.config.disaggregation == "epd" and result.best.config.irp_degree > 1


def test_search_reports_progress_and_its_best_so_far():
    reporter = RecordingReporter()
    result = search(image_heavy_problem(requests=20), trials=3, reporter=reporter)
    assert reporter.progresses[-1] == (3, 3)
    last = reporter.partials[-1]
    assert isinstance(last, SearchProgress) and last.best == result.best
    assert len(result.candidates) == 3


def test_search_stops_when_cancelled():
    reporter = RecordingReporter()
    reporter.cancel()
    with pytest.raises(Cancelled):
        search(image_heavy_problem(requests=20), trials=5, reporter=reporter)


def test_search_with_too_few_devices_for_epd_says_so():
    with pytest.raises(EpdInputError, match="too few"):
        search(image_heavy_problem(devices=2), modes=("epd",), trials=2)


def test_params_round_trip_a_configuration():
    problem = image_heavy_problem()
    cfg = config_for(problem, "epd", (3, 1, 2), irp_degree=3, decode_batch=32, policy="shortest-first")
    assert params_of(cfg) == dict(mode="epd", encode_batch=1, prefill_batch=1, decode_batch=32,
                                  policy="shortest-first", encode_n=3, prefill_n=1, decode_n=2, irp=3)


def test_unknown_strategy_is_a_failed_row_not_a_crash():
    out = run_strategy(image_heavy_problem(requests=10), "magic")
    assert out.status == "failed" and "unknown EPD strategy" in out.error


def test_at_scale_epd_has_lower_ttft_and_more_goodput_than_pd_only():
    from core.techniques.phase_disaggregation.baselines import compare_at_scale
    from core.techniques.phase_disaggregation.scenarios import derived_slo, illustrative_costs, image_heavy_workload
    from core.techniques.phase_disaggregation.types import EpdProblem

    costs, w = illustrative_costs(), image_heavy_workload(requests=40)
    problem = EpdProblem(costs=costs, workload=w, slo=derived_slo(costs, w), devices=tuple(f"d{i}" for i in range(6)))
    c = compare_at_scale(problem, trials=6)
    rows = {r.strategy: r for r in c.rows}
    assert rows["search"].candidate.goodput_rps > rows["pd-only"].candidate.goodput_rps
    assert rows["search"].ttft_p50_s < rows["pd-only"].ttft_p50_s
    assert c.trials == 6 and c.rate_rps > 0


def test_derived_ttft_slo_is_met_by_ninety_percent_of_requests_alone_on_one_device():
    from core.techniques.phase_disaggregation.scenarios import derived_slo, illustrative_costs, image_heavy_workload

    costs, w = illustrative_costs(), image_heavy_workload(requests=50)
    slo = derived_slo(costs, w, ttft_slack=1.0)
    alone = [costs.encode_s(r.tiles) + costs.prefill_s(costs.prefill_tokens(r)) for r in w.requests]
    assert sum(t <= slo.ttft_s for t in alone) / len(alone) >= 0.9
