"""*Run on agents* in the expert-offloading plan view: the plan the view made, run on its device for
prompts typed here, with the compute and storage lanes and the expert heat map filling live,
recorded in the workspace (Sessions replays it) — the technique's run without leaving its view
(the Run screen runs the same plan through *Use for Run*).

The run is the shared one (``core.runs.generation.generate`` over the studio's coordinator,
recorded by ``core.sessions.recording.record_run``); events reach the view as partial results,
batched by the worker's reporter.
"""

from __future__ import annotations

import time
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QHBoxLayout, QLabel, QLineEdit, QPlainTextEdit, QPushButton, QSpinBox, QSplitter, QVBoxLayout, QWidget,
)

from agents.protocol import TimelineEvent
from gui.techniques.expert_offload.heat_map import ExpertHeatMap
from gui.timeline import TimelineView
from gui.widgets import InlineMessage

PROMPTS = "The secret of life is | A wise man once said"


class _ToReporter:
    """A run sink that hands events and texts to the worker's reporter (the view draws them)."""

    def __init__(self, reporter) -> None:
        self.reporter = reporter

    def on_event(self, event: TimelineEvent) -> None:
        self.reporter.partial_result(("event", event))

    def on_tokens(self, tokens) -> None:
        self.reporter.partial_result(("tokens", tokens))


def run_job(reporter, coordinator, plan, model_dir: str, prompts: list[str], max_new_tokens: int,
            workspace: str, origin=None) -> dict:
    """Run ``plan`` (its stages of kind ``expert-offload``) on the agents, recorded when a workspace is open
    with ``origin`` (the view's problem and plan, a ``PlanOrigin``: what predicts its replay)."""
    from core.runs.generation import GenerationSettings, generate
    from core.runs.prediction import run_prompt_tokens
    from core.runs.run_stream import FanoutSink
    from core.sessions.recording import record_run
    from core.techniques.run_origin import recorded_origin

    settings = GenerationSettings(max_new_tokens=max_new_tokens)
    lanes = [s.device for s in plan.stages] + [f"{s.device}:storage" for s in plan.stages]
    sink = _ToReporter(reporter)
    model_dir = str(Path(model_dir).resolve())  # agents do not share the studio's working directory
    if not workspace:
        out = generate(coordinator, plan, model_dir, prompts, settings, sink=sink, reporter=reporter)
        return {"run_id": None, "texts": list(out.texts), "wall_s": out.result.wall_s}
    with record_run(workspace, model=Path(model_dir).name, mode=settings.mode,
                    settings={"prompts": prompts, "lanes": lanes, "max_new_tokens": max_new_tokens,
                              "technique": "expert-offload", "prompt_tokens": run_prompt_tokens(model_dir, prompts)},
                    session_name=f"Expert offloading {time.strftime('%Y-%m-%d %H:%M')}", plan=plan,
                    origin=recorded_origin(origin) if origin is not None else None) as run:
        out = generate(coordinator, plan, model_dir, prompts, settings, sink=FanoutSink(sink, run.recorder),
                       reporter=reporter)
        run.status = "completed"
        return {"run_id": run.run_id, "texts": list(out.texts), "wall_s": out.result.wall_s}


class ExpertRunBox(QWidget):
    """Prompts, *Run on agents*, and the run: lanes (compute, storage), heat map, generated text."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.prompts = QLineEdit(PROMPTS)
        self.prompts.setAccessibleName("Prompts")
        self.prompts.setToolTip("Prompts to generate for, separated by |")
        self.max_tokens = QSpinBox(minimum=1, maximum=512, value=24, prefix="max ", suffix=" tokens")
        self.run_button = QPushButton("Run on agents")
        self.status = QLabel("")
        self.status.setWordWrap(True)
        self.message = InlineMessage()
        self.timeline = TimelineView()
        self.heat_map = ExpertHeatMap()
        self.text = QPlainTextEdit()
        self.text.setReadOnly(True)
        self.text.setAccessibleName("Generated text")
        row = QHBoxLayout()
        for w in (QLabel("Prompts"), self.prompts, self.max_tokens, self.run_button):
            row.addWidget(w, 1 if w is self.prompts else 0)
        side = QSplitter(Qt.Vertical)
        side.addWidget(self.heat_map)
        side.addWidget(self.text)
        live = QSplitter(Qt.Horizontal)
        live.setChildrenCollapsible(False)
        live.addWidget(self.timeline)
        live.addWidget(side)
        live.setStretchFactor(0, 3)
        live.setStretchFactor(1, 2)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(row)
        lay.addWidget(self.status)
        lay.addWidget(self.message)
        lay.addWidget(live, 1)
        self.last: dict | None = None

    def prompt_list(self) -> list[str]:
        return [p.strip() for p in self.prompts.text().split("|") if p.strip()]

    def started(self, lanes: list[str]) -> None:
        self.last = None
        self.message.show_lines([])
        self.timeline.clear()
        self.timeline.set_lanes(lanes)
        self.heat_map.reset()
        self.text.clear()
        self.status.setText("loading the plan on the agent…")

    def take(self, value) -> None:
        what, item = value
        if what == "event":
            self.timeline.append_events([item])
            self.heat_map.add_events([item])

    def finished(self, out: dict) -> None:
        self.last = out
        self.timeline.flush()
        self.timeline.fit_all()
        self.text.setPlainText("\n\n".join(f"#{i}  {t}" for i, t in enumerate(out["texts"])))
        self.status.setText(f"completed in {out['wall_s']:.2f} s"
                            + (f"; recorded as run {out['run_id']} (Sessions replays it)" if out["run_id"] else
                               "; not recorded: open a workspace to keep runs"))

    def failed(self, message: str) -> None:
        self.timeline.flush()
        self.status.setText("failed")
        self.message.show_lines([message], "The run failed:")
