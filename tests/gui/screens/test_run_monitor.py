"""The Run screen's rate plot is ~100 px high: its value axis labels one tick per 28 px at most, so
the labels neither crowd nor clip, before a run (0 … 1) as with data."""

from __future__ import annotations

import math

import pytest

from gui.screens.run_monitor import RunMonitorView, SparseAxis, nice_ceiling


@pytest.mark.parametrize("lo, hi, size, most", [(0.0, 1.0, 95.0, 3), (0.0, 137.4, 95.0, 3), (0.0, 1.0, 300.0, 10)])
def test_a_short_axis_gets_at_most_one_tick_per_28_px_at_round_values(qtbot, lo, hi, size, most):
    (step, offset), = SparseAxis("left").tickSpacing(lo, hi, size)
    ticks = int((hi - lo) // step) + 1
    assert ticks <= max(2, size // SparseAxis.MIN_GAP_PX + 1) and ticks <= most + 1
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert min(abs(mantissa - m) for m in (1, 2, 5, 10)) < 1e-9  # 1, 2 or 5 × 10^k


def test_before_a_run_the_rate_plot_shows_0_to_1_with_room_for_the_top_label(qtbot):
    monitor = RunMonitorView()
    qtbot.addWidget(monitor)
    y0, y1 = monitor.rate_plot.getViewBox().viewRange()[1]
    assert y0 < 0 and y1 > 1  # padded: the labels at 0 and 1 are not cut at the plot's edges
    assert isinstance(monitor.rate_plot.getAxis("left"), SparseAxis)


def test_the_rate_plot_has_no_vertical_axis_title_to_cut_the_heading_names_its_unit(qtbot):
    monitor = RunMonitorView()
    qtbot.addWidget(monitor)
    assert monitor.rate_plot.getAxis("left").labelText == ""


@pytest.mark.parametrize("peak, top", [(0.0, 1.0), (0.7, 1.0), (100.0, 100.0), (160.6, 200.0), (250.0, 500.0)])
def test_the_rate_plots_top_is_the_least_1_2_5_tick_at_or_above_the_peak(peak, top):
    assert nice_ceiling(peak) == pytest.approx(top)


def test_an_epd_replays_legend_names_requests_and_their_phases_not_micro_batches(qtbot):
    """An EPD run's colours are its requests and its hatched boxes encode and prefill: the replay's
    legend read "mb0 … mb5, prefill, decode" (a layer-sharding pipeline's words)."""
    from agents.protocol import TimelineEvent

    monitor = RunMonitorView()
    qtbot.addWidget(monitor)
    monitor.reset(["edge-a", "edge-c"], settings={"technique": "phase-disaggregation"})
    monitor.add_timeline_events([TimelineEvent(device="edge-a", stage=0, kind="compute", phase="prefill", step=0,
                                               micro_batch=r, start_s=0.1 * r, end_s=0.1 * r + 0.05)
                                 for r in range(3)])
    monitor.timeline.flush()
    legend = monitor.timeline.legend_text()
    assert "req 0" in legend and "req 2" in legend and "encode / prefill" in legend
    assert "mb0" not in legend
    monitor.reset(["edge-a"], settings={"technique": "layer-sharding"})  # the next replay: a pipeline's words
    monitor.add_timeline_events([TimelineEvent(device="edge-a", stage=0, kind="compute", phase="prefill", step=0,
                                               micro_batch=0, start_s=0.0, end_s=0.05)])
    monitor.timeline.flush()
    assert "mb0" in monitor.timeline.legend_text() and "req" not in monitor.timeline.legend_text()
