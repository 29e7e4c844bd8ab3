"""A real, long-running run backend for the Run/Sessions screen tests: it plays a
simulated run's events and tokens on a worker thread at their own pace (scaled by
``speed``), through the same sink and reporter a coordinator run uses."""

from __future__ import annotations

import threading
import time

import msgspec

from agents.protocol import TimelineEvent
from core.errors import RunFailed
from core.planning.plan import plan_from_boundaries
from core.reporting import Cancelled
from core.runs.simulator import simulate
from tests.gui.problems import make_problem

DEVICES = ["phone", "laptop", "server"]


def simulated_run(generated_tokens: int = 8, micro_batches: int = 2):
    problem = make_problem()
    plan = plan_from_boundaries("tiny-llama", 10, DEVICES, [2, 6], micro_batches=micro_batches)
    result = simulate(problem, plan, "no-bubbles", micro_batches=micro_batches, micro_batch_size=1,
                      generated_tokens=generated_tokens)
    tokens = [msgspec.structs.replace(t, text=tuple(f" w{t.step}.{s}" for s in t.sequence_ids))
              for t in result.tokens]
    return problem, plan, list(result.events), tokens


class PacedBackend:
    """Emits ``events``/``tokens`` in arrival order, ``speed`` times faster than recorded;
    ``repeat`` plays the run again and again (a run that only ends when stopped)."""

    def __init__(self, events, tokens, speed: float = 1.0, repeat: bool = False, fail_after: int | None = None):
        items = [(e.end_s, 0, e) for e in events] + [(t.t_s, 1, t) for t in tokens]
        self.items = sorted(items, key=lambda x: (x[0], x[1]))
        self.speed, self.repeat, self.fail_after = speed, repeat, fail_after
        self._stop = threading.Event()
        self.emitted = 0
        self.thread_names: list[str] = []

    def lanes(self) -> list[str]:
        return list(DEVICES)

    def stop(self) -> None:
        self._stop.set()

    def run(self, settings, sink, reporter):
        self._stop.clear()
        self.thread_names.append(threading.current_thread().name)
        t0 = time.monotonic()
        offset = 0.0
        span = self.items[-1][0] if self.items else 0.0
        while True:
            for at, _, item in self.items:
                due = t0 + (offset + at) / self.speed
                while True:
                    if self._stop.is_set() or reporter.cancel_requested():
                        raise Cancelled()
                    wait = due - time.monotonic()
                    if wait <= 0:
                        break
                    time.sleep(min(wait, 0.01))
                if self.fail_after is not None and self.emitted >= self.fail_after:
                    raise RunFailed("agent stopped answering (heartbeat lost)", device="laptop")
                if isinstance(item, TimelineEvent):
                    sink.on_event(msgspec.structs.replace(item, start_s=item.start_s + offset,
                                                          end_s=item.end_s + offset))
                else:
                    sink.on_tokens(msgspec.structs.replace(item, t_s=item.t_s + offset))
                self.emitted += 1
                reporter.progress(self.emitted, len(self.items))
            if not self.repeat:
                return self.emitted
            offset += span


def cluster_run_panel(qtbot, coordinator, plan, workspace, model_dir: str, prompts, max_tokens: int):
    """The Run screen over live agents (the studio's ``ClusterRunBackend``) with ``plan`` set,
    a fresh workspace and the run's fields filled in; returns ``(state, panel)``."""
    from gui.connection.cluster_backend import ClusterRunBackend
    from gui.screens.run import RunPanel
    from gui.studio_state import StudioState

    state = StudioState()
    state.set_workspace(str(workspace))
    state.set_plan(plan)
    panel = RunPanel(state, ClusterRunBackend(coordinator, state))
    qtbot.addWidget(panel)
    panel.model_edit.setText(model_dir)
    panel.prompts_edit.setPlainText("\n".join(prompts))
    panel.max_tokens_spin.setValue(max_tokens)
    return state, panel
