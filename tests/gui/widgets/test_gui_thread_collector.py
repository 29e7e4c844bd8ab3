"""Python's garbage collected only on the GUI thread (gui/widgets/gui_thread_collector.py): a worker's
collection deleted Qt objects under the event loop (a segfault at load)."""

from __future__ import annotations

import gc
import threading
import weakref

from gui.widgets.gui_thread_collector import GuiThreadCollector


class _Node:
    """A weak-referenceable object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def _make_cycles(n: int) -> None:
    for _ in range(n):
        a: list = []
        a.append(a)


def _recording_collecting_threads(threads: list[int]):
    def record(phase: str, _info: dict) -> None:
        if phase == "start":
            threads.append(threading.get_ident())
    return record


def test_no_collection_runs_on_a_worker_that_allocates_cycles_while_the_collector_is_installed(qapp, qtbot):
    collector = GuiThreadCollector(interval_ms=10)
    threads: list[int] = []
    record = _recording_collecting_threads(threads)
    gc.callbacks.append(record)
    try:
        # 30 thresholds' worth of unreachable cycles: an enabled collector would run dozens of
        # collections on the worker
        worker = threading.Thread(target=_make_cycles, args=(30 * gc.get_threshold()[0],))
        worker.start()
        qtbot.waitUntil(lambda: not worker.is_alive(), timeout=60_000)
        qtbot.waitUntil(lambda: bool(threads), timeout=10_000)  # the timer collected what it left
    finally:
        gc.callbacks.remove(record)
        collector.uninstall()
    assert set(threads) == {threading.get_ident()}


def test_the_collector_frees_unreachable_cycles_when_the_event_loop_runs(qapp, qtbot):
    collector = GuiThreadCollector(interval_ms=10)
    try:
        node = _Node()
        freed = weakref.ref(node)
        del node
        _make_cycles(2 * gc.get_threshold()[0])  # past the first generation's threshold
        qtbot.waitUntil(lambda: freed() is None, timeout=10_000)
    finally:
        collector.uninstall()


def test_uninstall_collects_the_backlog_itself_before_giving_collection_back(qapp):
    """Re-enabled with Qt garbage waiting, the interpreter's first collection could run inside a
    QObject's destructor and deadlock on its lock (the end of tests/gui hung so): uninstall collects it."""
    from PySide6.QtCore import QObject

    collector = GuiThreadCollector(interval_ms=60_000)  # its timer never fires in this test
    try:
        node = _Node()
        node.qt = QObject()
        freed = weakref.ref(node)
        del node
        assert freed() is not None  # automatic collection is off
    finally:
        collector.uninstall()
    assert freed() is None


def test_an_uninstalled_collector_takes_over_again_when_installed(qapp):
    """The application keeps its one collector (never deleted: see uninstall) and resumes it."""
    from gui.widgets.gui_thread_collector import install_gui_thread_collector

    first = install_gui_thread_collector(qapp)  # tests/gui's own (conftest), left installed
    first.uninstall()
    assert gc.isenabled()
    again = install_gui_thread_collector(qapp)
    assert again is first and not gc.isenabled()
