"""What a spatial run's timeline boxes mean, in its own words: strips computed, gathered, scattered.

A CNN width split has no micro-batches, prefill or decode; its plan view's live timeline and a
replay or Compare of its recorded run (the run monitor, ``gui.screens.run_comparison``) name them alike."""

from __future__ import annotations

from gui.timeline.view import LEGEND_TERMS, LEGEND_TOOLTIP, TimelineView

STRIP_LEGEND_TERMS = (("▨", "strip compute"), ("▂", "gather (lower band)"),
                      ("<span style='color:gray'>■</span>", "scatter"))
"""The legend's entries (symbol as rich text, words), shown without micro-batch colours."""
STRIP_LEGEND_TOOLTIP = ("Per agent: hatched = computing its strips (the gateway also the head); thin lower box = its "
                        "strip going back to the gateway (gather); grey = waiting for its strip (scatter)")



def name_boxes(timeline: TimelineView, image_run: bool) -> None:
    """A recorded run's legend: strips for an image (spatial) run, micro-batches and phases for any other
    (a replay's monitor shows one run after another, so it is set both ways)."""
    if image_run:
        timeline.set_legend_terms(STRIP_LEGEND_TERMS, STRIP_LEGEND_TOOLTIP, micro_batches=False)
    else:
        timeline.set_legend_terms(LEGEND_TERMS, LEGEND_TOOLTIP)


__all__ = ["STRIP_LEGEND_TERMS", "STRIP_LEGEND_TOOLTIP", "name_boxes"]
