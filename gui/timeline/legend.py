"""The timeline's legend and its *Highlight* picker, in the words of what its boxes are: micro-batch
colours, prefill and decode for a language model's run; a technique whose boxes mean other things
(spatial strips, one image after another) names its own terms and is offered no micro-batch to
highlight (``TimelineLegend``, mixed into ``TimelineView``)."""

from __future__ import annotations

import re
from typing import Sequence

from gui.timeline.items import MICRO_BATCH_COLOURS

LEGEND_TERMS = (("▨", "prefill"), ("■", "decode"), ("<span style='color:gray'>■</span>", "waiting"))
"""The legend's entries after the micro-batch colours: (symbol as rich text, words)."""
LEGEND_TOOLTIP = "Colour = micro-batch; hatched = prefill; thin lower box = transfer; grey = waiting for input"
LEGEND_CHIPS = 6
"""Micro-batch colours named one by one up to this many; more are one row of chips and a range."""


def _plain(rich: str) -> str:
    """A legend's rich text as the words it shows."""
    return re.sub(r"<[^>]+>", "", rich).replace("&nbsp;", " ")


def highlight_choices(micro_batches: bool, step_word: str) -> tuple[tuple[str, str], ...]:
    """The *Highlight* picker's (label, box column) entries: no micro-batch where the boxes have none."""
    return ((("Highlight micro-batch", "micro_batch"),) if micro_batches else ()) + (
        (f"Highlight {step_word}", "step"), ("Highlight nothing", ""))


class TimelineLegend:
    """The legend label's text and the highlight picker's entries of a ``TimelineView``."""

    def set_legend_terms(self, terms: Sequence[tuple[str, str]], tooltip: str, *, micro_batches: bool = True,
                         colour_word: str = "mb", step_word: str = "token") -> None:
        """What the legend names (after the micro-batch colours, each "mb3" or ``colour_word`` + 3, unless
        ``micro_batches`` is off): for a technique whose boxes mean other things, e.g. spatial strips.
        The picker then offers no micro-batch, and names a step ``step_word`` (a spatial run's image)."""
        self._legend_terms, self._legend_micro_batches = tuple(terms), micro_batches
        self._colour_word = colour_word.replace(" ", "&nbsp;")  # an entry never breaks inside
        self.legend_label.setToolTip(tooltip)
        if self._offer_highlights(micro_batches, step_word):
            self._update_overlay()  # a selection's highlight follows the new choice
        self._update_legend()

    def _offer_highlights(self, micro_batches: bool = True, step_word: str = "token") -> bool:
        """Fill the picker, its first entry chosen, when its entries change (True); the same ones stay as chosen."""
        choices = highlight_choices(micro_batches, step_word)
        combo = self.highlight_combo
        if [(combo.itemText(i), combo.itemData(i)) for i in range(combo.count())] == list(choices):
            return False
        combo.blockSignals(True)
        combo.clear()
        for label, column in choices:
            combo.addItem(label, column)
        combo.setCurrentIndex(0)
        combo.blockSignals(False)
        return True

    def legend_text(self) -> str:
        """The legend as plain words (what an operator reads)."""
        return _plain(self.legend_label.text())

    def _update_legend(self) -> None:
        mbs = sorted(self._micro_batches) or [0]

        def chip(m: int) -> str:
            return f"<span style='color:{MICRO_BATCH_COLOURS[m % len(MICRO_BATCH_COLOURS)]}'>■</span>"

        if not self._legend_micro_batches:
            entries = []
        elif len(mbs) <= LEGEND_CHIPS:
            entries = [f"{chip(m)}&nbsp;{self._colour_word}{m}" for m in mbs]
        else:  # one entry: a chip per colour in use, then the range
            chips = "".join(chip(m) for m in mbs[:len(MICRO_BATCH_COLOURS)])
            entries = [f"{chips}&nbsp;{self._colour_word}{mbs[0]}–{mbs[-1]}"]
        entries += [f"{symbol}&nbsp;{words.replace(' ', '&nbsp;')}" for symbol, words in self._legend_terms]
        # entries never break inside (non-breaking spaces); the label wraps between them
        self.legend_label.setText("&nbsp;&nbsp; ".join(entries))
        self._legend_width = self.legend_label.fontMetrics().horizontalAdvance(_plain(self.legend_label.text())) + 16
        if self._bar_wrapped is not None:
            self._arrange_for_width(self.width())
