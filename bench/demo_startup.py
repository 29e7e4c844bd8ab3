"""The demo's speed as an operator feels it; prints one JSON line.

Each launch is a fresh process (``python bench/demo_startup.py --child``) that does what
``edgeshard studio --demo`` does — QApplication, main window, DemoSession — under the
offscreen platform, and reports, from the moment its parent spawned it:

- ``window_s``: until the window is shown and painted (usable: the planning screens work,
  the Devices screen lists the demo's agents as starting);
- ``ready_s``: until the demo is ready (agents up and attached: Profile and Run work);
- ``profile_s``: clicking Profile on the Profile screen until the profile is set;
- ``quit_s``: closing the window and stopping the demo until every agent process is gone;
- ``agents_cpu_at_ready_s`` / ``agents_cpu_at_quit_s``: CPU seconds the agents (and their
  zygote) had used when the demo was ready / before quitting (a figure the shared machine's
  load changes less than the wall times).

Launch 1 runs with an empty model cache (the untrained checkpoint is made), launch 2 with
the cache the first left (the operator's second launch). Both use a temporary data folder,
never the real HOME, and do not train (``train=False``) unless ``--train`` says so.
Also reports the demo's auto-solved plan (launch 2). Side by side, one run; say the load.

With ``--train`` the first launch also trains the demo model in the background, as an
operator's first launch does (the training competes with profiling for the cores; the
second launch still starts untrained, the first one having been stopped before training ended).

Agents are started as the cluster does by default (forked from one zygote that imported
torch once, core/devices/local_cluster.py); ``--launchers zygote,popen`` measures each way
(``popen``: one interpreter per agent, as before the zygote) side by side, alternating, for
``--rounds N`` rounds, and reports each figure's median per launcher and launch.
``--no-profile`` skips profiling and solving (quit then stops idle agents).

Usage: python bench/demo_startup.py [--train] [--first-only] [--launchers zygote,popen] [--rounds N] [--no-profile]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def child(t_spawn: float, root: str, train: bool = False, profile: bool = True) -> None:
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
    cpu_at_ready = _cpu_s(_agent_pids(demo.parts.cluster))
    log: list[str] = []
    window.state.log_added.connect(lambda level, text: log.append(f"{level}: {text}"))
    failed: list[str] = []
    profile_s, stages = None, []
    if profile:
        profile_s, stages = _profile_and_solve(window, failed)
    cluster = demo.parts.cluster
    pids = _agent_pids(cluster)
    cpu_at_quit = _cpu_s(pids)
    launched = cluster.launch_note
    t0 = time.time()
    window.close()
    demo.stop()
    app.processEvents()
    quit_s = time.time() - t0
    alive = [p for p in pids if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"]
    print(json.dumps({"window_s": round(shown, 2), "ready_s": round(ready, 2),
                      "profile_s": None if profile_s is None else round(profile_s, 2), "quit_s": round(quit_s, 2),
                      "agents_left": len(alive), "agents_cpu_at_ready_s": cpu_at_ready,
                      "agents_cpu_at_quit_s": cpu_at_quit, "plan": stages, "launched": launched,
                      **({"profile_error": failed[0], "log_tail": log[-8:]}
                         if profile and (failed or window.state.profile is None) else {})}), flush=True)


def _agent_pids(cluster) -> list[int]:
    """The agents' processes and the zygote that forked them (if any)."""
    zygote = getattr(cluster, "_zygote", None)
    return [p.popen.pid for p in cluster._procs] + ([zygote.pid] if zygote is not None else [])


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) these processes used so far: what starting them cost the cores."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return round(total / tick, 2)


def _profile_and_solve(window, failed: list[str]) -> tuple[float, list[str]]:
    from PySide6.QtCore import QEventLoop, QTimer

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
    loop = QEventLoop()
    plan_editor._solve_runner.task_finished.connect(loop.quit)
    QTimer.singleShot(120_000, loop.quit)
    plan_editor.solve_button.click()
    loop.exec()
    plan = window.state.plan
    return profile_s, [f"{s.device}[{s.start},{s.end})" for s in plan.stages] if plan else []


def _option(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def _launches(launcher: str | None) -> dict:
    """One operator's first and second launch, in a fresh data folder."""
    out = {}
    env = dict(os.environ)
    if launcher:
        from agents.zygote import LAUNCHER_ENV

        env[LAUNCHER_ENV] = launcher
    flags = [] if "--no-profile" not in sys.argv else ["--no-profile"]
    with tempfile.TemporaryDirectory(prefix="demo-bench-") as root:
        for launch in ("first",) if "--first-only" in sys.argv else ("first", "second"):
            train = ["--train"] if launch == "first" and "--train" in sys.argv else []
            proc = subprocess.run([sys.executable, __file__, "--child", repr(time.time()), root, *train, *flags],
                                  capture_output=True, text=True, timeout=900, env=env)
            line = [x for x in proc.stdout.splitlines() if x.startswith("{")]
            out[launch] = json.loads(line[-1]) if line else {"error": proc.stderr[-800:]}
    return out


def _medians(runs: list[dict]) -> dict:
    out = {}
    for launch in runs[0]:
        got = [r[launch] for r in runs if "error" not in r[launch]]
        out[launch] = {k: statistics.median(g[k] for g in got)
                       for k in ("window_s", "ready_s", "profile_s", "quit_s", "agents_cpu_at_ready_s",
                                 "agents_cpu_at_quit_s")
                       if got and all(g.get(k) is not None for g in got)}
        out[launch]["agents_left_max"] = max((g["agents_left"] for g in got), default=None)
    return out


def main() -> None:
    if "--child" in sys.argv:
        child(float(sys.argv[sys.argv.index("--child") + 1]), sys.argv[sys.argv.index("--child") + 2],
              train="--train" in sys.argv, profile="--no-profile" not in sys.argv)
        return
    out = {"load_before": open("/proc/loadavg").read().split()[:3]}
    launchers = _option("--launchers", "").split(",") if "--launchers" in sys.argv else [None]
    rounds = int(_option("--rounds", "1"))
    runs: dict[str, list] = {str(name or "default"): [] for name in launchers}
    for _ in range(rounds):
        for name in launchers:  # alternating, so a change of load hits each launcher alike
            runs[str(name or "default")].append(_launches(name))
    if rounds == 1 and launchers == [None]:
        out.update(runs["default"][0])
    else:
        out["runs"] = runs
        out["median"] = {name: _medians(r) for name, r in runs.items()}
    out["load_after"] = open("/proc/loadavg").read().split()[:3]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
