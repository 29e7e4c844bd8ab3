"""Windows a test closed are deleted when it ends: every ``create_app()`` restyles every widget
still alive, so each one left over slowed every later GUI test (tests/gui/conftest.py)."""

from __future__ import annotations

import gc

from PySide6.QtCore import QEvent, QMetaMethod, QObject
from PySide6.QtWidgets import QApplication, QWidget

from gui.demo import DemoSession
from gui.studio_state import StudioState

# Widgets left alive after a test (pyqtgraph's parentless context menus, ~110 a window, live until
# their Python cycles are collected) beyond which the garbage is collected; a collection costs more.
LEFT_OVER_WIDGETS = 300

# The studio's parentless objects a test makes (``StudioState()``, a ``DemoSession``): their own and
# their children's signals hold lambdas that hold them and the windows they serve, a cycle through Qt
# that Python's collector cannot see, so neither they nor those windows were ever freed.
OWNED_BY_THE_TEST = (StudioState, DemoSession)


def collect_garbage() -> None:
    gc.collect()
    QApplication.sendPostedEvents(None, QEvent.DeferredDelete)


def free_window(window: QWidget, *owners: QObject) -> None:
    """Delete a window a module's fixture made (closed, and its ``owners`` done), at once: the next
    tests' windows would restyle it with theirs."""
    for owner in owners:
        release_connections(owner)
    window.deleteLater()
    QApplication.sendPostedEvents(None, QEvent.DeferredDelete)
    collect_garbage()


def recording_init(init, made: list[QObject]):
    """``init`` that also appends each object it made to ``made``."""

    def recorded_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    return recorded_init


def release_connections(obj: QObject) -> None:
    """Disconnect every signal of ``obj`` and of its children (once they are of no more use), so
    what their slots hold can be freed."""
    first = QObject.staticMetaObject.methodCount()  # QObject's own (destroyed) are Qt's to manage
    for o in (obj, *obj.findChildren(QObject)):
        meta = o.metaObject()
        for i in range(first, meta.methodCount()):
            method = meta.method(i)
            if method.methodType() == QMetaMethod.Signal and o.isSignalConnected(method):
                getattr(o, method.name().data().decode()).disconnect()
