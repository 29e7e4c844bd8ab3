"""The profile screen shows what was measured and runs profiling in a worker."""

from __future__ import annotations

import threading

from core.reporting import Cancelled
from gui.screens.profile import ProfilePanel
from gui.studio_state import StudioState
from tests.gui.problems import make_problem


def test_profile_shows_workload_curves_per_device_and_budgets(qtbot):
    state = StudioState()
    panel = ProfilePanel(state)
    qtbot.addWidget(panel)
    problem = make_problem()
    state.set_profile(problem.profile)
    text = panel.workload_label.text()
    assert "tiny-llama" in text and "prompt 32 tokens, batch 1" in text and "synthetic" in text
    decode = panel.plots.getItem(0, 0)
    assert [c.name() for c in decode.listDataItems()] == ["phone", "laptop", "server"]
    ys = decode.listDataItems()[0].yData
    assert abs(ys[1] - 0.002 * 4 * 1e3) < 1e-9


def test_profiling_without_agents_says_what_to_do(qtbot):
    panel = ProfilePanel(StudioState())
    qtbot.addWidget(panel)
    assert not panel.profile_button.isEnabled()
    panel.start_profiling()
    assert "Deploy and start agents" in panel.error.text()


def test_profiling_runs_in_a_worker_and_sets_the_profile(qtbot):
    state = StudioState()
    panel = ProfilePanel(state)
    qtbot.addWidget(panel)
    problem = make_problem()
    threads = []

    def fake_measure(reporter):
        threads.append(threading.current_thread())
        for i in range(3):
            reporter.progress(i + 1, 3)
        return problem.profile

    panel.set_profile_task(fake_measure)
    with qtbot.waitSignal(state.profile_changed, timeout=30_000):
        panel.profile_button.click()
    assert threads[0] is not threading.main_thread()
    assert state.profile == problem.profile and state.problem.source == "phone"
    panel.shutdown()


def test_a_failed_profiling_run_is_shown_inline(qtbot):
    panel = ProfilePanel(StudioState())
    qtbot.addWidget(panel)

    def failing(reporter):
        from core.errors import RunFailed

        raise RunFailed("agent stopped answering", device="phone")

    panel.set_profile_task(failing)
    with qtbot.waitSignal(panel.runner.task_failed, timeout=30_000):
        panel.start_profiling()
    assert "phone: agent stopped answering" in panel.error.text()
    panel.shutdown()


def test_a_profile_saves_to_a_file_that_loads_back_equal(qtbot, tmp_path):
    from core import formats
    from core.devices.profile import Profile

    state = StudioState()
    panel = ProfilePanel(state)
    qtbot.addWidget(panel)
    assert not panel.save_button.isEnabled()
    state.set_profile(make_problem().profile)
    assert panel.save_button.isEnabled()
    path = tmp_path / "p.json"
    assert panel.save_profile_file(str(path))
    assert formats.load(path, Profile) == state.profile
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    assert not panel.save_profile_file(str(blocker / "p.json"))
    assert "Cannot save" in panel.error.text() and "Choose a folder" in panel.error.text()


def test_while_profiling_the_screen_says_so_not_press_profile_cluster(qtbot):
    state = StudioState()
    panel = ProfilePanel(state)
    qtbot.addWidget(panel)
    release = threading.Event()

    def slow_measure(reporter):
        release.wait(5)
        return make_problem().profile

    panel.set_profile_task(slow_measure)
    assert "press Profile cluster" in panel.workload_label.text()
    with qtbot.waitSignal(panel.runner.busy_changed, timeout=30_000):
        panel.start_profiling()
    assert "Profiling the agents" in panel.workload_label.text()
    assert "press Profile cluster" not in panel.workload_label.text()
    with qtbot.waitSignal(state.profile_changed, timeout=30_000):
        release.set()
    assert "tiny-llama" in panel.workload_label.text()
    panel.shutdown()


def test_sub_millisecond_unit_times_read_in_ms_without_a_scale_factor(qtbot):
    """The demo's units take 0.2-0.8 ms: the time axes read "ms (x0.001)" over ticks 200-800."""
    import msgspec

    state = StudioState()
    panel = ProfilePanel(state)
    qtbot.addWidget(panel)
    profile = make_problem().profile
    fast = [msgspec.structs.replace(t, decode_s=tuple(tuple(s / 100 for s in row) for row in t.decode_s),
                                    prefill_s=tuple(tuple(s / 100 for s in row) for row in t.prefill_s))
            for t in profile.times]
    state.set_profile(msgspec.structs.replace(profile, times=tuple(fast)))
    panel.resize(1200, 700)
    panel.show()
    qtbot.waitExposed(panel)
    panel.grab()  # laid out and painted: the axes have their ranges
    for col in (0, 1):
        axis = panel.plots.getItem(0, col).getAxis("left")
        assert "ms" in axis.labelString() and "x0.001" not in axis.labelString() and axis.autoSIPrefixScale == 1


def test_a_device_profiled_warm_is_shown_with_the_reason_and_old_profiles_show_nothing(qtbot):
    import msgspec

    state = StudioState()
    panel = ProfilePanel(state)
    qtbot.addWidget(panel)
    profile = make_problem().profile
    state.set_profile(profile)  # synthetic: how it was timed is not recorded
    assert not panel.cache_label.isVisibleTo(panel)
    why = "overwriting the 480 MiB last-level cache takes 960 MiB; profiling may add 88 MiB (MemAvailable)"
    times = (msgspec.structs.replace(profile.times[0], cache_timing="cold"),
             msgspec.structs.replace(profile.times[1], cache_timing="warm", warm_reason=why)) + profile.times[2:]
    state.set_profile(msgspec.structs.replace(profile, times=times))
    text = panel.cache_label.text()
    assert panel.cache_label.isVisibleTo(panel)
    assert "cold" in text and "phone" in text and "<b>laptop</b> timed warm: " + why in text and "server" not in text


def test_a_long_profiling_status_wraps_instead_of_widening_the_screen(qtbot):
    """At 1024x700 "profiling compute: edge-a done, edge-b unit 4/8, edge-c …" made the screen wider
    than the window: a horizontal scroll bar and the status cut off at the window's edge."""
    state = StudioState()
    panel = ProfilePanel(state)
    qtbot.addWidget(panel)
    go_on, release = threading.Event(), threading.Event()
    status = "profiling compute: " + ", ".join(f"edge-{c} unit 4/8 of the model's layers" for c in "abcdef")

    def slow_measure(reporter):
        reporter.status("profiling")
        go_on.wait(30)
        reporter.status(status)
        release.wait(30)
        return make_problem().profile

    def min_width() -> int:
        panel.layout().activate()
        return panel.minimumSizeHint().width()

    panel.set_profile_task(slow_measure)
    panel.profile_button.click()
    try:
        qtbot.waitUntil(lambda: panel.progress_label.text() == "profiling")
        short = min_width()
        go_on.set()
        qtbot.waitUntil(lambda: panel.progress_label.text() == status)
        assert min_width() <= short + 60  # a word wider at most (it was ~1,400 px wider)
    finally:
        go_on.set()
        release.set()
        qtbot.waitUntil(lambda: not panel.runner.is_busy(), timeout=30_000)
        panel.shutdown()
