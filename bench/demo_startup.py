"""The demo's speed as an operator feels it; prints one JSON line.

Each launch is a fresh process (``python bench/demo_startup.py --child``) that does what
``edgeshard studio --demo`` does — parses its command line as ``edgeshard`` does, then
``gui.launch.open_demo_window`` (agents' zygote first, then the QApplication and the main
window) — under the offscreen platform (``--platform xcb`` with a ``DISPLAY``: a real X
server, e.g. Xvfb), and reports, from the moment its parent spawned it:

- ``window_s``: until the window is shown and painted (usable: the planning screens work,
  the Devices screen lists the demo's agents as starting);
- ``ready_s``: until the demo is ready (agents up and attached: Profile and Run work);
- ``startup``: where that time went — ``phases`` (seconds since the spawn of each step, in
  order: the interpreter, the command line parsed, ``gui.demo_cluster.STARTUP_PHASES``, the window
  built and shown, ready), the zygote's report (its import times and CPU, whether it imported
  the model code), the studio process's CPU at ready, whether it imported torch, and whether
  a profile kept from the previous launch was offered (``profile_kept``);
- ``profile_s``: clicking Profile on the Profile screen until the profile is set (then
  Auto-solve; ``plan`` is the solved plan's stages);
- with ``--run``, before that, a presenter's first text: at ready, Profile (only when no profile was
  kept), Auto-solve and Start of the demo prompts at once; ``run.first_text_s`` is from the spawn
  until the Run screen shows the first generated text (``run.text`` its start), ``run.studio_cpu_s``
  / ``run.agents_cpu_s`` the CPU seconds the studio / the agents had used when the run ended and
  ``run.studio_imported_torch`` whether the studio had imported torch by then;
- ``quit_s``: closing the window and stopping the demo until every agent process is gone;
  ``exit_s``: closing the window until the studio's process is gone (it ends as the studio
  does, ``gui.launch.exit_without_teardown``), and ``agents_left_after_exit``;
- ``agents_cpu_at_ready_s`` / ``agents_cpu_at_quit_s``: CPU seconds the agents (and their
  zygote) had used when the demo was ready / before quitting (a figure the shared machine's
  load changes less than the wall times); ``load``: the 1-minute load average at the end.

Launch 1 runs with empty data folders (a fresh HOME: the trained models shipped in the
repository, no profile kept), launch 2 with what the first left (the operator's second launch:
the profile launch 1 measured). Both use temporary XDG folders, never the real HOME, and do not
train (``train=False``) unless ``--train`` says so (then with a model folder of their own: the
untrained checkpoint is made and trained, as without the shipped models).

With ``--train`` the first launch also trains the demo model in the background, as an
operator's first launch does (the training competes with profiling for the cores; the
second launch still starts untrained, the first one having been stopped before training ended).

Side by side in one run, alternating so a change of load hits each alike, for ``--rounds N``
rounds, with each figure's median: ``--launchers zygote,popen`` (``popen``: one interpreter
per agent, as before the zygote) and/or ``--trees NAME=DIR,NAME=DIR`` (the studio's code from
each checkout, e.g. before and after a change). ``--no-profile`` skips profiling and solving;
``--run`` runs the demo prompts after solving (quit then follows a run); ``--trace-quit``
dumps every thread's stack each 0.25 s while quitting (``quit_stacks``).

Usage: python bench/demo_startup.py [--train] [--first-only] [--launchers zygote,popen]
       [--trees a=DIR,b=DIR] [--rounds N] [--no-profile] [--run] [--trace-quit] [--platform xcb]
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
    marks = {"interpreter_up": time.time()}
    import inspect

    from core.cli import build_parser

    # what `edgeshard studio --demo` does before the studio's own code: parse its command line
    (build_parser("studio") if inspect.signature(build_parser).parameters else build_parser()
     ).parse_args(["studio", "--demo"])
    marks["cli_parsed"] = time.time()
    import gui.launch

    # the user's data folders are the launch's temporary XDG ones: without a model_root the demo uses the
    # trained models shipped in the repository, as an operator's first launch does; --train: a model
    # root of its own, whose model is made and trained (what a checkout without the shipped models does)
    options = dict(workspace=os.path.join(root, "demo.edgeshard"), train=train,
                   **({"model_root": os.path.join(root, "models")} if train else {}))
    window, demo = gui.launch.open_demo_window(**options)
    demo.ready.connect(lambda: marks.setdefault("ready", time.time()))  # it may come before the wait below
    marks["window_built"] = time.time()
    from PySide6.QtCore import QEventLoop, QTimer
    from PySide6.QtGui import QAction

    def wait(signal, timeout_s: float) -> None:
        loop = QEventLoop()
        signal.connect(loop.quit)
        QTimer.singleShot(int(timeout_s * 1000), loop.quit)
        loop.exec()

    from PySide6.QtWidgets import QApplication

    app = QApplication.instance()
    window.show()
    app.processEvents()  # the first paint: the window is on screen and answers input from here on
    marks["window_shown"] = time.time()
    shown = marks["window_shown"] - t_spawn
    if "ready" not in marks:
        wait(demo.ready, 120)
    ready = marks["ready"] - t_spawn if "ready" in marks else None
    cpu_at_ready = _cpu_s(_agent_pids(demo.parts.cluster))
    try:
        from gui.demo_cluster import startup_breakdown
    except ImportError:  # an older tree (--trees): in gui.demo, or no breakdown at all
        import gui.demo

        startup_breakdown = getattr(gui.demo, "startup_breakdown", None)

    zygote = demo.parts.cluster._zygote
    phases = {k: round(v - t_spawn, 2) for k, v in marks.items()}
    if startup_breakdown is not None:
        phases.update(startup_breakdown(demo.parts.phases, t_spawn))
    startup = {"phases": dict(sorted(phases.items(), key=lambda kv: kv[1])),
               "profile_kept": window.state.profile is not None,
               "zygote": getattr(zygote, "report", None),
               "studio_cpu_at_ready_s": round(time.process_time(), 2),
               "studio_imported_torch": "torch" in sys.modules}
    log: list[str] = []
    window.state.log_added.connect(lambda level, text: log.append(f"{time.time() - t_spawn:.2f} {level}: {text}"))
    for name, runner in (("run", window.screens.run.runner), ("profile", window.screens.profile.runner)):
        runner.status_reported.connect(lambda _t, text, name=name: log.append(f"{time.time() - t_spawn:.2f} {name}: {text}"))
    failed: list[str] = []
    profile_s, stages = None, []
    run_s = None
    if "--run" in sys.argv:  # a presenter's first text: Profile (unless kept), Auto-solve, Start, at once
        if window.state.profile is None:
            profile_s, stages = _profile_and_solve(window, failed)
            profile = False
        else:
            stages = _solve(window)
        marks["solved"] = time.time()
        text_edit = window.screens.run.monitor.text_edit
        text_edit.textChanged.connect(lambda: text_edit.toPlainText().strip() and marks.setdefault("first_text",
                                                                                                   time.time()))
        t_run = time.time()
        run_done = QEventLoop()
        window.screens.run.run_finished.connect(lambda *_: run_done.quit())
        QTimer.singleShot(300_000, run_done.quit)
        if window.state.plan is not None and demo.run_once(window, max_new_tokens=8):
            run_done.exec()
        run_s = {"s": round(time.time() - t_run, 2), "outcome": window.screens.run.last_outcome,
                 "first_text_s": round(marks["first_text"] - t_spawn, 2) if "first_text" in marks else None,
                 "solved_s": round(marks["solved"] - t_spawn, 2),
                 "text": text_edit.toPlainText()[:120], "message": window.screens.run.status_label.text()[:200],
                 "studio_cpu_s": round(time.process_time(), 2), "agents_cpu_s": _cpu_s(_agent_pids(demo.parts.cluster)),
                 "studio_imported_torch": "torch" in sys.modules}
    if profile:
        profile_s, stages = _profile_and_solve(window, failed)
    cluster = demo.parts.cluster
    pids = _agent_pids(cluster)
    cpu_at_quit = _cpu_s(pids)
    launched = cluster.launch_note
    during = _option("--quit-during", "")
    if during == "profile":  # quit while the agents are being profiled
        window.screens.profile.profile_button.click()
        wait(window.state.profile_changed, 1.5)
    elif during == "run" and window.state.plan is not None:  # quit while a run is generating
        demo.run_once(window, max_new_tokens=64)
        wait(window.screens.run.run_finished, 1.5)
    training = demo.trainer.is_busy()
    if "--trace-quit" in sys.argv:  # where quitting waits: every thread's stack each 0.25 s, to stderr
        import faulthandler

        t_trace = time.time()
        tick = QTimer()  # a time stamp before each dump (the GUI thread's, so only while it is free)
        tick.timeout.connect(lambda: print(f"-- t+{time.time() - t_trace:.2f}s", file=sys.stderr, flush=True))
        tick.start(250)
        faulthandler.dump_traceback_later(0.25, repeat=True)
    t0 = time.time()
    # as the operator quits (File > Quit, Ctrl+Q): the window closes, the last window closed ends
    # the event loop (aboutToQuit: the screens' shutdowns), then what `edgeshard studio` does after it
    QTimer.singleShot(0, next(a for a in window.findChildren(QAction) if a.text() == "Quit").trigger)
    app.exec()
    t_loop = time.time() - t0
    demo.stop()
    quit_s = time.time() - t0
    alive = [p for p in pids if _alive(p)]
    print(json.dumps({"window_s": round(shown, 2), "ready_s": None if ready is None else round(ready, 2),
                      "profile_s": None if profile_s is None else round(profile_s, 2), "quit_s": round(quit_s, 2),
                      "agents_left": len(alive), "event_loop_ended_s": round(t_loop, 2),
                      "quit_during": during or ("training" if training else None), "agents_cpu_at_ready_s": cpu_at_ready,
                      "agents_cpu_at_quit_s": cpu_at_quit, "plan": stages, "launched": launched,
                      "startup": startup, "load": open("/proc/loadavg").read().split()[0], "run": run_s,
                      "closed_at": t0, "pids": pids, **({"log": log} if "--log" in sys.argv else {}),
                      **({"profile_error": failed[0], "log_tail": log[-8:]}
                         if failed or ((profile or run_s) and window.state.profile is None) else {})}), flush=True)
    gui.launch.exit_without_teardown(0)  # as the studio ends: the parent times it until this process is gone


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


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
    return profile_s, _solve(window)


def _solve(window) -> list[str]:
    """Plan ▸ Auto-solve, waited for; the plan's stages."""
    from PySide6.QtCore import QEventLoop, QTimer

    plan_editor = window.screens.plan.view
    loop = QEventLoop()
    plan_editor._solve_runner.task_finished.connect(loop.quit)
    QTimer.singleShot(120_000, loop.quit)
    plan_editor.solve_button.click()
    loop.exec()
    plan = window.state.plan
    return [f"{s.device}[{s.start},{s.end})" for s in plan.stages] if plan else []


def _option(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def _launches(launcher: str | None, tree: str | None = None) -> dict:
    """One operator's first and second launch, in a fresh data folder; ``tree``: the studio's
    code from that checkout (PYTHONPATH), to compare two versions in one run."""
    out = {}
    env = dict(os.environ)
    # the studio's code from ``tree``, else from this checkout: a script's path starts at bench/, so the
    # child would otherwise import the installed copy (an editable install of another checkout)
    env["PYTHONPATH"] = os.pathsep.join([tree or os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                         *filter(None, [os.environ.get("PYTHONPATH")])])
    env["QT_QPA_PLATFORM"] = _option("--platform", env.get("QT_QPA_PLATFORM") or "offscreen")
    if launcher:
        from agents.zygote import LAUNCHER_ENV

        env[LAUNCHER_ENV] = launcher
    flags = [f for f in ("--no-profile", "--trace-quit", "--run", "--log") if f in sys.argv]
    if "--quit-during" in sys.argv:
        flags += ["--quit-during", _option("--quit-during", "")]
    with tempfile.TemporaryDirectory(prefix="demo-bench-") as root:
        env.pop("EDGESHARD_WORKSPACE", None)
        for name in ("CONFIG", "DATA", "CACHE"):  # settings, data and caches never the real HOME's
            env[f"XDG_{name}_HOME"] = os.path.join(root, name.lower())
        for launch in ("first",) if "--first-only" in sys.argv else ("first", "second"):
            train = ["--train"] if launch == "first" and "--train" in sys.argv else []
            proc = subprocess.run([sys.executable, __file__, "--child", repr(time.time()), root, *train, *flags],
                                  capture_output=True, text=True, timeout=900, env=env)
            ended = time.time()
            line = [x for x in proc.stdout.splitlines() if x.startswith("{")]
            out[launch] = got = json.loads(line[-1]) if line else {"error": proc.stderr[-800:]}
            if line:  # closing the window until the studio's process was gone, and what it left running
                got["exit_s"] = round(ended - got.pop("closed_at"), 2)
                got["agents_left_after_exit"] = sum(_alive(p) for p in got.pop("pids"))
            if "--trace-quit" in sys.argv:
                got["quit_stacks"] = proc.stderr[-12000:]
    return out


def _medians(runs: list[dict]) -> dict:
    out = {}
    for launch in runs[0]:
        got = [r[launch] for r in runs if "error" not in r[launch]]
        out[launch] = {k: statistics.median(g[k] for g in got)
                       for k in ("window_s", "ready_s", "profile_s", "quit_s", "exit_s", "agents_cpu_at_ready_s",
                                 "agents_cpu_at_quit_s")
                       if got and all(g.get(k) is not None for g in got)}
        texts = [g["run"]["first_text_s"] for g in got if (g.get("run") or {}).get("first_text_s") is not None]
        if texts:
            out[launch]["first_text_s"] = statistics.median(texts)
        out[launch]["agents_left_max"] = max((g["agents_left"] for g in got), default=None)
    return out


def main() -> None:
    if "--child" in sys.argv:
        child(float(sys.argv[sys.argv.index("--child") + 1]), sys.argv[sys.argv.index("--child") + 2],
              train="--train" in sys.argv, profile="--no-profile" not in sys.argv)
        return
    out = {"load_before": open("/proc/loadavg").read().split()[:3]}
    launchers = _option("--launchers", "").split(",") if "--launchers" in sys.argv else [None]
    trees = dict(t.split("=", 1) for t in _option("--trees", "").split(",")) if "--trees" in sys.argv else {None: None}
    variants = [(launcher, tree) for tree in trees for launcher in launchers]
    label = lambda launcher, tree: "/".join(str(x) for x in (tree, launcher) if x) or "default"  # noqa: E731
    rounds = int(_option("--rounds", "1"))
    runs: dict[str, list] = {label(*v): [] for v in variants}
    for _ in range(rounds):
        for launcher, tree in variants:  # alternating, so a change of load hits each variant alike
            runs[label(launcher, tree)].append(_launches(launcher, trees[tree]))
    if rounds == 1 and list(runs) == ["default"]:
        out.update(runs["default"][0])
    else:
        out["runs"] = runs
        out["median"] = {name: _medians(r) for name, r in runs.items()}
    out["load_after"] = open("/proc/loadavg").read().split()[:3]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
