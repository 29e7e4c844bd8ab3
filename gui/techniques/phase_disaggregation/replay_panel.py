"""An EPD run's requests beside its replay (the run monitor's side column, in Sessions): each
request's encode / E→P / queue / prefill / P→D / decode spans and the SLO figures, from what
the run recorded (``simulator.record_pools_run``: per-request metrics and the SLO)."""

from __future__ import annotations

import msgspec
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from core.errors import EdgeShardError
from core.techniques.phase_disaggregation.on_agents import SloFigures
from core.techniques.phase_disaggregation.types import SLO, RequestMetrics
from gui.techniques.phase_disaggregation.agent_run import figures_text
from gui.techniques.phase_disaggregation.drawings import RequestTimeline


def recorded_requests(settings: dict) -> tuple[tuple[RequestMetrics, ...], SLO | None]:
    """An EPD run's per-request metrics and SLO from its settings (none for another technique's run)."""
    if (settings or {}).get("technique") != "phase-disaggregation" or not settings.get("metrics"):
        return (), None
    try:
        metrics = msgspec.convert(settings["metrics"], tuple[RequestMetrics, ...])
        slo = msgspec.convert(settings["slo"], SLO) if settings.get("slo") else None
    except (msgspec.ValidationError, EdgeShardError):  # a record this version cannot read: nothing to show
        return (), None
    return metrics, slo


class EpdRequestsPanel(QWidget):
    """The recorded requests' timeline and SLO figures of an EPD run (hidden for other runs)."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName("EPD requests")
        self.figures = QLabel()
        self.figures.setWordWrap(True)
        self.figures.setAccessibleName("EPD SLO figures")
        self.timeline = RequestTimeline()
        self.timeline.setMinimumSize(240, 150)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.figures)
        lay.addWidget(self.timeline, 1)

    def show_settings(self, settings: dict | None) -> bool:
        """Show the run's requests when it is an EPD run; whether there were any."""
        metrics, slo = recorded_requests(settings or {})
        self.timeline.show_metrics(metrics)
        self.figures.setText(figures_text(SloFigures.of(metrics, slo)) if metrics and slo is not None
                             else f"{len(metrics)} requests (no SLO recorded)")
        return bool(metrics)


__all__ = ["EpdRequestsPanel", "recorded_requests"]
