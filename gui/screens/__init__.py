"""The studio's screens, reached by typed attribute (``screens.run``), never by a string key or
``hasattr``: a renamed method or a missing screen is an error where the wiring is written, not a
menu that silently disappears.

Each screen is built the first time it is reached (shown, or used by the window, the demo or a
menu action), not with the window: building all seven took ~3 s of a quiet machine's start (the
Sessions screen alone 1.5 s), and a test that needs one screen paid for all of them. A screen
reads the studio state when it is built, so it shows what happened before it existed.
"""

from __future__ import annotations

from typing import Callable

from PySide6.QtWidgets import QWidget

from gui.screens.cluster import ClusterPanel
from gui.screens.devices import DevicesPanel
from gui.screens.experiments import ExperimentsPanel
from gui.techniques.layer_sharding.editor import PlanEditorPanel
from gui.screens.plan import PlanScreen
from gui.screens.profile import ProfilePanel
from gui.screens.run import RunPanel
from gui.screens.sessions import SessionsPanel
from gui.studio_state import StudioState

SCREEN_NAMES = ("devices", "cluster", "profile", "plan", "run", "sessions", "experiments")
"""In sidebar order; a name, capitalised, is the screen's title."""
SCREEN_TITLES = tuple(n.capitalize() for n in SCREEN_NAMES)
_FACTORIES: dict[str, Callable[[StudioState], QWidget]] = {
    "devices": DevicesPanel, "cluster": ClusterPanel, "profile": ProfilePanel, "plan": PlanScreen,
    "run": RunPanel, "sessions": SessionsPanel, "experiments": ExperimentsPanel,
}


class Screens:
    """The window's screens, each built on first use; ``on_built(name, screen)`` hears of each
    (the window puts it in its place and wires it)."""

    def __init__(self, state: StudioState, on_built: Callable[[str, QWidget], None] | None = None) -> None:
        self._state = state
        self._built: dict[str, QWidget] = {}
        self.on_built = on_built

    @classmethod
    def build(cls, state: StudioState) -> Screens:
        return cls(state)

    def get(self, name: str) -> QWidget:
        """The screen ``name`` (one of ``SCREEN_NAMES``), built now if it was not yet."""
        screen = self._built.get(name)
        if screen is None:
            screen = self._built[name] = _FACTORIES[name](self._state)
            if self.on_built is not None:
                self.on_built(name, screen)
        return screen

    def is_built(self, name: str) -> bool:
        return name in self._built

    def built(self) -> list[tuple[str, QWidget]]:
        """(name, screen) of the screens built so far, in sidebar order."""
        return [(n, self._built[n]) for n in SCREEN_NAMES if n in self._built]

    def name_of(self, screen: QWidget) -> str:
        return next(n for n, w in self._built.items() if w is screen)

    @property
    def devices(self) -> DevicesPanel:
        return self.get("devices")

    @property
    def cluster(self) -> ClusterPanel:
        return self.get("cluster")

    @property
    def profile(self) -> ProfilePanel:
        return self.get("profile")

    @property
    def plan(self) -> PlanScreen:
        """The chosen technique's plan view (``plan.view``); Auto-solve and Compare go there."""
        return self.get("plan")

    @property
    def run(self) -> RunPanel:
        return self.get("run")

    @property
    def sessions(self) -> SessionsPanel:
        return self.get("sessions")

    @property
    def experiments(self) -> ExperimentsPanel:
        return self.get("experiments")

    @property
    def plan_editor(self) -> PlanEditorPanel:
        """Layer sharding's plan editor (built with the Plan screen): plan files, undo and redo."""
        view = self.plan.view_for("layer-sharding")
        assert isinstance(view, PlanEditorPanel)
        return view

    def titled(self) -> list[tuple[str, QWidget]]:
        """(title, screen) in sidebar order: every screen, built now."""
        return [(n.capitalize(), self.get(n)) for n in SCREEN_NAMES]
