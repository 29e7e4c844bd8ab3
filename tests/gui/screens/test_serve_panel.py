"""The Run screen's Serve toggle, driven with the official ``openai`` client: it serves the selected
model and plan over real local agents at the URL it shows with the key it copies; the answers are
transformers' own; each request gets a row with its TTFT/TPOT, its work is on the timeline, the
rates are plotted, and toggling off stops the endpoint. One cluster for the module.

With ``SERVE_PANEL_SHOTS=DIR`` (run under Xvfb) it also saves the Run screen serving at 1024×700
and 1600×1000."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from PySide6.QtGui import QGuiApplication

from core import formats
from core.devices.local_cluster import LocalCluster
from core.planning.plan import ShardPlan
from core.runs.coordinator import Coordinator
from gui.screens.run import RunPanel
from gui.studio_state import StudioState
from tests.core.serving.conftest import DEVICES, Reference, serve_files

PROMPTS = ["the river", "a cat sat on the", "once upon a time", "snow fell"]


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-panel")
    model, plan = serve_files(folder)
    with LocalCluster(folder / "cluster", DEVICES, threads_per_agent=1) as cluster:
        with Coordinator(cluster.endpoints, cluster.keys) as coordinator:
            yield coordinator, model, formats.load(plan, ShardPlan), folder


def _serving(qtbot, agents, workspace: str):
    """The Run screen serving the module's plan (its Serve toggle on), and an ``openai`` client of it
    (the URL it shows, the key it copies): (state, screen, client)."""
    coordinator, model, plan, folder = agents
    state = StudioState()
    state.set_workspace(str(folder / workspace))
    state.set_agents(coordinator)
    state.set_plan(plan)
    state.set_model("tiny-llama", str(model))
    screen = RunPanel(state)
    qtbot.addWidget(screen)
    panel = screen.serve_panel
    panel.toggle.click()
    qtbot.waitUntil(lambda: panel.url_edit.text() != "" or "Cannot" in panel.status.text(), timeout=120_000)
    assert panel.url_edit.text().startswith("http://127.0.0.1:"), panel.status.text()
    panel.copy_key.click()
    return state, screen, openai.OpenAI(base_url=panel.url_edit.text(), api_key=QGuiApplication.clipboard().text(),
                                        max_retries=0, timeout=120)


def test_the_serve_toggle_serves_the_plan_to_the_openai_client_and_shows_each_request(qtbot, agents):
    model = agents[1]
    _, screen, client = _serving(qtbot, agents, "studio.sqlite")
    panel = screen.serve_panel
    screen.resize(1600, 1000)
    screen.show()

    def stream(prompt: str) -> str:
        return "".join(c.choices[0].text for c in client.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=12, stream=True))

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(stream, p) for p in PROMPTS]
        qtbot.waitUntil(lambda: all(f.done() for f in futures), timeout=120_000)
    reference = Reference(model)
    assert [f.result() for f in futures] == [reference.complete(p, 12) for p in PROMPTS]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=panel.url_edit.text(), api_key="wrong", max_retries=0).models.list()

    qtbot.waitUntil(lambda: panel.table.rowCount() == len(PROMPTS)
                    and all(panel.table.item(i, 1).text() == "done" for i in range(len(PROMPTS))), timeout=60_000)
    rows = {panel.table.item(i, 5).text(): [panel.table.item(i, j).text() for j in range(5)]
            for i in range(len(PROMPTS))}
    assert set(rows) == set(PROMPTS)
    assert all(r[3].endswith(" ms") and r[4].endswith(" ms") for r in rows.values())
    qtbot.waitUntil(lambda: panel.timeline.box_count(kind="compute") > 0, timeout=60_000)
    assert max(panel.tokens_curve.getData()[1]) > 0 and max(panel.requests_curve.getData()[1]) > 0

    shots = os.environ.get("SERVE_PANEL_SHOTS")
    if shots:
        for w, h in ((1024, 700), (1600, 1000)):
            screen.resize(w, h)
            qtbot.wait(400)
            screen.grab().save(str(Path(shots) / f"serve_panel_{w}x{h}.png"))

    url = panel.url_edit.text()
    panel.toggle.click()  # off: the endpoint stops
    assert panel.url_edit.text() == "" and panel.endpoint is None
    with pytest.raises(openai.APIConnectionError):
        openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=5).models.list()


def test_a_served_request_is_replayed_in_the_sessions_screen(qtbot, agents):
    from gui.screens.sessions import SessionsPanel
    from tests.gui.screens.test_sessions import _play_to_end

    state, screen, client = _serving(qtbot, agents, "replayed.sqlite")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny-llama", prompt="the river", max_tokens=10, stream=True))
    screen.serve_panel.toggle.click()  # off: the request's recording is finished as the server stops

    sessions = SessionsPanel(state)
    qtbot.addWidget(sessions)
    sessions.resize(1400, 800)
    qtbot.waitUntil(lambda: sessions.tree.topLevelItemCount() > 0, timeout=60_000)
    session = sessions.tree.topLevelItem(0)
    assert session.text(0).startswith("Studio serve") and session.childCount() == 1
    (run_id,) = sessions.run_items()
    assert sessions.run_items()[run_id].text(3) == "completed"
    with qtbot.waitSignal(sessions.run_opened, timeout=60_000):
        sessions.open_run(run_id)
    _play_to_end(qtbot, sessions, 20_000)
    monitor = sessions.monitor
    assert streamed and streamed in monitor.text_edit.toPlainText()
    assert monitor.timeline.box_count(kind="compute") > 0  # the agents' work on its micro-batch
    assert monitor.ttft_card.text() not in ("", "—") and monitor.tokens_card.text() not in ("", "—")
    sessions.shutdown()


def test_the_serve_toggle_reads_stop_serving_while_it_serves(qtbot, agents):
    _, screen, _ = _serving(qtbot, agents, "toggle.sqlite")
    panel = screen.serve_panel
    assert panel.toggle.text() == "Stop serving"  # it read "Serve" both ways
    panel.toggle.click()
    assert panel.toggle.text() == "Serve" and panel.status.text() == "Not serving"


def test_an_idle_endpoints_rates_plot_has_no_negative_axis(qtbot):
    from gui.screens.serve_panel import ServePanel

    panel = ServePanel(StudioState())
    qtbot.addWidget(panel)
    panel.details.setVisible(True)
    panel.show()
    panel.tokens_curve.setData([-8.0, -4.0, 0.0], [0.0, 0.0, 0.0])  # serving, no request yet
    panel.requests_curve.setData([-8.0, -4.0, 0.0], [0.0, 0.0, 0.0])
    view = panel.plot.getViewBox()
    qtbot.waitUntil(lambda: view.viewRange()[0][0] < -7)  # auto-ranged to the data
    assert view.viewRange()[1][0] >= 0  # was -0.5: "-0.4 tokens/s" on the axis
