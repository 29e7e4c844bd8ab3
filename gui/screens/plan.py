"""The Plan screen: the chosen technique's plan view (registered in ``gui.techniques``).

The Plan screen is a ``PlanScreen``: the view of the chosen technique, with a technique picker
that appears only when more than one technique with a view applies to the current model. The
menus' Auto-solve and Compare go to the view on screen, so they work for whichever technique
is chosen.
"""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QSizePolicy, QStackedWidget, QVBoxLayout, QWidget

from core.techniques import technique_named, techniques, techniques_for
from gui.studio_state import StudioState
from gui.techniques import has_plan_view, plan_view_factory


class PlanScreen(QWidget):
    """The Plan screen: the chosen technique's plan view, views built when first shown."""

    technique_changed = Signal(str)
    run_requested = Signal()
    """A plan view put a runnable plan in the studio state and asks for it to run (the window
    shows the Run screen and starts it)."""

    def __init__(self, state: StudioState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self._views: dict[str, QWidget] = {}
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        self.picker_row = QWidget()
        row = QHBoxLayout(self.picker_row)
        row.setContentsMargins(16, 8, 16, 0)
        row.addWidget(QLabel("Technique:"))
        self.picker = QComboBox()
        self.picker.setAccessibleName("Technique")
        self.picker.setToolTip("How the model is placed on the devices; each technique has its own plan view")
        row.addWidget(self.picker)
        row.addStretch(1)
        lay.addWidget(self.picker_row)
        self.stack = QStackedWidget()
        self.stack.currentChanged.connect(self._size_by_shown_view)
        lay.addWidget(self.stack, 1)
        self.picker.currentIndexChanged.connect(self._on_picker_index_changed)
        state.problem_changed.connect(lambda _p: self.refresh_techniques())
        state.technique_models_changed.connect(lambda _m: self.refresh_techniques())
        self.refresh_techniques()

    # the techniques on offer -------------------------------------------------------
    def available(self) -> list[str]:
        """Techniques with a plan view that apply to the current model (all of them before a model is known)."""
        problem = self.state.problem
        known = {t.name for t in (techniques() if problem is None else techniques_for(problem.profile.model))}
        known |= set(self.state.technique_models)  # a model of its own (the demo's tour): offered whatever the LLM
        return [t.name for t in techniques() if has_plan_view(t.name) and t.name in known]

    def refresh_techniques(self) -> None:
        names = self.available() or ["layer-sharding"]
        current = self.technique
        self.picker.blockSignals(True)
        self.picker.clear()
        for name in names:
            self.picker.addItem(technique_named(name).title, name)
        self.picker.setCurrentIndex(names.index(current) if current in names else 0)
        self.picker.blockSignals(False)
        self.picker_row.setVisible(len(names) > 1)
        self._show(self.picker.currentData())

    @property
    def technique(self) -> str | None:
        return self.picker.currentData() if self.picker.count() else None

    def set_technique(self, name: str) -> None:
        i = self.picker.findData(name)
        if i < 0:
            raise ValueError(f"technique {name!r} has no plan view here, or does not apply to the model")
        self.picker.setCurrentIndex(i)

    # the view on screen ----------------------------------------------------------
    @property
    def view(self) -> QWidget:
        return self.stack.currentWidget()

    def view_for(self, technique: str) -> QWidget:
        """That technique's plan view, built on first use (shown or not)."""
        view = self._views.get(technique)
        if view is None:
            view = self._views[technique] = plan_view_factory(technique)(self.state)
            self.stack.addWidget(view)
            self._size_by_shown_view()
            if hasattr(view, "run_requested"):
                view.run_requested.connect(self.run_requested)
        return view

    def _size_by_shown_view(self, _index: int = -1) -> None:
        """The stack's least height is the shown view's alone: spatial's run timeline (a line of
        text per lane) scrolled attention offloading's page too at 1024x700."""
        for view in self._views.values():
            shown = self.stack.currentWidget() is view
            view.setSizePolicy(QSizePolicy.Policy.Preferred,
                               QSizePolicy.Policy.Preferred if shown else QSizePolicy.Policy.Ignored)

    def auto_solve(self) -> None:
        self.view.auto_solve()

    def compare(self) -> None:
        self.view.compare()

    def shutdown(self) -> None:
        """Stop every built view's workers (the window calls this when it closes)."""
        for view in self._views.values():
            if hasattr(view, "shutdown"):
                view.shutdown()

    def _show(self, name: str) -> None:
        view = self.view_for(name)
        if self.stack.currentWidget() is not view:
            self.stack.setCurrentWidget(view)
            self.state.use_technique(name)  # its own plan (when it has one) is the one Run runs
            self.technique_changed.emit(name)

    def _on_picker_index_changed(self, _index: int) -> None:
        if self.picker.currentData():
            self._show(self.picker.currentData())
