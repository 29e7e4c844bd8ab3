"""A timeline view that is dropped is collected without a crash. Its items once held bound methods of
the view (the range view box's callback): a cycle whose collection deleted the view, and so its
scene, from inside an item's destructor (a segfault in ``QGraphicsScene::clear``; CI of stop 38).
Run in a child process, since a segfault would end the test run itself."""

from __future__ import annotations

import os
import subprocess
import sys

DROPPED_VIEW = """
import gc
from PySide6.QtWidgets import QApplication
from core.planning.plan import plan_from_boundaries
from core.runs.simulator import simulate
from gui.timeline import TimelineView
from tests.gui.problems import make_problem

app = QApplication([])
devices = ["phone", "laptop", "server"]
plan = plan_from_boundaries("tiny-llama", 10, devices, [2, 6], micro_batches=1)
events = simulate(make_problem(), plan, "sequential", micro_batches=1, micro_batch_size=1, generated_tokens=3).events
view = TimelineView()
view.set_lanes(devices)
view.append_events(events)
view.flush()
view.select_event(max((e for e in events if e.kind == "compute"), key=lambda e: e.duration_s))
del view
gc.collect()
print("collected")
"""


def test_a_dropped_timeline_view_is_collected_without_a_crash():
    out = subprocess.run([sys.executable, "-c", DROPPED_VIEW], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr[-2000:]}"
    assert out.stdout.strip().splitlines()[-1] == "collected"
