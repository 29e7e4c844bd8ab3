"""Screenshots of a real expert-offload run in the Run monitor, with the expert heat map
(docs/screenshots/expert-heat-map-*.png): a generated Mixtral (4 blocks x 8 experts) run by
`edgeshard run` on a loopback agent with a 6-slot buffer, preload 1, storage at 200 MB/s;
the recorded run is fed to the monitor as a replay feeds it.

QT_QPA_PLATFORM=xcb xvfb-run -a -s "-screen 0 1600x1000x24" python scripts/screenshot_expert_heat_map.py
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path

from core import formats
from core.cli import main as cli_main
from core.models.checkpoints import ModelRecipe, make_model
from core.sessions.store import SessionStore
from core.techniques.expert_offload.problem import OffloadPlan
from gui import app as studio_app
from gui.screens.run_monitor import RunMonitorView

OUT = Path(__file__).resolve().parent.parent / "docs" / "screenshots"
PROMPTS = ["the cat sat on the", "a river runs through", "hello there"]


def recorded_run(folder: Path):
    model = make_model(ModelRecipe(family="mixtral", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=7,
                                   experts=8), folder / "tiny-mixtral")
    formats.save(folder / "offload.json", OffloadPlan(device="edge-0", slots=6, preload=1))
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli_main(["moe", "configure", str(folder / "offload.json"), str(model), "--run-plan",
                         str(folder / "run.json"), "--bandwidth-mbps", "200"]) == 0
        argv = ["run", "--model", str(model), "--plan", str(folder / "run.json"), "--local",
                "--max-new-tokens", "16", "--workspace", str(folder / "ws.sqlite")]
        for p in PROMPTS:
            argv += ["--prompt", p]
        assert cli_main(argv) == 0
    with SessionStore(folder / "ws.sqlite") as store:
        [run] = store.runs(store.sessions()[0].id)
        return store.timeline(run.id)


def main() -> int:
    app = studio_app.create_app()
    with tempfile.TemporaryDirectory() as tmp:
        items = recorded_run(Path(tmp))
    monitor = RunMonitorView()
    monitor.reset(["edge-0", "edge-0:storage"], PROMPTS)
    monitor.add_timeline_events([i.event for i in items if i.event is not None])
    monitor.add_token_events([i.tokens for i in items if i.tokens is not None])
    monitor.flush()
    monitor.show()
    for w, h, measure in ((1024, 700, "activations"), (1600, 1000, "hit rate")):
        monitor.heat_map.set_measure(measure)
        monitor.resize(w, h)
        for _ in range(10):
            app.processEvents()
        path = OUT / f"expert-heat-map-{w}x{h}.png"
        monitor.grab().save(str(path))
        print(path, monitor.heat_map.summary.text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
