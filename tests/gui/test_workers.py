"""TaskRunner / QtReporter: work runs off the GUI thread and reports through queued signals."""

from __future__ import annotations

import threading
import time

import pytest
from PySide6.QtCore import QThread
from PySide6.QtWidgets import QApplication

from core.errors import PlanInvalid
from core.reporting import Cancelled
from gui.workers import QtReporter, TaskRunner, shutdown_together


@pytest.fixture
def runner(qtbot):
    r = TaskRunner(name="test")
    yield r
    assert r.shutdown(30.0), "a task thread is still running"


def _count_steps(reporter, n, delay_s=0.0):
    for i in range(n):
        if reporter.cancel_requested():
            raise Cancelled()
        reporter.progress(i + 1, n)
        if delay_s:
            time.sleep(delay_s)
    return n


def test_result_arrives_on_the_gui_thread_from_a_worker_thread(qtbot, runner):
    seen = {}

    def work(reporter):
        seen["worker_thread"] = threading.current_thread()
        reporter.status("working")
        reporter.partial_result(1)
        return 42

    statuses, partials, finished_threads = [], [], []
    status_threads = []
    runner.status_reported.connect(lambda tid, text: (statuses.append(text),
                                                      status_threads.append(QThread.currentThread())))
    runner.partial_result_reported.connect(lambda tid, v: partials.append(v))
    runner.task_finished.connect(lambda tid, v: finished_threads.append(QThread.currentThread()))
    with qtbot.waitSignal(runner.task_finished, timeout=30_000) as blocker:
        task_id = runner.start(work)
    assert blocker.args == [task_id, 42]
    assert seen["worker_thread"] is not threading.main_thread()
    assert statuses == ["working"] and partials == [1]
    assert finished_threads == [QApplication.instance().thread()]
    assert status_threads == [QApplication.instance().thread()]
    assert not runner.is_busy() and runner.alive_threads() == []


def test_operator_error_becomes_task_failed_with_its_message(qtbot, runner):
    def work(reporter):
        raise PlanInvalid(["stage 1 exceeds memory on pi-a"])

    with qtbot.waitSignal(runner.task_failed, timeout=30_000) as blocker:
        runner.start(work)
    assert "stage 1 exceeds memory on pi-a" in blocker.args[1]


def test_a_bug_is_reported_in_plain_words_not_as_a_traceback(qtbot, runner):
    def work(reporter):
        return {}["missing"]

    with qtbot.waitSignal(runner.task_failed, timeout=30_000) as blocker:
        runner.start(work)
    message = blocker.args[1]
    assert message.startswith("Unexpected error: KeyError")
    assert "Traceback" not in message


def test_starting_a_new_task_cancels_the_old_and_drops_its_result(qtbot, runner):
    started = threading.Event()

    def slow(reporter):
        started.set()
        while not reporter.cancel_requested():
            time.sleep(0.005)
        return "stale"

    finished, cancelled = [], []
    runner.task_finished.connect(lambda tid, v: finished.append((tid, v)))
    runner.task_cancelled.connect(cancelled.append)
    first = runner.start(slow)
    assert started.wait(30)
    second = runner.start(lambda reporter: "fresh")
    qtbot.waitUntil(lambda: len(cancelled) == 1 and len(finished) == 1, timeout=30_000)
    assert cancelled == [first]
    assert finished == [(second, "fresh")]


def test_cancel_stops_a_running_task_and_leaves_no_thread(qtbot, runner):
    def work(reporter):
        return _count_steps(reporter, 10_000, delay_s=0.001)

    with qtbot.waitSignal(runner.task_cancelled, timeout=30_000):
        runner.start(work)
        qtbot.wait(50)
        runner.cancel()
    qtbot.waitUntil(lambda: runner.alive_threads() == [], timeout=30_000)


def test_progress_is_rate_limited_but_the_final_value_always_arrives(qtbot, runner):
    progress = []
    runner.progress_reported.connect(lambda tid, d, t: progress.append((d, t)))
    with qtbot.waitSignal(runner.task_finished, timeout=30_000):
        runner.start(_count_steps, 100_000)
    assert progress[-1] == (100_000.0, 100_000.0)
    assert len(progress) < 200, f"{len(progress)} progress signals for a tight loop"


def test_qt_reporter_is_a_reporter_usable_directly(qtbot):
    reporter = QtReporter(min_progress_interval_s=0.0)
    got = []
    reporter.progress_reported.connect(lambda d, t: got.append((d, t)))
    assert _count_steps(reporter, 3) == 3
    assert got == [(1.0, 3.0), (2.0, 3.0), (3.0, 3.0)]
    reporter.cancel()
    with pytest.raises(Cancelled):
        _count_steps(reporter, 3)


def test_request_stop_keeps_the_task_current_until_it_ends(qtbot, runner):
    started = threading.Event()

    def work(reporter):
        started.set()
        while not reporter.cancel_requested():
            time.sleep(0.005)
        reporter.status("cleaning up")
        raise Cancelled()

    statuses = []
    runner.status_reported.connect(lambda tid, text: statuses.append(text))
    task_id = runner.start(work)
    assert started.wait(30)
    with qtbot.waitSignal(runner.task_cancelled, timeout=30_000) as blocker:
        runner.request_stop()
        assert runner.is_busy()
    assert blocker.args == [task_id]
    assert statuses == ["cleaning up"] and not runner.is_busy()


class _Resource:
    """Stands for a live connection a task hands back (a Coordinator: threads, sockets)."""

    def __init__(self, name: str):
        self.name = name
        self.closed_on: threading.Thread | None = None

    def close(self) -> None:
        self.closed_on = threading.current_thread()


def test_a_superseded_task_s_result_goes_to_on_discarded_not_nowhere(qtbot, runner):
    started = threading.Event()

    def slow_connect(reporter):
        started.set()
        while not reporter.cancel_requested():
            time.sleep(0.005)
        return _Resource("stale")  # connected anyway: it must be closed by someone

    finished = []
    runner.task_finished.connect(lambda tid, v: finished.append(v))
    stale_tasks = []
    runner.start(slow_connect, on_discarded=lambda r: (r.close(), stale_tasks.append(r)))
    assert started.wait(30)
    fresh = _Resource("fresh")
    runner.start(lambda reporter: fresh, on_discarded=lambda r: r.close())
    qtbot.waitUntil(lambda: len(stale_tasks) == 1 and len(finished) == 1, timeout=30_000)
    assert stale_tasks[0].name == "stale" and stale_tasks[0].closed_on is threading.main_thread()
    assert finished == [fresh] and fresh.closed_on is None  # the current result is delivered, not released


def test_shutdown_releases_the_result_of_a_task_that_ends_meanwhile(qtbot, runner):
    started = threading.Event()
    released = []

    def connect(reporter):
        started.set()
        time.sleep(0.2)  # ignores cancellation: connecting cannot be interrupted
        return _Resource("late")

    runner.start(connect, on_discarded=released.append)
    assert started.wait(30)
    assert runner.shutdown(30.0)
    assert [r.name for r in released] == ["late"]


def test_a_failing_release_is_logged_and_the_runner_goes_on(qtbot, runner, caplog):
    def bad_release(_r):
        raise OSError("socket already gone")

    first = runner.start(lambda reporter: (time.sleep(0.05), "x")[1], on_discarded=bad_release)
    runner.cancel()
    with qtbot.waitSignal(runner.task_finished, timeout=30_000) as blocker:
        runner.start(lambda reporter: "next")
    assert blocker.args[1] == "next" and first != blocker.args[0]
    qtbot.waitUntil(lambda: "releasing the discarded result" in caplog.text, timeout=30_000)


@pytest.fixture
def second_runner(qtbot):
    r = TaskRunner(name="second")
    yield r
    assert r.shutdown(30.0), "a task thread is still running"


def test_runners_shut_down_together_are_all_cancelled_before_any_is_joined(qtbot, runner, second_runner):
    """Sessions' four loaders: a task that takes a while to notice its cancel must not hold up
    the next runner's cancel (joined one after another, each runner could take the timeout)."""
    first, second = runner, second_runner
    second_cancelled_while_first_ran = []
    started = threading.Barrier(3)

    def slow_to_stop(reporter):
        started.wait(30)
        while not reporter.cancel_requested():
            time.sleep(0.01)
        time.sleep(0.3)  # finishing a read after the cancel
        second_cancelled_while_first_ran.append(second_reporter[0].cancel_requested())

    second_reporter = []

    def waits_for_cancel(reporter):
        second_reporter.append(reporter)
        started.wait(30)
        while not reporter.cancel_requested():
            time.sleep(0.01)

    first.start(slow_to_stop)
    second.start(waits_for_cancel)
    started.wait(30)
    assert shutdown_together([first, second], 30.0)
    assert second_cancelled_while_first_ran == [True]


def _two_phases_unweighted(reporter):
    for done in (1, 2, 3, 4):  # a phase that restarts the count: 75 % then 25 %
        reporter.progress(done if done <= 3 else 1, 4)
        time.sleep(0.06)  # past the rate limit, so every report is sent


def test_a_tasks_progress_never_goes_backwards(qtbot, runner):
    fractions = []
    runner.progress_reported.connect(lambda _t, d, t: fractions.append(d / t))
    with qtbot.waitSignal(runner.task_finished, timeout=30_000):
        runner.start(_two_phases_unweighted)
    assert fractions == sorted(fractions) and fractions[-1] == 0.75


def test_a_runner_deleted_while_its_task_reports_leaves_the_task_to_end_without_a_crash(qtbot):
    """A screen closed mid-solve deletes its runner (and, in C++, what the runner owns) while the
    worker still reports: the worker must never emit through an object being deleted (it did: the
    reporter was the runner's child, a segfault in tests/gui 1 run in 3 at load 12-17)."""
    import shiboken6
    going, ended = threading.Event(), threading.Event()
    statuses = []

    def chatty(reporter):
        try:
            going.set()
            for i in range(5_000):
                reporter.status(f"step {i}")
                reporter.progress(i, 5_000)
            return "done"
        finally:
            ended.set()

    for _ in range(3):
        going.clear(), ended.clear()
        r = TaskRunner(name="deleted")
        r.status_reported.connect(lambda tid, text: statuses.append(text))
        r.start(chatty)
        assert going.wait(30)
        shiboken6.delete(r)  # the C++ runner goes while the worker emits
        assert ended.wait(60), "the task did not end"
        QApplication.sendPostedEvents()
        QApplication.processEvents()
    workers = [t for t in threading.enumerate() if t.name.startswith("edgeshard-deleted")]
    for t in workers:  # each still emits the task's end after ``ended``: joined, not read at once
        t.join(30)
    assert not any(t.is_alive() for t in workers)
