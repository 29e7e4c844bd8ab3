"""What a spatial run's timeline boxes mean, in its own words: strips computed, gathered, scattered.

A CNN width split has no micro-batches, prefill or decode; its plan view's live timeline and a
replay or Compare of its recorded run (``gui.screens.run_legends``) name them alike."""

from __future__ import annotations

STRIP_LEGEND_TERMS = (("▨", "strip compute"), ("▂", "gather (lower band)"),
                      ("<span style='color:gray'>■</span>", "scatter"))
"""The legend's entries (symbol as rich text, words), shown without micro-batch colours."""
STRIP_LEGEND_TOOLTIP = ("Per agent: hatched = computing its strips (the gateway also the head); thin lower box = its "
                        "strip going back to the gateway (gather); grey = waiting for its strip (scatter)")

__all__ = ["STRIP_LEGEND_TERMS", "STRIP_LEGEND_TOOLTIP"]
