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
from pathlib import Path

import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QComboBox, QFileDialog, QHBoxLayout, QSizePolicy, QSpinBox, QWidget

from agents.protocol import TimelineEvent, TokenEvent
from gui.timeline.items import MARK_COLOURS
from gui.timeline.view import LEGEND_TERMS, LEGEND_TOOLTIP
from gui.widgets import browse_button

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


MAX_SPECULATE = 8
MAX_SEED = 999
"""The largest seed the Run screen offers (its field shares Speculate k's width at 1024x700; the CLI
takes any below 2**63)."""
"""The Run screen's k range (``agents.techniques.speculative.messages.MAX_SPECULATE``, checked at Start)."""


def shipped_draft(model_dir: str) -> str:
    """The draft shipped beside ``model_dir`` (``<name>-draft``, as the demo's demo-llama-draft), or ""."""
    if not model_dir:
        return ""
    path = Path(model_dir).resolve()
    draft = path.with_name(path.name + "-draft")
    return str(draft) if (draft / "config.json").is_file() else ""


class SpeculativeRunControls(QWidget):
    """The Run screen's "Draft model" (none, the model's shipped draft, or a chosen checkpoint) and
    "Speculate k" (auto: the cost model's k for the plan, or 1..8) for a layer-sharding run. Two
    widgets, so the screen's form lays them out as its own rows (``draft_row``, ``k_spin``)."""

    changed = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.draft_combo = QComboBox()
        self.draft_combo.setAccessibleName("Draft model")
        self.draft_combo.setToolTip("Speculative decoding: a small checkpoint sharing the model's tokenizer proposes "
                                    "k tokens a trip on the source device; the stages verify them at once (one "
                                    "prompt, sequential; greedy tokens are the model's own, sampled ones its distribution). None: plain decoding")
        self.draft_combo.addItem("None", "")
        self.browse_button = browse_button("Browse for draft model directory", "Browse: choose the draft's checkpoint directory")
        self.browse_button.clicked.connect(self._on_browse_clicked)
        self.draft_row = QWidget(self)
        row = QHBoxLayout(self.draft_row)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.draft_combo, 1)
        row.addWidget(self.browse_button)
        self.k_spin = QSpinBox()
        self.k_spin.setRange(0, MAX_SPECULATE)
        self.k_spin.setSpecialValueText("auto")  # 0: the cost model's k for the plan (or plain decoding)
        self.k_spin.setAccessibleName("Speculate k")
        self.k_spin.setToolTip("Tokens the draft proposes a trip (1-8); auto: the cost model's k for this plan from the "
                               "draft's stored acceptance rate (plain decoding when that is predicted faster)")
        self.seed_spin = QSpinBox()
        self.seed_spin.setRange(0, MAX_SEED)
        self.seed_spin.setSpecialValueText("off")  # 0: greedy, the target's own tokens
        self.seed_spin.setAccessibleName("Speculative sampling seed")
        self.seed_spin.setToolTip("Sampling seed. off: greedy, the model's own greedy tokens; a seed (1-999): "
                                  "speculative sampling at temperature 1, the tokens distributed as the model's own "
                                  "sampling, the same seed the same tokens")
        self.k_row = QWidget(self)  # Speculate k and the seed: one form row (the screen fits 1024x700)
        k_row = QHBoxLayout(self.k_row)
        k_row.setContentsMargins(0, 0, 0, 0)
        k_row.setSpacing(4)
        for spin in (self.k_spin, self.seed_spin):  # they share the width k alone had: never widen the column
            spin.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
            k_row.addWidget(spin, 1)
        self.draft_combo.currentIndexChanged.connect(self._on_draft_changed)
        self.k_spin.valueChanged.connect(self.changed)
        self.seed_spin.valueChanged.connect(self.changed)
        self._on_draft_changed()
        self.hide()

    def offer_for(self, model_dir: str) -> None:
        """Offer ``model_dir``'s shipped draft (the demo's demo-llama-draft) beside None and chosen ones."""
        draft = shipped_draft(model_dir)
        if draft and self.draft_combo.findData(draft) < 0:
            self.draft_combo.addItem("shipped", draft)  # its name, even "shipped draft", is cut at 1024x700
            self.draft_combo.setItemData(self.draft_combo.count() - 1, draft, Qt.ItemDataRole.ToolTipRole)

    def options(self) -> tuple[str, int | None]:
        """(draft directory, "" for none; k, None for auto)."""
        return self.draft_combo.currentData() or "", self.k_spin.value() or None

    def sample_seed(self) -> int:
        """0: greedy; else the seed of speculative sampling at temperature 1."""
        return self.seed_spin.value()

    def apply(self, draft_dir: str, k: int | None, seed: int = 0) -> None:
        if draft_dir and self.draft_combo.findData(draft_dir) < 0:
            self.draft_combo.addItem(Path(draft_dir).name, draft_dir)
            self.draft_combo.setItemData(self.draft_combo.count() - 1, draft_dir, Qt.ItemDataRole.ToolTipRole)
        self.draft_combo.setCurrentIndex(max(0, self.draft_combo.findData(draft_dir)))
        self.k_spin.setValue(k or 0)
        self.seed_spin.setValue(seed)

    def _on_browse_clicked(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Draft checkpoint directory", self.options()[0])
        if path:
            self.apply(path, self.k_spin.value() or None, self.seed_spin.value())

    def _on_draft_changed(self, *_args) -> None:
        self.k_spin.setEnabled(bool(self.options()[0]))
        self.seed_spin.setEnabled(bool(self.options()[0]))
        self.changed.emit()


def speculative_refusals(settings, problem, plan) -> list[str]:
    """Why the draft and k cannot run, the Run screen's Start refusal (``speculative_settings``)."""
    from core.runs.speculative import DraftMismatch

    try:
        speculative_settings(settings, problem, plan)
    except DraftMismatch as err:
        return [str(err)]
    return []


def speculative_settings(settings, problem, plan):
    """The run's ``core.runs.speculative.SpeculativeSettings`` (None: no draft chosen, or auto predicts
    plain decoding faster), or a one-line ``DraftMismatch`` in the Run screen's words: the same checks
    as ``edgeshard run --draft DIR --speculate K|auto`` (the draft shares the model's vocabulary and
    tokenizer; one prompt, sequential, no repetition penalty or n-gram ban)."""
    from core.runs.speculative import DraftMismatch, auto_settings, check_draft
    from core.models.draft_distillation import stored_acceptance

    draft, k = settings.draft_dir, settings.speculate_k
    if not draft:
        return None
    if k is not None and not 1 <= k <= MAX_SPECULATE:
        raise DraftMismatch(f"Speculate k must be auto or 1-{MAX_SPECULATE}, got {k}.")
    if not Path(draft, "config.json").is_file():
        raise DraftMismatch(f"Draft model {draft} is not a checkpoint directory (no config.json): choose another "
                            "with … beside it, or None.")
    if len(settings.prompts) != 1:
        raise DraftMismatch(f"A speculative run takes one prompt ({len(settings.prompts)} given): keep one line, "
                            "or set Draft model to None.")
    if settings.mode != "sequential" or (settings.micro_batches or 1) != 1:
        raise DraftMismatch("A speculative run is sequential with one micro-batch: set Mode to sequential and "
                            "Micro-batches to the plan's (or 1).")
    if (settings.repetition_penalty != 1.0 or settings.no_repeat_ngram_size
            or getattr(settings, "frequency_penalty", 0.0) or getattr(settings, "presence_penalty", 0.0)):
        raise DraftMismatch("A speculative run takes no repetition penalty, n-gram ban or frequency or presence "
                            "penalty: set them to off (0).")
    if k is not None:  # another vocabulary or tokenizer: "choose a draft trained with the target's tokenizer"
        return check_draft(settings.model_dir, draft, k)
    check_draft(settings.model_dir, draft, 1)
    if problem is None or plan is None:
        raise DraftMismatch("Speculate k auto needs the plan and its planning problem (Plan screen): "
                            "choose a number instead.")
    if stored_acceptance(draft) is None:
        raise DraftMismatch(f"Draft model {Path(draft).name} has no measured acceptance rate, which auto needs: "
                            "choose a number for Speculate k.")
    return auto_settings(problem, plan, settings.model_dir, draft)


def predicted_speculation(settings, problem, plan):
    """(``DraftFigures``, k) for the Run screen's predicted timeline of a speculative run, or None (no
    draft, settings a speculative run refuses, auto choosing plain decoding, or no stored acceptance
    rate to predict trips with): then the prediction is plain decoding's."""
    if not getattr(settings, "draft_dir", "") or problem is None or plan is None:
        return None  # before any import: a plain run's prediction stays off the speculative code path
    from core.runs.speculative import DraftMismatch, draft_figures

    try:
        chosen = speculative_settings(settings, problem, plan)
        return None if chosen is None else (draft_figures(problem, plan, chosen.draft_dir, chosen.draft_device), chosen.k)
    except (DraftMismatch, ValueError, KeyError):
        return None


__all__ = ["MAX_SPECULATE", "SpeculativeRunControls", "shipped_draft", "speculative_refusals", "speculative_settings",
           "LEGEND_TERMS", "LEGEND_TOOLTIP", "PLOT_TITLE", "SPECULATIVE_LEGEND_TERMS", "SPECULATIVE_LEGEND_TOOLTIP",
           "TokensPerTripPlot", "is_speculative", "predicted_speculation", "tokens_per_trip"]
