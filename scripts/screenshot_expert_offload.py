"""Screenshots of the expert-offloading plan view (docs/screenshots/expert-offload-*.png).

QT_QPA_PLATFORM=xcb xvfb-run -a -s "-screen 0 1600x1000x24" python scripts/screenshot_expert_offload.py
"""

from __future__ import annotations

from pathlib import Path

from gui import app as studio_app
from gui.screens.plan import PlanScreen
from gui.studio_state import StudioState

OUT = Path(__file__).resolve().parent.parent / "docs" / "screenshots"


def main() -> int:
    app = studio_app.create_app()
    screen = PlanScreen(StudioState())
    screen.set_technique("expert-offload")
    view = screen.view
    screen.show()
    for w, h, budget in ((1024, 700, 10), (1600, 1000, 15)):
        view.budget.setValue(budget)
        view.auto_solve()
        view.compare()
        screen.resize(w, h)
        for _ in range(5):
            app.processEvents()
        path = OUT / f"expert-offload-{w}x{h}.png"
        screen.grab().save(str(path))
        print(path)
    screen.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
