"""Screenshots of expert offloading and EPD planned from the measured cluster and run on it, in the
studio's main window (a real xcb window): docs/screenshots/{expert-offload,epd}-{plan,run}-WxH.png and
expert-offload-view-run-WxH.png (the plan run from the view's own *Run on agents*).

    QT_QPA_PLATFORM=xcb xvfb-run -a -s "-screen 0 1600x1000x24" python scripts/screenshot_moe_epd.py

It starts three local agents, attaches them to the window as the studio does, and drives the
views through their own buttons: expert offloading profiles the agents for a Mixtral, compares
the strategies, uses EdgeMoE's plan for the Run screen and runs it (storage lane and heat map);
EPD measures the phases on the agents, searches, and runs the pick on them. The models are the
demo's shipped ones when ``core.models.demo_models`` has them, else generated (random weights:
the text is not readable). Each is copied first (expert offloading writes its options beside it).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from screenshots import wait  # noqa: E402  (scripts/, beside this file: the studio's screenshots)
from small_png import save_png  # noqa: E402

OUT = ROOT / "docs" / "screenshots"
SIZES = ((1024, 700), (1600, 1000))
PROMPTS = ("The secret of life is", "A wise man once said", "Life is")


def shoot(app, window, name: str) -> None:
    for width, height in SIZES:
        window.resize(width, height)
        wait(app, 1.0)
        window.repaint()
        wait(app, 0.3)
        path = OUT / f"{name}-{width}x{height}.png"
        save_png(window.grab().toImage(), path)
        print(path, flush=True)


def models(tmp: Path, moe: str = "", llava: str = "") -> tuple[str, str]:
    """(Mixtral dir, Llava dir): the given ones, else the demo's shipped ones if there, else generated;
    copies either way."""
    if moe and llava:
        return (str(shutil.copytree(moe, tmp / Path(moe).name)), str(shutil.copytree(llava, tmp / Path(llava).name)))
    try:
        from core.models.demo_models import shipped

        moe, llava = shipped("moe"), shipped("llava")
        if (moe / "config.json").is_file() and (llava / "config.json").is_file():
            return str(shutil.copytree(moe, tmp / moe.name)), str(shutil.copytree(llava, tmp / llava.name))
    except ImportError:
        pass
    from core.models.checkpoints import ModelRecipe, make_model
    from core.models.multimodal import TINY_LLAVA, make_multimodal_model

    moe = make_model(ModelRecipe(family="mixtral", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=9,
                                 experts=8), tmp / "tiny-mixtral")
    return str(moe), str(make_multimodal_model(TINY_LLAVA, tmp / "tiny-llava"))


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--moe", default="", help="a Mixtral checkpoint (default: the demo's, else generated)")
    parser.add_argument("--llava", default="", help="a Llava checkpoint (default: the demo's, else generated)")
    args = parser.parse_args()
    from core.devices.local_cluster import LocalCluster
    from core.runs.coordinator import Coordinator
    from gui import app as studio_app
    from gui.connection.attach import attach
    from gui.main_window import MainWindow

    app = studio_app.create_app()
    tmp = Path(tempfile.mkdtemp(prefix="edgeshard-shots-"))
    moe_dir, llava_dir = models(tmp, args.moe, args.llava)
    cluster = LocalCluster(tmp / "agents", 3)
    cluster.start()
    coordinator = Coordinator(cluster.endpoints, cluster.keys, request_timeout_s=60.0)
    coordinator.open()
    window = MainWindow()
    try:
        attach(window, coordinator, coordinator.wait_ready(30.0), origin="local")
        window.open_workspace(str(tmp / "ws.sqlite"))
        window.show()
        screens = window.screens
        # expert offloading: profile the agents for the Mixtral, compare, use EdgeMoE's plan, run it
        window.show_screen(screens.plan)
        screens.plan.set_technique("expert-offload")
        view = screens.plan.view
        view.set_model_dir(moe_dir)
        view.profile_button.click()
        wait(app, 300, lambda: not view.runner.is_busy())
        view.auto_solve()
        view.compare()
        rows = {view.table.item(r, 0).text(): r for r in range(view.table.rowCount())}
        view.table.setCurrentCell(rows["edgemoe"], 0)
        shoot(app, window, "expert-offload-plan")
        view.tabs.setCurrentWidget(view.run_box)  # the same plan run from the view (the studio's plan kept)
        view.run_box.prompts.setText(" | ".join(PROMPTS))
        view.run_on_agents()
        wait(app, 300, lambda: not view.runner.is_busy())
        shoot(app, window, "expert-offload-view-run")
        view.use_for_run.click()
        run = screens.run
        window.show_screen(run)
        run.model_edit.setText(moe_dir)
        run.prompts_edit.setPlainText("\n".join(PROMPTS))
        run.max_tokens_spin.setValue(24)
        finished: list[str] = []
        run.run_finished.connect(finished.append)
        run.start_run()
        wait(app, 300, lambda: bool(finished))
        print("expert-offload run:", finished, run.message.text() if hasattr(run, "message") else "", flush=True)
        wait(app, 2.0)
        shoot(app, window, "expert-offload-run")
        # EPD: measure the phases on the agents, search, run the pick
        window.show_screen(screens.plan)
        screens.plan.set_technique("phase-disaggregation")
        epd = screens.plan.view
        epd.set_model_dir(llava_dir)
        epd.measure_on_agents()
        wait(app, 300, lambda: not epd.runner.is_busy())
        epd.requests.setValue(8)
        epd.trials.setValue(20)
        epd.auto_solve()
        wait(app, 300, lambda: not epd.runner.is_busy())
        epd.tabs.setCurrentWidget(epd.table)
        shoot(app, window, "epd-plan")
        epd.run_on_agents()
        wait(app, 300, lambda: not epd.runner.is_busy())
        shoot(app, window, "epd-run")
    finally:
        screens.plan.shutdown()
        window.close()
        coordinator.close()
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
