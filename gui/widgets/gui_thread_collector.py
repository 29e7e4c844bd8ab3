"""Python's cyclic garbage collection, run only on the GUI thread.

An automatic collection runs in whichever thread's allocation crosses gc's threshold. A worker
that allocates a lot (the background ``import torch`` of gui/workers.warm_import) then collects
ON ITS OWN THREAD the unreachable cycles that hold PySide6 wrappers, and so deletes their QObjects
off the GUI thread while the GUI thread's event loop may be delivering to them: a segfault in
``QCoreApplication::notifyInternal2`` from ``QTimerInfoList::activateTimers`` (gdb, with the worker
inside ``gc_collect_main``). Qt objects may only be deleted on their own thread, so automatic
collection is switched off and a timer on the GUI thread collects the generations whose counts
crossed gc's own thresholds instead (the idea of pyqtgraph's GarbageCollector)."""

from __future__ import annotations

import gc

from PySide6.QtCore import QObject, QTimer

# Often enough that the studio's memory does not grow (a first-generation pass over a few hundred
# objects costs microseconds), seldom enough to be free.
COLLECT_INTERVAL_MS = 500


class GuiThreadCollector(QObject):
    """Switches automatic collection off and collects from a timer on the thread it lives on (the
    GUI thread); ``uninstall`` gives collection back to the interpreter."""

    def __init__(self, parent: QObject | None = None, interval_ms: int = COLLECT_INTERVAL_MS) -> None:
        super().__init__(parent)
        self._thresholds = gc.get_threshold()
        self._was_enabled = False
        self._timer = QTimer(self)
        self._timer.setInterval(interval_ms)
        self._timer.timeout.connect(self.collect_due)
        self.resume()

    def resume(self) -> None:
        """Take collection over (again): automatic collection off, the timer on."""
        if not self._timer.isActive():
            self._was_enabled = gc.isenabled()
            gc.disable()
            self._timer.start()

    def collect_due(self) -> None:
        """Collect the oldest generation whose count crossed its threshold, as the interpreter would
        (a generation's collection takes the younger ones with it)."""
        counts = gc.get_count()
        for generation in (2, 1, 0):
            if counts[generation] > self._thresholds[generation]:
                gc.collect(generation)
                return

    def uninstall(self) -> None:
        """Give collection back to the interpreter, the backlog collected here first, on this thread and
        outside any destructor: re-enabled with garbage waiting, the first automatic collection could run
        inside a QObject's destructor (shiboken allocates there) and delete other QObjects under the lock
        that destructor holds: a deadlock (``QBasicMutex::lockInternal`` under ``gc_collect_main`` under
        ``QObject::~QObject``), seen when this collector was itself deleted at the end of tests/gui. So it
        is not deleted either: it stays the application's child, stopped, for the next install."""
        if not self._timer.isActive():
            return
        self._timer.stop()
        gc.collect()
        if self._was_enabled:
            gc.enable()


def install_gui_thread_collector(app: QObject) -> GuiThreadCollector:
    """The collector of ``app`` (made once, a child of the application so it lives on its thread; one
    uninstalled earlier takes over again)."""
    existing = app.findChild(GuiThreadCollector)
    if existing is None:
        return GuiThreadCollector(app)
    existing.resume()
    return existing
