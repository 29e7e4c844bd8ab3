"""Screenshots of the Experiments screen after a real run (docs/screenshots/experiments-*.png).

QT_QPA_PLATFORM=xcb xvfb-run -a -s "-screen 0 1600x1000x24" python scripts/screenshot_experiments.py [EXPERIMENT]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from PySide6.QtCore import QEventLoop, QTimer

from gui import app as studio_app
from gui.screens.experiments import ExperimentsPanel

OUT = Path(__file__).resolve().parent.parent / "docs" / "screenshots"


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "table-iv"
    app = studio_app.create_app()
    panel = ExperimentsPanel(out_dir=tempfile.mkdtemp(prefix="edgeshard-experiments-"), time_limit_s=10.0)
    panel.resize(1600, 1000)
    panel.show()
    loop = QEventLoop()
    panel.runner.task_finished.connect(lambda *_: loop.quit())
    panel.runner.task_failed.connect(lambda *_: loop.quit())
    panel.start(name)
    loop.exec()
    for w, h in ((1024, 700), (1600, 1000)):
        panel.resize(w, h)
        for _ in range(5):
            app.processEvents()
        QTimer.singleShot(0, lambda: None)
        app.processEvents()
        path = OUT / f"experiments-{name}-{w}x{h}.png"
        panel.grab().save(str(path))
        print(path)
    panel.plots.setCurrentIndex(panel.plots.count() - 1)
    panel.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
