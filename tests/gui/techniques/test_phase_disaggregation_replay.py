"""An EPD run recorded in the workspace shows its requests' timeline and SLO figures beside its replay
(the run monitor's side column), read back from the store; any other run does not."""

from __future__ import annotations

import statistics

from core.sessions.store import SessionStore
from core.techniques.phase_disaggregation.simulator import record_simulation, simulate_pools
from core.techniques.phase_disaggregation.types import SLO, PoolConfig
from core.techniques.phase_disaggregation.workload import poisson_workload
from gui.screens.run_monitor import RunMonitorView
from tests.techniques.phase_disaggregation.conftest import make_costs


def test_a_recorded_epd_runs_requests_and_slo_figures_show_beside_its_replay(qtbot, tmp_path):
    workload = poisson_workload(rate_rps=2.0, requests=5, seed=2, images=(1, 2), tiles_per_image=(1, 2),
                                prompt_tokens=(8, 16), output_tokens=(4, 6))
    pools = PoolConfig(encode=("e",), prefill=("p",), decode=("d",))
    sim = simulate_pools(make_costs(), workload, pools, record=True)
    slo = SLO(ttft_s=10.0, tpot_s=10.0)  # every request meets it
    with SessionStore(str(tmp_path / "ws.sqlite")) as store:
        run_id = record_simulation(store, store.create_session("epd"), sim, model="m", workload=workload, pools=pools,
                                   slo=slo)
        settings = {r.id: r for r in store.runs()}[run_id].settings
    monitor = RunMonitorView()
    qtbot.addWidget(monitor)
    monitor.reset(["e", "p", "d"], settings=settings)
    assert not monitor.requests_panel.isHidden()
    assert [m.request_id for m in monitor.requests_panel.timeline.metrics] == [0, 1, 2, 3, 4]
    ttft_ms = statistics.median(m.prefill_end_s - m.arrival_s for m in sim.metrics) * 1e3
    text = monitor.requests_panel.figures.text()
    assert text.startswith(f"TTFT p50 {ttft_ms:.0f} ms") and text.endswith("SLO met by 100% of 5")
    monitor.reset(["a"], settings={"technique": "layer-sharding"})
    assert monitor.requests_panel.isHidden() and monitor.requests_label.isHidden()


def test_the_sessions_replay_of_a_predicted_epd_run_titles_its_plot_predicted(qtbot, tmp_path):
    from tests.gui.opened_run import sessions_with_run_open

    workload = poisson_workload(rate_rps=2.0, requests=3, seed=2, images=(1, 1), tiles_per_image=(1, 1),
                                prompt_tokens=(8, 8), output_tokens=(4, 4))
    pools = PoolConfig(encode=("e",), prefill=("p",), decode=("d",))
    sim = simulate_pools(make_costs(), workload, pools, record=True)
    path = str(tmp_path / "ws.sqlite")
    with SessionStore(path) as store:
        run_id = record_simulation(store, store.create_session("epd"), sim, model="m", workload=workload, pools=pools)
        assert {r.id: r for r in store.runs()}[run_id].kind == "predicted"
    panel = sessions_with_run_open(qtbot, path, run_id)
    title = panel.monitor.timeline.measured_plot.titleLabel.text
    assert title.startswith("predicted") and "measured" not in title
    panel.monitor.timeline.predicted_check.setChecked(True)
    assert panel.monitor.timeline.measured_plot.titleLabel.text.startswith("predicted,")
    assert panel.shutdown()
