"""The Experiments screen runs a paper experiment on a worker and shows findings, table and figures."""

from __future__ import annotations

from PySide6.QtCore import Qt

from gui.screens.experiments import ExperimentsPanel


def test_running_an_experiment_shows_its_findings_table_and_figures(qtbot, tmp_path):
    panel = ExperimentsPanel(out_dir=tmp_path)
    qtbot.addWidget(panel)
    with qtbot.waitSignal(panel.runner.task_finished, timeout=120_000):
        panel.start("source")
    assert panel.findings.rowCount() == len(panel.result.findings) >= 2
    assert {panel.findings.item(i, 0).text() for i in range(panel.findings.rowCount())} <= {"held", "NOT HELD"}
    assert panel.table.rowCount() == len(panel.result.rows)
    assert panel.plots.count() == 1 and panel.plots.tabText(0) == "fig9-source"
    assert (tmp_path / "fig9-source.png").stat().st_size > 0 and (tmp_path / "fig9-source.svg").exists()
    assert panel.run_button.isEnabled() and not panel.cancel_button.isEnabled()
    panel.shutdown()


def test_cancelling_an_experiment_leaves_the_screen_ready_to_run_again(qtbot, tmp_path):
    panel = ExperimentsPanel(out_dir=tmp_path)
    qtbot.addWidget(panel)
    with qtbot.waitSignal(panel.runner.task_cancelled, timeout=120_000):
        panel.start("bandwidth")  # eight bandwidths: cancelled between two of them
        panel.cancel_button.click()
    assert panel.status.text() == "Cancelled."
    assert panel.run_button.isEnabled() and panel.runner.alive_threads() == []
    panel.shutdown()


def test_clicking_run_runs_the_experiment_picked_in_the_list(qtbot, tmp_path):
    panel = ExperimentsPanel(out_dir=tmp_path)
    qtbot.addWidget(panel)
    panel.choice.setCurrentIndex(panel.choice.findData("source"))
    with qtbot.waitSignal(panel.runner.task_finished, timeout=120_000):
        qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    assert panel.choice.currentData() == "source"
    assert panel.plots.count() == 1 and panel.plots.tabText(0) == "fig9-source"
    panel.shutdown()
