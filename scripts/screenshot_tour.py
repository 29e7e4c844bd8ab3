"""Render the demo tour's spatial, attention-offloading, expert-offloading and EPD plan and run into
docs/screenshots (a real xcb window), at 1024x700 and 1600x1000:

    QT_QPA_PLATFORM=xcb xvfb-run -a -s "-screen 0 1600x1000x24" python scripts/screenshot_tour.py

It starts the demo (its shipped models), profiles the cluster and its CNN fits through the Profile
screen, then on the Plan screen: spatial partitioning planned on the measured cluster (*even*: strips
on all three agents) and run on the shipped digits (``tour-spatial-plan``, ``tour-spatial-run``, and at
1024x700 scrolled to its time axis: ``tour-spatial-run-scrolled``);
attention offloading planned on the measured cluster (``tour-attention-plan``) and run from the
studio (``tour-attention-run``: the Run screen); expert offloading profiled on the agents for the
demo's MoE and planned on them (``tour-expert-plan``), run from the Run screen with its storage lane
and heat map (``tour-expert-run``); EPD's phases measured on every agent and the search's
pick (``tour-epd-plan``), served on the agents (``tour-epd-run``: the Run tab, each device's phases
predicted beside measured) and replayed in Sessions with its requests (``tour-epd-sessions``). Prints
each run's output.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import screenshots  # noqa: E402  (scripts/: its wait, grab and sizes)

PROMPTS = ("The secret of life is", "You will", "Love is")


def main() -> int:
    from gui import app as studio_app
    from gui.demo import DemoSession
    from gui.main_window import MainWindow

    screenshots.SIZES[:] = [(1024, 700), (1600, 1000)]
    wait, shoot = screenshots.wait, screenshots.shoot
    app = studio_app.create_app(["screenshots"])
    studio_app.settings().clear()
    studio_app.apply_theme(app, "light")
    window = MainWindow()
    window.resize(1600, 1000)
    window.show()
    workspace = tempfile.mkdtemp(prefix="edgeshard-tour-")
    demo = DemoSession(window.state, window=window, workspace=os.path.join(workspace, "demo.edgeshard"), train=False)
    demo.start()
    try:
        if not wait(app, 180, demo.is_ready) or demo.error:
            print("demo did not become ready: " + demo.describe(), file=sys.stderr)
            return 1
        profile = window.screens.profile
        window.show_screen(profile)
        if window.state.profile is None:
            profile.start_profiling()
            wait(app, 1.0)
        wait(app, 300, lambda: not profile.runner.is_busy() and window.state.profile is not None)
        profile.conv_sweep = dict(sizes=(8, 16, 32), channels=(8, 16), repeats=2)
        profile.start_conv_profiling()
        wait(app, 1.0)
        wait(app, 300, lambda: not profile.runner.is_busy() and window.state.spatial_fits is not None)
        plan_screen = window.screens.plan
        window.show_screen(plan_screen)
        plan_screen.set_technique("spatial")
        spatial = plan_screen.view
        spatial.strategy.setCurrentText("even")
        wait(app, 60, lambda: not spatial.solver.is_busy())  # solved on its worker
        wait(app, 0.5)
        print("spatial:", spatial.summary.text())
        shoot(app, window, "tour-spatial-plan")
        spatial.run_button.click()
        wait(app, 240, lambda: not spatial.runner.is_busy())
        wait(app, 1.0)
        t = spatial.image_table
        print("spatial run:", spatial.run_status.text(), [(t.item(r, 0).text(), t.item(r, 2).text())
                                                          for r in range(t.rowCount())])
        shoot(app, window, "tour-spatial-run")
        window.resize(1024, 700)  # there the page scrolls: at its bottom, the run's lanes and time axis whole
        wait(app, 1.0)
        page = window.stack.currentWidget().verticalScrollBar()
        page.setValue(page.maximum())
        screenshots.grab(app, window, "tour-spatial-run-scrolled-1024x700")
        page.setValue(0)
        plan_screen.set_technique("attention-offload")
        offload = plan_screen.view
        offload.auto_solve()
        wait(app, 0.5)
        print("attention:", offload.summary.text(), "|", offload.run_where.text())
        shoot(app, window, "tour-attention-plan")
        run = window.screens.run
        run.prompts_edit.setPlainText("\n".join(PROMPTS))
        run.max_tokens_spin.setValue(16)
        done = []
        run.run_finished.connect(done.append)
        offload.run_button.click()
        wait(app, 300, lambda: bool(done))
        wait(app, 1.0)
        print("attention run:", done, run.monitor.text_edit.toPlainText().replace("\n", " / ")[:400])
        window.show_screen(run)
        shoot(app, window, "tour-attention-run")
        tour_expert_offload(app, window)
        tour_epd(app, window)
    finally:
        window.close()
        demo.stop()
        shutil.rmtree(workspace, ignore_errors=True)
    return 0


def tour_expert_offload(app, window) -> None:
    """Expert offloading on the demo's agents: profiled for the MoE, planned, run from the Run screen."""
    wait, shoot = screenshots.wait, screenshots.shoot
    plan_screen = window.screens.plan
    window.show_screen(plan_screen)
    plan_screen.set_technique("expert-offload")
    view = plan_screen.view
    if view.measured_blocker():  # the demo's profile is of its Llama: the agents are profiled for the MoE
        view.profile_button.click()
        wait(app, 1.0)
        wait(app, 300, lambda: not view.runner.is_busy())
    view.auto_solve()
    view.compare()  # EdgeMoE beside its baselines, each strategy's bar
    wait(app, 1.0)
    print("expert offloading:", view.subtitle.text())
    shoot(app, window, "tour-expert-plan")
    if not view.use_for_run.isEnabled():
        print("expert offloading: not runnable:", view.use_for_run.toolTip(), file=sys.stderr)
        return
    view.use_for_run.click()
    run = window.screens.run
    run.prompts_edit.setPlainText("\n".join(PROMPTS))
    run.max_tokens_spin.setValue(16)
    done = []
    run.run_finished.connect(done.append)
    run.start_run()
    wait(app, 300, lambda: bool(done))
    wait(app, 1.0)
    print("expert run:", done, run.monitor.text_edit.toPlainText().replace("\n", " / ")[:400])
    window.show_screen(run)
    shoot(app, window, "tour-expert-run")


def tour_epd(app, window) -> None:
    """EPD on the demo's agents: measured, searched, the pick served, then replayed in Sessions."""
    from PySide6.QtCore import QPoint

    from gui.techniques.phase_disaggregation.agent_run import MEASURED

    wait, shoot = screenshots.wait, screenshots.shoot
    plan_screen = window.screens.plan
    window.show_screen(plan_screen)
    plan_screen.set_technique("phase-disaggregation")
    epd = plan_screen.view
    epd.requests.setValue(6)
    epd.source.setCurrentText(MEASURED)
    epd.measure_on_agents()  # every phase on every agent (the operator's button: never by itself)
    wait(app, 1.0)
    wait(app, 300, lambda: not epd.runner.is_busy())
    epd.trials.setValue(20)
    epd.auto_solve()
    wait(app, 1.0)
    wait(app, 300, lambda: not epd.runner.is_busy())
    epd.tabs.setCurrentWidget(epd.table)
    print("epd:", epd.status.text())
    shoot(app, window, "tour-epd-plan")
    epd.table.setCurrentCell(0, 0)
    epd.run_button.click()
    wait(app, 1.0)
    wait(app, 300, lambda: not epd.runner.is_busy())
    print("epd run:", epd.status.text(), "|", epd.run_tab.answers.toPlainText().replace("\n", " / ")[:300])
    shoot(app, window, "tour-epd-run")
    run = epd.run_tab.last
    if run is not None and run.run_id is not None:
        sessions = window.screens.sessions
        window.show_screen(sessions)
        wait(app, 1.0)
        sessions.open_run(run.run_id)
        wait(app, 20, lambda: sessions.loaded is not None and sessions.loaded.info.id == run.run_id)
        sessions.set_speed(20.0)
        sessions.play()
        wait(app, 30, lambda: not sessions._replay_active())
        for width, height in screenshots.SIZES:  # the side column scrolled to the run's requests
            window.resize(width, height)
            wait(app, 0.8)
            monitor = sessions.monitor  # the "Requests (EPD)" heading at the top of the side column
            top = monitor.requests_label.mapTo(monitor.side_scroll.widget(), QPoint(0, 0)).y()
            monitor.side_scroll.verticalScrollBar().setValue(top)
            wait(app, 0.3)
            screenshots.grab(app, window, f"tour-epd-sessions-{width}x{height}")


if __name__ == "__main__":
    sys.exit(main())
