"""Screenshots of the attention-offload plan view (docs/screenshots/attention-offload-*.png).

QT_QPA_PLATFORM=xcb xvfb-run -a -s "-screen 0 1600x1000x24" python scripts/screenshot_attention_offload.py
"""

from __future__ import annotations

from pathlib import Path

from gui import app as studio_app
from gui.screens.plan import PlanScreen
from gui.studio_state import StudioState

OUT = Path(__file__).resolve().parent.parent / "docs" / "screenshots"


class _Agents:
    """Connected agents as the view sees them (names only): the *Run on agents* row's mapping."""

    endpoints = ("orin", "minipc-0", "minipc-1")


def main() -> int:
    import tempfile

    from core.models.checkpoints import ModelRecipe, make_model

    app = studio_app.create_app()
    state = StudioState()
    screen = PlanScreen(state)
    screen.set_technique("attention-offload")
    view = screen.view
    screen.show()
    tmp = tempfile.mkdtemp()
    model = make_model(ModelRecipe(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512), Path(tmp) / "m")
    for i, (scenario, strategy, w, h) in enumerate((("paper", "exact", 1024, 700), ("edge", "exact", 1600, 1000),
                                                     ("paper", "layer-sharding", 1600, 1000))):
        if i == 1:  # agents connected and a checkpoint chosen: Run on agents maps the split onto them
            state.set_agents(_Agents())
            state.set_model("tiny-llama", path=str(model))
        view.scenario.setCurrentText(scenario)
        view.strategy.setCurrentText(strategy)
        view.compare()
        screen.resize(w, h)
        for _ in range(5):
            app.processEvents()
        path = OUT / f"attention-offload-{scenario}-{strategy}-{w}x{h}.png"
        screen.grab().save(str(path))
        print(path)
    screen.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
