"""Screenshots of the spatial plan view (docs/screenshots/spatial-*.png): the Plan screen with
the Spatial technique chosen, a per-layer CBPS plan and a fused plan after Compare.

QT_QPA_PLATFORM=xcb xvfb-run -a -s "-screen 0 1600x1000x24" python scripts/screenshot_spatial.py
"""

from __future__ import annotations

from pathlib import Path

from gui import app as studio_app
from gui.plan_views import PlanScreen
from gui.studio_state import StudioState

OUT = Path(__file__).resolve().parent.parent / "docs" / "screenshots"


def main() -> int:
    app = studio_app.create_app()
    screen = PlanScreen(StudioState())
    screen.set_technique("spatial")
    view = screen.view
    screen.show()
    shots = (("cbps", 1024, 700, 4, 1000.0, "cbps"), ("fused", 1600, 1000, 4, 50.0, "fused"))
    for strategy, w, h, nodes, mbps, tag in shots:
        view.nodes.setValue(nodes)
        view.bandwidth.setValue(mbps)
        view.use_scenario()
        view.strategy.setCurrentText(strategy)
        view.compare()
        screen.resize(w, h)
        for _ in range(5):
            app.processEvents()
        path = OUT / f"spatial-{tag}-{w}x{h}.png"
        screen.grab().save(str(path))
        print(path)
    view.network.setCurrentText("resnet-style")
    view.use_scenario()
    view.strategy.setCurrentText("fused")
    screen.resize(1600, 1000)
    for _ in range(5):
        app.processEvents()
    path = OUT / "spatial-resnet-fused-1600x1000.png"
    screen.grab().save(str(path))
    print(path)
    screen.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
