"""The spatial plan view: a real PlanScreen with the Spatial technique chosen (pytest-qt)."""

from __future__ import annotations

import pytest

from agents.techniques.spatial.network import vgg16
from core.formats import save
from core.techniques.spatial.partition import fused_plan
from core.techniques.spatial.scenarios import paper_shaped
from gui.screens.plan import PlanScreen
from gui.techniques.spatial import SpatialPlanView, owned_ranges, read_ranges
from gui.studio_state import StudioState
from tests.gui.techniques.spatial_solving import solved


@pytest.fixture
def view(qtbot):
    screen = PlanScreen(StudioState())
    qtbot.addWidget(screen)
    screen.set_technique("spatial")
    yield solved(qtbot, screen.view)
    screen.shutdown()


def test_the_spatial_view_is_offered_before_an_llm_is_loaded_and_shows_a_plan(view):
    assert isinstance(view, SpatialPlanView)
    assert view.canvas.plan is not None and view.canvas.plan.strategy == "fused"
    assert "vgg16-224" in view.summary.text()


def test_auto_solve_shows_the_fused_plan_and_compare_lists_every_partitioner(qtbot, view):
    solved(qtbot, view).auto_solve()
    solved(qtbot, view)
    assert view.canvas.plan.strategy == "fused" and view.strategy.currentText() == "fused"
    view.compare()
    solved(qtbot, view)
    assert [view.table.item(r, 0).text() for r in range(view.table.rowCount())] == ["fused", "bodp", "cbps", "even"]
    assert view.table.isVisibleTo(view)


def test_a_scenario_with_fewer_nodes_plans_on_fewer_devices(qtbot, view):
    view.nodes.setValue(2)
    solved(qtbot, view).use_scenario()
    solved(qtbot, view)
    assert len(view.canvas.plan.devices) == 2


def test_a_bad_problem_file_is_named_inline_and_the_plan_on_screen_stays(view, tmp_path):
    before = view.canvas.plan
    bad = tmp_path / "bad.json"
    p = paper_shaped(2)
    save(bad, p.__class__(name="bad", model=p.model, devices=p.devices, gateway="nobody"))
    view.load_problem(str(bad))
    assert "gateway 'nobody' is not one of the devices" in view.message.text() and view.canvas.plan is before


def test_owned_columns_tile_each_layer_and_read_columns_add_the_halo():
    spec = vgg16(32, 8, 10)
    layers = spec.layers[0:3]  # conv, conv, pool: one fused tile
    widths = (6, 10)
    assert owned_ranges(layers, widths, 2) == [(0, 6), (6, 16)]
    assert owned_ranges(layers, widths, 0) == [(0, 12), (12, 32)]
    assert read_ranges(layers, widths, 0) == [(0, 14), (10, 32)]  # two 3x3 convs: 2 halo columns each side
    assert fused_plan(paper_shaped(2)).devices == ("pi-0", "pi-1")


def test_loading_a_problem_gives_the_profile_screen_its_time_models_and_the_scenario_does_not(view, tmp_path):
    assert view.state.spatial_fits is None  # the scenario it opens with is made up, not a profile
    problem = paper_shaped(2)
    save(tmp_path / "two.json", problem)
    view.load_problem(str(tmp_path / "two.json"))
    fits = view.state.spatial_fits
    assert [d.device for d in fits.devices] == ["pi-0", "pi-1"] and "two.json" in fits.source
    assert fits.devices[0].conv == problem.devices[0].time


def test_a_one_device_plan_is_worded_in_the_singular(qtbot, view):
    view.nodes.setValue(1)
    solved(qtbot, view).use_scenario()
    solved(qtbot, view)
    assert len(view.canvas.plan.devices) == 1
    text = view.summary.text()
    assert "1 device," in text and "1 devices" not in text


def test_the_images_box_counts_the_chosen_files_and_its_own_number_comes_back_with_random(view):
    view.run_images.setValue(5)
    view.set_image_files([f"/nowhere/{i}.png" for i in range(10)])
    assert view.run_images.value() == 10 and not view.run_images.isEnabled()
    view.set_image_files([])
    assert view.run_images.value() == 5 and view.run_images.isEnabled()


def test_picking_spatial_imports_torch_off_the_gui_thread_before_a_run():
    """The run's worker imported torch at its first image: the import holds the GIL in long C
    stretches, so the GUI thread stalled under the live timeline (0.3-1.3 s at load 19). The pick
    starts it on a thread of its own; a fresh interpreter records which thread imported torch."""
    import subprocess
    import sys

    code = """
import sys, threading
seen = []
class Recorder:  # the thread that first looks for torch (imports it)
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            seen.append(threading.current_thread().name)
sys.meta_path.insert(0, Recorder())
from PySide6.QtWidgets import QApplication
app = QApplication([])
from gui.screens.plan import PlanScreen
from gui.studio_state import StudioState
from tests.gui.techniques.spatial_solving import solved
screen = PlanScreen(StudioState())
before = "torch" in sys.modules
screen.set_technique("spatial")
for thread in threading.enumerate():  # a warm-up, if any, ended
    if thread.name.startswith("warm-"):
        thread.join(300)
print(before, seen)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**__import__("os").environ, "QT_QPA_PLATFORM": "offscreen"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False ['warm-torch']"


def test_picking_spatial_solves_on_the_solvers_worker_while_the_gui_thread_runs_with_progress(qtbot, monkeypatch):
    """The pick's fused solve ran on the GUI thread (0.9-1.2 s frozen under load). Here the solve waits for a
    timer that only the GUI thread can fire: it lands only because the GUI thread ran while it solved."""
    import threading

    from PySide6.QtCore import QTimer

    from gui.techniques.spatial import solving

    release, threads = threading.Event(), []
    real = solving.run_strategy

    def gated(problem, name):
        threads.append(threading.current_thread())
        assert release.wait(60), "the GUI thread never ran while the solve waited"
        return real(problem, name)

    monkeypatch.setattr(solving, "run_strategy", gated)
    screen = PlanScreen(StudioState())
    qtbot.addWidget(screen)
    screen.set_technique("spatial")  # returns while the solve runs
    view = screen.view
    assert view.solver.is_busy() and view.plan is None and not view.solve_progress.isHidden()
    qtbot.waitUntil(lambda: view.summary.text() == "Solving fused…")  # what it is doing, from the worker
    QTimer.singleShot(0, release.set)
    solved(qtbot, view)
    assert threads and threading.main_thread() not in threads
    assert view.plan is not None and view.canvas.plan is view.plan and view.solve_progress.isHidden()
    assert view.summary.text().startswith(view.problem.name)
    screen.shutdown()
