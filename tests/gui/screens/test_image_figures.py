"""A spatial (CNN) run's replay and Compare name its figures as images, not tokens: a real
recorded simulation of a spatial plan opened in the Sessions screen and compared (pytest-qt)."""

from __future__ import annotations

import pytest

from core.reporting import NullReporter
from core.sessions.recording import append_predicted
from core.sessions.store import SessionStore
from core.techniques.spatial.partition import fused_plan
from core.techniques.spatial.simulator import simulate
from gui.screens.run_comparison import RunComparisonView, load_comparison
from tests.gui.opened_run import sessions_with_run_open
from tests.techniques.spatial.conftest import make_problem

IMAGES = 4


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Two recorded spatial runs (as run_and_record stores them) and their images/s."""
    problem = make_problem()
    plan = fused_plan(problem)
    sim = simulate(problem, plan, images=IMAGES)
    path = str(tmp_path_factory.mktemp("image-figures") / "ws.sqlite")
    ids = []
    with SessionStore(path) as store:
        session = store.create_session("spatial")
        for _ in range(2):
            run_id = store.create_run(session, model="vgg16", mode="sequential", kind="predicted",
                                      settings={"technique": "spatial", "strategy": plan.strategy})
            append_predicted(store, run_id, sim.events, sim.tokens)
            store.finish_run(run_id, "completed", sim.figures)
            ids.append(run_id)
    return path, ids, sim.figures


def _compared(qtbot, workspace) -> RunComparisonView:
    """Compare of the workspace's two spatial runs."""
    path, ids, _ = workspace
    view = RunComparisonView()
    qtbot.addWidget(view)
    view.show_runs(*load_comparison(NullReporter(), path, *ids))
    return view


def test_a_spatial_replay_shows_images_time_per_image_and_images_per_second(qtbot, workspace):
    path, ids, figures = workspace
    panel = sessions_with_run_open(qtbot, path, ids[0])
    panel.seek(panel.replay.duration_s)
    monitor = panel.monitor
    monitor.refresh()
    labels = [c.accessibleName() for c in (monitor.ttft_card, monitor.latency_card, monitor.rate_card,
                                           monitor.tokens_card)]
    assert labels == ["First image", "Time / image", "Images/s", "Images"]
    assert (monitor.rate_label.text(), monitor.text_label.text()) == ("Images per second", "Top class per image")
    assert monitor.tokens_card.text().endswith(str(IMAGES))
    assert monitor.rate_card.value_label.text() == f"{figures.tokens_per_s:.1f}"
    monitor.reset(["a"], settings={"technique": "layer-sharding"})
    assert monitor.ttft_card.accessibleName() == "TTFT" and monitor.rate_card.accessibleName() == "Decode tokens/s"
    assert monitor.rate_label.text() == "Tokens per second"
    assert panel.shutdown()


def test_compare_of_two_spatial_runs_names_images_and_drops_the_decode_rate(qtbot, workspace):
    view = _compared(qtbot, workspace)
    names = [r[0] for r in view.figure_rows()]
    assert names[:5] == ["First image", "Time / image", "Images/s", "Images", "Duration"]
    assert not {"TTFT", "Latency / token", "Tokens", "Decode tokens/s"} & set(names)


def test_compare_of_a_spatial_and_a_language_model_run_names_both_and_leaves_the_image_side_without_decode():
    from gui.screens.image_figures import image_rows

    rows = [("TTFT", "10.0 ms", "20.0 ms"), ("Decode tokens/s", "5.0", "6.0"), ("Duration", "1.00 s", "2.00 s")]
    assert image_rows(rows, False, True) == [("TTFT · first image", "10.0 ms", "20.0 ms"),
                                             ("Decode tokens/s", "5.0", "—"), ("Duration", "1.00 s", "2.00 s")]
    assert image_rows(rows, False, False) == rows


def test_a_spatial_replay_legend_names_strips_not_micro_batches_prefill_or_decode(qtbot, workspace):
    path, ids, _ = workspace
    panel = sessions_with_run_open(qtbot, path, ids[0])
    panel.seek(panel.replay.duration_s)
    legend = panel.monitor.timeline.legend_text()
    assert "strip compute" in legend and "scatter" in legend
    assert not {"mb0", "prefill", "decode"} & set(legend.replace("·", " ").split())
    panel.monitor.reset(["a"], settings={"technique": "layer-sharding"})  # the next replay: a language model's words
    assert "prefill" in panel.monitor.timeline.legend_text() and "strip" not in panel.monitor.timeline.legend_text()
    assert panel.shutdown()


def test_compare_of_a_spatial_run_names_its_strips_in_its_timeline_legend(qtbot, workspace):
    view = _compared(qtbot, workspace)
    for timeline in (view.timeline_a, view.timeline_b):
        assert "strip compute" in timeline.legend_text() and "prefill" not in timeline.legend_text()


def test_the_sessions_list_counts_a_spatial_runs_images_and_shows_its_strategy(qtbot, workspace):
    path, ids, _ = workspace
    panel = sessions_with_run_open(qtbot, path, ids[0])
    item = panel.run_items()[ids[0]]
    assert (item.text(1), item.text(4)) == ("fused", f"{IMAGES} images")
    assert panel.shutdown()


def _recorded_spatial_run(tmp_path, labels: tuple[str, ...], classes: tuple[int, ...]) -> tuple[str, int, int]:
    """A spatial run as ``core.techniques.spatial.run.record`` stores it (with its origin), its images
    classified as ``classes`` by a model that names them ``labels``: (workspace, measured id, predicted id)."""
    import msgspec

    from core.techniques.spatial.run import SpatialRun, record

    base = make_problem()
    problem = msgspec.structs.replace(base, model=msgspec.structs.replace(base.model, labels=labels))
    plan = fused_plan(problem)
    sim = simulate(problem, plan, images=len(classes))
    tokens = tuple(msgspec.structs.replace(t, token_ids=(c,)) for t, c in zip(sim.tokens, classes))
    measured = SpatialRun(scores=((0.0,),) * len(classes), events=sim.events, tokens=tokens, figures=sim.figures)
    path = str(tmp_path / "ws.sqlite")
    return (path, *record(path, "spatial", problem, plan, measured))


def test_a_spatial_replay_names_each_images_class_and_its_label_not_a_raw_index(qtbot, tmp_path):
    names = ("plane", "car", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
    path, measured, predicted = _recorded_spatial_run(tmp_path, names, (7, 3))
    panel = sessions_with_run_open(qtbot, path, measured)
    panel.seek(panel.replay.duration_s)
    panel.monitor.refresh()
    assert panel.monitor.text_edit.toPlainText() == "Image 0: class 7 (horse)\nImage 1: class 3 (cat)"
    with qtbot.waitSignal(panel.run_opened, timeout=30_000):  # its predicted twin classified nothing
        panel.open_run(predicted)
    panel.seek(panel.replay.duration_s)
    panel.monitor.refresh()
    assert panel.monitor.text_edit.toPlainText().splitlines() == ["Image 0: not classified (a prediction)",
                                                                  "Image 1: not classified (a prediction)"]
    assert panel.shutdown()


def test_a_spatial_replay_of_a_model_without_labels_says_class_and_its_number(qtbot, tmp_path):
    path, measured, _ = _recorded_spatial_run(tmp_path, (), (7,))
    panel = sessions_with_run_open(qtbot, path, measured)
    panel.seek(panel.replay.duration_s)
    panel.monitor.refresh()
    assert panel.monitor.text_edit.toPlainText() == "Image 0: class 7"
    assert panel.shutdown()


def test_a_spatial_replays_highlight_picker_offers_its_images_not_micro_batches(qtbot, workspace):
    path, ids, _ = workspace
    panel = sessions_with_run_open(qtbot, path, ids[0])
    combo = panel.monitor.timeline.highlight_combo
    assert [combo.itemText(i) for i in range(combo.count())] == ["Highlight image", "Highlight nothing"]
    assert combo.currentData() == "step"  # every box of the clicked box's image
    panel.monitor.reset(["a"], settings={"technique": "layer-sharding"})  # the next replay: a language model's
    assert [combo.itemText(i) for i in range(combo.count())] == ["Highlight micro-batch", "Highlight token",
                                                                 "Highlight nothing"]
    assert panel.shutdown()
