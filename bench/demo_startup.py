"""The demo's speed as an operator feels it; prints one JSON line.

Each launch is a fresh process (``python bench/demo_startup.py --child``) that does what
``edgeshard studio --demo`` does — QApplication, main window, DemoSession — under the
offscreen platform, and reports, from the moment its parent spawned it:

- ``window_s``: until the window is shown and painted (usable: the planning screens work,
  the Devices screen lists the demo's agents as starting);
- ``ready_s``: until the demo is ready (agents up and attached: Profile and Run work);
- ``profile_s``: clicking Profile on the Profile screen until the profile is set;
- ``quit_s``: closing the window and stopping the demo until every agent process is gone.

Launch 1 runs with an empty model cache (the untrained checkpoint is made), launch 2 with
the cache the first left (the operator's second launch). Both use a temporary data folder,
never the real HOME, and do not train (``train=False``) unless ``--train`` says so.
Also reports the demo's auto-solved plan (launch 2). Side by side, one run; say the load.

With ``--train`` the first launch also trains the demo model in the background, as an
operator's first launch does (the training competes with profiling for the cores; the
second launch still starts untrained, the first one having been stopped before training ended).

Usage: python bench/demo_startup.py [--train] [--first-only]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


def child(t_spawn: float, root: str, train: bool = False) -> None:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import QEventLoop, QSettings, QTimer

    QSettings.setDefaultFormat(QSettings.IniFormat)
    QSettings.setPath(QSettings.IniFormat, QSettings.UserScope, os.path.join(root, "settings"))
    import inspect

    import gui.launch
    from gui.demo import DemoSession

    extra = {"train": train} if "train" in inspect.signature(DemoSession).parameters else {}  # older demos: no training
    options = dict(workspace=os.path.join(root, "demo.edgeshard"), model_root=os.path.join(root, "models"), **extra)
    if hasattr(gui.launch, "open_demo_window"):  # as `edgeshard studio --demo` opens it (agents started first)
        window, demo = gui.launch.open_demo_window(**options)
    else:
        from gui.app import create_app
        from gui.main_window import MainWindow

        create_app()
        window = MainWindow()
        demo = DemoSession(window.state, window=window, **options)
        demo.start()

    def wait(signal, timeout_s: float) -> None:
        loop = QEventLoop()
        signal.connect(loop.quit)
        QTimer.singleShot(int(timeout_s * 1000), loop.quit)
        loop.exec()

    from PySide6.QtWidgets import QApplication

    app = QApplication.instance()
    window.show()
    app.processEvents()  # the first paint: the window is on screen and answers input from here on
    shown = time.time() - t_spawn
    wait(demo.ready, 120)
    ready = time.time() - t_spawn
    log: list[str] = []
    window.state.log_added.connect(lambda level, text: log.append(f"{level}: {text}"))
    failed: list[str] = []
    profile_screen = window.screens.profile
    profile_screen.runner.task_failed.connect(lambda _t, message: failed.append(message))
    t0 = time.time()
    profile_screen.profile_button.click()
    loop = QEventLoop()
    window.state.profile_changed.connect(loop.quit)
    profile_screen.runner.task_failed.connect(loop.quit)  # a failure ends the wait and is reported, not timed out
    QTimer.singleShot(300_000, loop.quit)
    loop.exec()
    profile_s = time.time() - t0
    plan_editor = window.screens.plan.view
    plan_editor.solve_button.click()
    wait(plan_editor._solve_runner.task_finished, 120)
    plan = window.state.plan
    stages = [f"{s.device}[{s.start},{s.end})" for s in plan.stages] if plan else []
    pids = [p.popen.pid for p in demo.parts.cluster._procs]
    t0 = time.time()
    window.close()
    demo.stop()
    app.processEvents()
    quit_s = time.time() - t0
    alive = [p for p in pids if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"]
    print(json.dumps({"window_s": round(shown, 2), "ready_s": round(ready, 2), "profile_s": round(profile_s, 2), "quit_s": round(quit_s, 2),
                      "agents_left": len(alive), "plan": stages,
                      **({"profile_error": failed[0], "log_tail": log[-8:]} if failed or window.state.profile is None
                         else {})}), flush=True)


def main() -> None:
    if "--child" in sys.argv:
        child(float(sys.argv[sys.argv.index("--child") + 1]), sys.argv[sys.argv.index("--child") + 2],
              train="--train" in sys.argv)
        return
    out = {"load_before": open("/proc/loadavg").read().split()[:3]}
    with tempfile.TemporaryDirectory(prefix="demo-bench-") as root:
        for launch in ("first",) if "--first-only" in sys.argv else ("first", "second"):
            train = ["--train"] if launch == "first" and "--train" in sys.argv else []
            proc = subprocess.run([sys.executable, __file__, "--child", repr(time.time()), root, *train],
                                  capture_output=True, text=True, timeout=900)
            line = [x for x in proc.stdout.splitlines() if x.startswith("{")]
            out[launch] = json.loads(line[-1]) if line else {"error": proc.stderr[-800:]}
    out["load_after"] = open("/proc/loadavg").read().split()[:3]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
