"""The Run screen's sampling fields: HF's repetition penalty and n-gram ban, and OpenAI's frequency
and presence penalties (``edgeshard run --frequency-penalty/--presence-penalty``). Each reaches the
run through ``RunSettings`` and is recorded with it; all four need the token history, so a run that
samples without one (staggered attention offloading) gets them off and the fields say why.
"""

from __future__ import annotations

import math

from PySide6.QtCore import QObject, Signal
from PySide6.QtWidgets import QDoubleSpinBox, QFormLayout, QLineEdit, QSpinBox, QWidget

from gui.screens.run_job import NO_REPEAT_NGRAM_RANGE, REPETITION_PENALTY_RANGE
from gui.widgets import row, say_why_disabled

OPENAI_PENALTIES = (("frequency_penalty", "Frequency penalty",
                     "OpenAI's frequency_penalty in [-2, 2] (0 = off): a token's logit loses this per time it was "
                     "generated (positive: less repetition; negative: more). Recorded with the run"),
                    ("presence_penalty", "Presence penalty",
                     "OpenAI's presence_penalty in [-2, 2] (0 = off): a token's logit loses this once it was "
                     "generated at all (positive: new topics). Recorded with the run"))
"""(RunSettings field, label, tooltip) of the two OpenAI penalties, typed as text: a value out of
range is refused at Start with a message, not silently clamped."""


def penalty_problem(label: str, text: str) -> str:
    """Why ``text`` is not an OpenAI penalty ("" when it is): core's own check of the range."""
    from core.runs.generation import GenerationSettings, settings_problem

    try:
        value = float(text.strip() or "0")
    except ValueError:
        return f"{label} {text.strip()!r} is not a number: enter one in [-2, 2] (0 = off)."
    problem = settings_problem(GenerationSettings(frequency_penalty=value))
    if problem is not None:
        return f"{label} {problem[1]}."
    return ""


class SamplingFields(QObject):
    """The four fields (rows of the Run screen's form) and what they make of ``RunSettings``."""

    changed = Signal()

    def __init__(self, parent: QWidget) -> None:
        super().__init__(parent)
        self.penalty_spin = QDoubleSpinBox()
        self.penalty_spin.setRange(REPETITION_PENALTY_RANGE[0], REPETITION_PENALTY_RANGE[1])
        self.penalty_spin.setSingleStep(0.05)
        self.penalty_spin.setDecimals(2)
        self.penalty_spin.setValue(1.0)
        self.penalty_spin.setSpecialValueText("off")  # 1.0, the lowest value: no penalty
        self.penalty_spin.setAccessibleName("Repetition penalty")
        self.penalty_spin.setToolTip(
            "Discourage repeating a token the text already holds (HF's repetition_penalty; about 1.2 keeps greedy "
            "text from looping). On, the last stage is also sent the prompts' token ids. Recorded with the run")
        self.ngram_spin = QSpinBox()
        self.ngram_spin.setRange(NO_REPEAT_NGRAM_RANGE[0], NO_REPEAT_NGRAM_RANGE[1])
        self.ngram_spin.setValue(0)
        self.ngram_spin.setSpecialValueText("off")  # 0, the lowest value: no ban
        self.ngram_spin.setAccessibleName("No-repeat n-gram size")
        self.ngram_spin.setToolTip(
            "Never generate the same run of this many tokens twice in a sequence (HF's no_repeat_ngram_size; "
            "2 or 3 stops greedy text from repeating a phrase). On, the last stage is also sent the prompts' "
            "token ids. Recorded with the run")
        self.penalty_spin.valueChanged.connect(self.changed)
        self.ngram_spin.valueChanged.connect(self.changed)
        self.openai_edits: dict[str, QLineEdit] = {}
        for name, label, tip in OPENAI_PENALTIES:
            edit = QLineEdit()  # empty: 0, off (the placeholder names the field: the row holds two)
            edit.setAccessibleName(label)
            edit.setToolTip(tip)
            edit.setPlaceholderText(f"{label.split()[0].lower()} 0")
            edit.setMinimumWidth(40)
            edit.textChanged.connect(self.changed)
            self.openai_edits[name] = edit

    def add_rows(self, form: QFormLayout) -> None:
        form.addRow("Repetition penalty", self.penalty_spin)
        form.addRow("No-repeat n-gram", self.ngram_spin)  # as wide as "Repetition penalty": the column keeps its width
        # one row for the pair (as "Speculate k, seed"): the column fits 1024x700 unscrolled
        form.addRow("Freq., presence", row(*self.openai_edits.values(), stretch_last=True))

    def widgets(self) -> tuple[QWidget, ...]:
        return (self.penalty_spin, self.ngram_spin, *self.openai_edits.values())

    def problems(self) -> list[str]:
        """Each OpenAI penalty that is not a number in [-2, 2], in words (the Start refusal)."""
        said = (penalty_problem(label, self.openai_edits[name].text()) for name, label, _tip in OPENAI_PENALTIES)
        return [p for p in said if p]

    def values(self, refused: bool) -> dict:
        """``RunSettings``' sampling fields; ``refused`` (no token history): all off. A penalty that
        is not a number is NaN here, which Start refuses (``problems``) before it runs."""
        def number(edit: QLineEdit) -> float:
            try:
                return float(edit.text().strip() or "0")
            except ValueError:
                return math.nan

        if refused:
            return {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "frequency_penalty": 0.0,
                    "presence_penalty": 0.0}
        return {"repetition_penalty": round(self.penalty_spin.value(), 2), "no_repeat_ngram_size": self.ngram_spin.value(),
                **{name: number(edit) for name, edit in self.openai_edits.items()}}

    def apply(self, settings) -> None:
        """Show ``settings``' sampling fields (the last workspace's, restored at launch)."""
        self.penalty_spin.setValue(settings.repetition_penalty)
        self.ngram_spin.setValue(settings.no_repeat_ngram_size)
        for name, edit in self.openai_edits.items():
            value = getattr(settings, name)
            edit.setText(f"{value:g}" if value else "")

    def set_usable(self, refusal: str, busy: bool) -> None:
        """Enabled unless ``refusal`` (why not, said on each) or a run is in progress."""
        for w in self.widgets():
            w.setEnabled(not refusal and not busy)
        say_why_disabled({w: refusal or "a run is in progress" for w in self.widgets()})
