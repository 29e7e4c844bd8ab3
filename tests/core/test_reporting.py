"""One task's phases report into one bar that only moves forward."""

from __future__ import annotations

from core.reporting import PhaseReporter, RecordingReporter


def test_phases_fill_their_own_span_of_one_bar():
    bar = RecordingReporter()
    for start, span, steps in ((0.0, 0.6, 3), (0.6, 0.4, 2)):
        phase = PhaseReporter(bar, start, span)
        for i in range(steps + 1):
            phase.progress(i, steps)
    fractions = [d / t for d, t in bar.progresses]
    assert fractions == sorted(fractions)
    assert fractions[0] == 0.0 and abs(fractions[3] - 0.6) < 1e-12 and fractions[-1] == 1.0


def test_a_phase_passes_cancel_and_status_through():
    bar = RecordingReporter()
    phase = PhaseReporter(bar, 0.5, 0.5)
    phase.status("links")
    bar.cancel()
    assert bar.statuses == ["links"] and phase.cancel_requested()
