"""Render every screen of the studio into docs/screenshots/NAME-WxH.png (a real xcb window),
at each window size asked for (default 1024x700 and 1600x1000).

    QT_QPA_PLATFORM=xcb xvfb-run -a -s "-screen 0 1600x1000x24" python scripts/screenshots.py [--no-demo]

With the demo (default) it starts the local demo cluster, profiles it, auto-solves (adopting
a strategy of three or more stages from Compare only where the solved plan has fewer) and
runs a real generation before taking the Run, Sessions and Cluster-with-plan shots, exactly
as a user would through the GUI's own actions. The demo model is the one cached in the data
folder (train it first by running ``edgeshard studio --demo`` once). PNGs are saved small
(scripts/small_png.py). ``--no-demo`` uses a synthetic scenario instead (no agents; the Run screen stays
empty). The Experiments screen after a run is scripts/screenshot_experiments.py's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from small_png import save_png  # noqa: E402  (scripts/, beside this file)

OUT = ROOT / "docs" / "screenshots"
OUT_FOLDER = [OUT]
"""Where the PNGs go (--out)."""
DEMO_RUN_PROMPTS = ("The secret of life is", "You will", "Life is", "A wise man once said")
"""The demo's two prompts and two more openings of the quotations the demo model was trained on ("Life is"
opens 31 of them), so the shot shows what it writes."""


def wait(app, seconds: float, until=None) -> bool:
    """Pump the events (this script runs no event loop) for ``seconds`` or until ``until()``."""
    from PySide6.QtCore import QEvent

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        app.processEvents()
        # widgets a screen replaced with deleteLater (the run monitor's utilisation rows) go only
        # when an event loop deletes them: without this their old rows stayed drawn under the new
        app.sendPostedEvents(None, QEvent.Type.DeferredDelete)
        if until is not None and until():
            return True
        time.sleep(0.02)
    return until is None


SIZES: list[tuple[int, int]] = []
"""Window sizes every shot is taken at (set from --sizes)."""


def shoot(app, window, name: str) -> None:
    """``name`` at every size: the window resized, laid out, grabbed."""
    for width, height in SIZES:
        window.resize(width, height)
        wait(app, 0.8)
        grab(app, window, f"{name}-{width}x{height}")


def grab(app, window, name: str) -> Path:
    wait(app, 0.4)
    window.repaint()
    app.processEvents()
    screen = window.screen()
    pix = screen.grabWindow(window.winId()) if os.environ.get("QT_QPA_PLATFORM") == "xcb" else window.grab()
    if pix.isNull() or pix.width() < 10:
        pix = window.grab()
    path = save_png(pix, OUT_FOLDER[0] / f"{name}.png")
    print(f"wrote {path} ({pix.width()}x{pix.height()})")
    return path


def synthetic_problem():
    from core.planning.scenarios import DeviceSpec, synthetic_problem

    devices = [
        DeviceSpec(id="jetson-nx", name="Jetson Orin NX", tflops=12, memory_bandwidth_gb_s=102.4, memory_gib=6),
        DeviceSpec(id="jetson-agx", name="Jetson AGX Orin", tflops=27, memory_bandwidth_gb_s=204.8, memory_gib=12),
        DeviceSpec(id="laptop", name="Laptop", tflops=8, memory_bandwidth_gb_s=60, memory_gib=8),
        DeviceSpec(id="server", name="RTX 3090 server", tflops=71, memory_bandwidth_gb_s=936, memory_gib=20),
    ]
    from core.planning.scenarios import full_mesh

    links = full_mesh([d.id for d in devices], 200.0, 2.0, overrides={
        ("jetson-nx", "server"): (50.0, 10.0), ("server", "jetson-nx"): (50.0, 10.0),
        ("laptop", "server"): (100.0, 5.0), ("server", "laptop"): (100.0, 5.0),
        ("jetson-nx", "jetson-agx"): (1000.0, 0.5), ("jetson-agx", "jetson-nx"): (1000.0, 0.5),
    })
    return synthetic_problem(devices, "llama-2-13b", links=links)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-demo", action="store_true", help="use a synthetic scenario, start no agents")
    ap.add_argument("--theme", choices=["light", "dark", "both"], default="both")
    ap.add_argument("--sizes", default="1024x700,1600x1000", help="window sizes, WxH,WxH")
    ap.add_argument("--out", default=str(OUT), help="folder for the PNGs (default docs/screenshots)")
    args = ap.parse_args()
    OUT_FOLDER[0] = Path(args.out)
    try:
        SIZES[:] = [tuple(int(v) for v in size.split("x")) for size in args.sizes.split(",")]
    except ValueError:
        ap.error(f"--sizes: expected WxH,WxH (e.g. 1024x700,1600x1000), got {args.sizes!r}")
    OUT_FOLDER[0].mkdir(parents=True, exist_ok=True)

    from gui import app as studio_app
    from gui.main_window import MainWindow

    app = studio_app.create_app(["screenshots"])
    studio_app.settings().clear()
    studio_app.apply_theme(app, "light")
    window = MainWindow()
    window.resize(*SIZES[-1])
    window.show()
    wait(app, 1.0)

    demo = None
    if not args.no_demo:
        from gui.demo import DemoSession

        workspace = tempfile.mkdtemp(prefix="edgeshard-shots-")
        demo = DemoSession(window.state, window=window, workspace=os.path.join(workspace, "demo.edgeshard"))
        demo.start()
        if not wait(app, 120, demo.is_ready):
            print("demo did not become ready: " + demo.describe(), file=sys.stderr)
    else:
        problem = synthetic_problem()
        window.state.set_profile(problem.profile, source=problem.source, workload=problem.workload)
        window.state.set_workspace(str(ROOT / "demo.edgeshard"))
        window.state.set_connection("synthetic scenario (no agents)")
    try:
        plan = window.screens.plan.view  # the layer-sharding plan editor
        window.show_screen(window.screens.devices)
        shoot(app, window, "devices")
        if demo is not None and demo.error == "":
            profile = window.screens.profile
            window.show_screen(window.screens.profile)
            profile.start_profiling()
            wait(app, 1.5)
            grab(app, window, f"profile-running-{SIZES[-1][0]}x{SIZES[-1][1]}")
            # until this profiling ends: a profile kept from an earlier launch is set already, and one
            # landing after Auto-solve made the plan and the comparison stale in the pictures
            if not wait(app, 300, lambda: not profile.runner.is_busy() and window.state.profile is not None):
                print("profiling did not finish: " + profile.error.text(), file=sys.stderr)
        for name, screen in (("cluster", window.screens.cluster), ("profile", window.screens.profile),
                             ("experiments", window.screens.experiments)):
            window.show_screen(screen)
            shoot(app, window, name)
        window.show_screen(window.screens.plan)
        plan.auto_solve()
        wait(app, 60, lambda: not plan._solve_runner.is_busy())
        shoot(app, window, "plan")
        plan.compare()
        wait(app, 60, lambda: not plan._solve_runner.is_busy())
        # the run shows a real pipeline: the auto-solved plan (the demo's devices need all three), or
        # else (the synthetic scenario) a strategy of three or more stages adopted from Compare
        multi = [i for i, r in enumerate(plan.comparison) if r.plan is not None and r.status in ("optimal", "ok") and len(r.plan.stages) > 2]
        if multi and len(window.state.plan.stages) < 3:
            plan.adopt(multi[0])
        shoot(app, window, "plan-compare")
        print("plan: " + " | ".join(f"{st.device} units {st.start}-{st.end - 1}" for st in window.state.plan.stages))
        if demo is not None and demo.error == "":
            run = window.screens.run
            run.mode_combo.setCurrentText("no-bubbles")
            run.micro_batches_spin.setValue(2)
            demo.run_once(window, prompts=DEMO_RUN_PROMPTS, max_new_tokens=16)
            window.show_screen(window.screens.run)
            wait(app, 240, demo.run_finished)
            wait(app, 1.0)
            shoot(app, window, "run")
            print("text: " + window.screens.run.monitor.text_edit.toPlainText().replace("\n", " / ")[:400])
            cluster = window.screens.cluster
            cluster.plan_check.setChecked(True)  # the plan on the topology, with the run's measured traffic
            window.show_screen(cluster)
            shoot(app, window, "cluster-plan")
            sessions = window.screens.sessions
            window.show_screen(window.screens.sessions)
            wait(app, 1.0)
            items = sessions.run_items()
            if items:
                sessions.open_run(max(items))
                wait(app, 20, lambda: sessions.replay is not None and sessions.loaded is not None)
                sessions.pause()
                if sessions.replay is not None:
                    sessions.seek(sessions.replay.duration_s if hasattr(sessions.replay, "duration_s") else 1e6)
                wait(app, 0.5)
            shoot(app, window, "sessions")
        window.resize(*SIZES[-1])
        if args.theme in ("dark", "both"):
            window.dark_action.setChecked(True)
            window._on_dark_toggled(True)
            for name, screen in (("plan", window.screens.plan), ("cluster", window.screens.cluster),
                                 ("run", window.screens.run)):
                window.show_screen(screen)
                grab(app, window, f"{name}-dark-{SIZES[-1][0]}x{SIZES[-1][1]}")
    finally:
        window.close()
        if demo is not None:
            demo.stop()
            shutil.rmtree(workspace, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
