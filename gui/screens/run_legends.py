"""A recorded run's timeline legend in its technique's words, wherever it is drawn again (the replay's
monitor, Compare): a spatial run's strips, an EPD run's requests, any other's micro-batches and phases.
A replay shows one run after another, so every call sets all of it."""

from __future__ import annotations

from gui.techniques.phase_disaggregation.legend import EPD_COLOUR_WORD, EPD_LEGEND_TERMS, EPD_LEGEND_TOOLTIP
from gui.techniques.spatial.legend import STRIP_LEGEND_TERMS, STRIP_LEGEND_TOOLTIP
from gui.timeline.view import LEGEND_TERMS, LEGEND_TOOLTIP, TimelineView


def name_boxes(timeline: TimelineView, settings: dict | None) -> None:
    """Set ``timeline``'s legend for a run recorded with ``settings`` (its ``technique``)."""
    technique = (settings or {}).get("technique")
    if technique == "spatial":
        timeline.set_legend_terms(STRIP_LEGEND_TERMS, STRIP_LEGEND_TOOLTIP, micro_batches=False, step_word="image")
    elif technique == "phase-disaggregation":
        timeline.set_legend_terms(EPD_LEGEND_TERMS, EPD_LEGEND_TOOLTIP, colour_word=EPD_COLOUR_WORD)
    else:
        timeline.set_legend_terms(LEGEND_TERMS, LEGEND_TOOLTIP)


__all__ = ["name_boxes"]
