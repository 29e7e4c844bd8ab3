"""Speculative decoding's face on the Run screen: the accepted tokens of each verify trip.

The timeline draws the run's own ``draft`` (the source proposing) and ``rollback`` (a stage
rewinding its KV cache past rejected proposals) events in their colours (``gui.timeline.items``),
and a stage's decode box of a speculative run is one verify trip of k + 1 positions. This plot adds
what the timeline cannot show at a glance: how many tokens each trip committed (its accepted
proposals and the target's own token; k + 1 at most, 1 when the draft's first guess was wrong).
It reads only the run's token events (a trip's tokens arrive at the source together), so a live
run and a replayed recording draw the same bars.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyqtgraph as pg

from agents.protocol import TimelineEvent, TokenEvent
from gui.timeline.items import MARK_COLOURS
from gui.timeline.view import LEGEND_TERMS, LEGEND_TOOLTIP

PLOT_TITLE = "Tokens per verify trip (speculative)"
SPECULATIVE_LEGEND_TERMS = (*LEGEND_TERMS, (f"<span style='color:{MARK_COLOURS['draft']}'>■</span>", "draft"),
                            (f"<span style='color:{MARK_COLOURS['rollback']}'>▮</span>", "rollback"))
"""The timeline's legend for a speculative run: its draft and rollback boxes named."""
SPECULATIVE_LEGEND_TOOLTIP = (LEGEND_TOOLTIP + "; purple on the source = the draft proposing k tokens; each decode "
                              "box = one verify trip of k + 1 positions; red bar = a stage rolling its KV cache back "
                              "past rejected proposals")


def is_speculative(events: Sequence[TimelineEvent]) -> bool:
    """Whether these events are a speculative run's (its source drafts)."""
    return any(e.kind == "draft" for e in events)


def tokens_per_trip(tokens: Sequence[TokenEvent]) -> list[int]:
    """Tokens each verify trip committed, in order (the prefill's first token is no trip's)."""
    counts: dict[float, int] = {}
    for tok in tokens:
        counts[tok.t_s] = counts.get(tok.t_s, 0) + len(tok.token_ids)
    return [counts[t] for t in sorted(counts)][1:]


class TokensPerTripPlot(pg.PlotWidget):
    """Bars: tokens committed by each trip; a dashed line: their mean."""

    def __init__(self) -> None:
        super().__init__()
        self.setAccessibleName("Tokens per verify trip")
        self.setToolTip("Each bar is one verify trip of a speculative run: the draft's proposals the target "
                        "accepted plus the target's own token (1 = the first proposal was rejected)")
        self.setMenuEnabled(False)
        self.hideButtons()
        self.setMouseEnabled(x=False, y=False)
        self.setLabel("bottom", "trip")
        self.setMinimumHeight(80)
        self.bars = pg.BarGraphItem(x=[], height=[], width=0.8, brush="#9467bd")
        self.addItem(self.bars)
        self.mean_line = pg.InfiniteLine(angle=0, pen=pg.mkPen("#e15759", width=1.5, style=pg.QtCore.Qt.PenStyle.DashLine))
        self.addItem(self.mean_line)
        self.counts: list[int] = []

    def set_tokens(self, tokens: Sequence[TokenEvent]) -> None:
        self.counts = tokens_per_trip(tokens)
        xs = list(range(1, len(self.counts) + 1))
        self.bars.setOpts(x=xs, height=self.counts, width=0.8)
        self.mean_line.setVisible(bool(self.counts))
        if self.counts:
            self.mean_line.setValue(sum(self.counts) / len(self.counts))
            self.setYRange(0, max(self.counts) + 0.5, padding=0)
            self.setXRange(0.4, len(self.counts) + 0.6, padding=0)

    def apply_palette(self, base, text) -> None:
        """The Run monitor's colours (its tokens/s plot's)."""
        self.setBackground(base)
        for name in ("left", "bottom"):
            self.getAxis(name).setPen(pg.mkPen(text))
            self.getAxis(name).setTextPen(pg.mkPen(text))

    @property
    def mean(self) -> float | None:
        return sum(self.counts) / len(self.counts) if self.counts else None


__all__ = ["LEGEND_TERMS", "LEGEND_TOOLTIP", "PLOT_TITLE", "SPECULATIVE_LEGEND_TERMS", "SPECULATIVE_LEGEND_TOOLTIP",
           "TokensPerTripPlot", "is_speculative", "tokens_per_trip"]
