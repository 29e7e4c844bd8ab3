"""Screenshots of the spatial plan view (docs/screenshots/spatial-*.png): the Plan screen with
the Spatial technique chosen, a per-layer CBPS plan and a fused plan after Compare, and a live
*Run on agents* on three local agents (a small VGG16: 64×64 images, channels / 4).

QT_QPA_PLATFORM=xcb xvfb-run -a -s "-screen 0 1600x1000x24" python scripts/screenshot_spatial.py
"""

from __future__ import annotations

from pathlib import Path

from gui import app as studio_app
from gui.screens.plan import PlanScreen
from gui.studio_state import StudioState

OUT = Path(__file__).resolve().parent.parent / "docs" / "screenshots"


def settle(app, view) -> None:
    """Until the view's solves and Compare (its workers) have landed, then a few layout passes."""
    import time

    while view.solver.is_busy() or view.comparer.is_busy():
        app.processEvents()
        time.sleep(0.02)
    for _ in range(5):
        app.processEvents()


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
        settle(app, view)
        path = OUT / f"spatial-{tag}-{w}x{h}.png"
        screen.grab().save(str(path))
        print(path)
    view.network.setCurrentText("resnet-style")
    view.use_scenario()
    view.strategy.setCurrentText("fused")
    screen.resize(1600, 1000)
    settle(app, view)
    path = OUT / "spatial-resnet-fused-1600x1000.png"
    screen.grab().save(str(path))
    print(path)
    live_run(app, screen, view)
    screen.shutdown()
    return 0


def live_run(app, screen, view) -> None:
    import tempfile
    import time

    from msgspec import structs

    from core.devices.local_cluster import LocalCluster
    from core.runs.coordinator import Coordinator
    from core.techniques.spatial.problem import CnnRef
    from core.techniques.spatial.scenarios import paper_shaped

    with tempfile.TemporaryDirectory() as tmp, LocalCluster(Path(tmp) / "cluster", 3) as lc:
        coordinator = Coordinator(lc.endpoints, lc.keys, request_timeout_s=30.0)
        coordinator.open()
        try:
            coordinator.wait_ready(30.0)
            view.state.set_workspace(str(Path(tmp) / "ws.sqlite"))
            view.state.set_agents(coordinator)
            view.network.setCurrentText("vgg16")
            view.set_problem(structs.replace(paper_shaped(3, 1000.0),
                                             model=CnnRef(network="vgg16", image=64, width_div=4, classes=10)))
            view.strategy.setCurrentText("even")
            settle(app, view)
            for w, h in ((1024, 700), (1600, 1000)):
                screen.resize(w, h)
                view.run_images.setValue(12)
                view.start_run()
                deadline = time.monotonic() + 120
                while view.runner.is_busy() and time.monotonic() < deadline:
                    app.processEvents()
                    time.sleep(0.02)
                for _ in range(5):
                    app.processEvents()
                path = OUT / f"spatial-run-{w}x{h}.png"
                screen.grab().save(str(path))
                print(path)
        finally:
            view.state.set_agents(None)
            coordinator.close()


if __name__ == "__main__":
    raise SystemExit(main())
