"""A real run (in-process agents over ZeroMQ, a generated tiny Llama) recorded through
RunRecorder: the workspace holds exactly what the live sinks saw, a replay gives it back
in the same order with the same figures, and the simulator's timeline has the same shape."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import transformers  # noqa: F401  (imported once here: agents' worker threads import it concurrently)

from agents.agent import Agent
from agents.protocol import SamplingSpec
from agents.transport import CurveKeys
from core.models.checkpoints import ModelRecipe, make_model
from core.devices.cluster import Cluster, Device, Link
from core.runs.coordinator import AgentEndpoint, Coordinator, FanoutSink, RunRequest
from core.models.units import model_spec_from_config
from core.planning.plan import plan_from_boundaries
from core.planning.problem import PlanningProblem, Workload
from core.devices.profile import DeviceTimes, Profile
from core.sessions.recording import RunRecorder
from core.sessions.replay import Replay
from core.runs.metrics import LiveMetrics
from core.runs.simulator import simulate
from core.sessions.store import SessionStore

DEVICES = ["src", "mid", "head"]
NEW_TOKENS = 5


class LiveView:
    """What a live view keeps: every item in arrival order, and its metrics."""

    def __init__(self) -> None:
        self.items: list = []
        self.metrics = LiveMetrics()

    def on_event(self, ev) -> None:
        self.items.append(ev)
        self.metrics.add_event(ev)

    def on_tokens(self, tok) -> None:
        self.items.append(tok)
        self.metrics.add_tokens(tok)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    recipe = ModelRecipe(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=5)
    return str(make_model(recipe, tmp_path_factory.mktemp("rec") / "tiny-llama"))


@pytest.fixture(scope="module")
def live_run(model_dir, tmp_path_factory):
    keys = CurveKeys.generate()
    agents = [Agent(d, keys.public).start() for d in DEVICES]
    plan = plan_from_boundaries("tiny-llama", 6, DEVICES, [2, 3])
    path = tmp_path_factory.mktemp("ws") / "ws.sqlite"
    view = LiveView()
    try:
        with Coordinator([AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents], keys) as co:
            co.load(plan, model_dir)
            co.sync_clocks()
            with SessionStore(path) as store:
                run_id = store.create_run(store.create_session("live"), model="tiny-llama", mode="no-bubbles")
                rec = RunRecorder(store, run_id)
                rows = tuple(tuple(range(10 + i, 18 + i)) for i in range(4))
                request = RunRequest(input_ids=rows, attention_mask=tuple((1,) * 8 for _ in rows),
                                     max_new_tokens=NEW_TOKENS, mode="no-bubbles", micro_batches=2,
                                     eos_token_ids=(), sampling=SamplingSpec())
                co.run(plan, request, sink=FanoutSink(view, rec))
                rec.finish("completed")
    finally:
        for a in agents:
            a.close()
    return path, run_id, view, plan


def test_the_workspace_holds_exactly_what_the_live_view_saw_in_the_same_order(live_run):
    path, run_id, view, _ = live_run
    with SessionStore(path) as store:
        items = store.timeline(run_id)
        run = store.run(run_id)
    assert [i.event or i.tokens for i in items] == view.items
    assert run.status == "completed"
    assert run.figures == json.loads(json.dumps(msgspec.to_builtins(view.metrics.figures())))


def test_a_replay_of_the_real_run_shows_the_same_items_and_figures_as_live(live_run):
    path, run_id, view, _ = live_run
    with SessionStore(path) as store:
        replay = Replay.from_store(store, run_id, speed=1e6)
    replayed = LiveView()
    for item in replay.play():
        (replayed.on_event if item.event is not None else replayed.on_tokens)(item.event or item.tokens)
    assert replayed.items == view.items
    assert replayed.metrics.figures() == view.metrics.figures()


def test_the_simulator_predicts_a_timeline_of_the_same_shape_as_the_real_run(live_run, model_dir):
    path, run_id, view, plan = live_run
    config = json.loads((Path(model_dir) / "config.json").read_text())
    spec = model_spec_from_config(config, dtype="fp32", name="tiny-llama")
    times = tuple(DeviceTimes(device=d, decode_batch_sizes=(1,), decode_s=((1e-3,),) * spec.num_units,
                              prefill_token_counts=(1,), prefill_s=((1e-4,),) * spec.num_units) for d in DEVICES)
    cluster = Cluster(devices=tuple(Device(id=d, memory_bytes=1 << 30) for d in DEVICES),
                      links=tuple(Link(src=a, dst=b, bandwidth_mbit_s=1000.0, latency_ms=0.1)
                                  for a in DEVICES for b in DEVICES if a != b))
    problem = PlanningProblem(profile=Profile(model=spec, cluster=cluster, times=times, source="synthetic"),
                              source="src", workload=Workload(prompt_tokens=8, generated_tokens=NEW_TOKENS))
    sim = simulate(problem, plan, "no-bubbles", micro_batches=2, micro_batch_size=2)

    def shape(events):
        return sorted((e.device, e.stage, e.kind, e.phase, e.step, e.micro_batch, e.peer)
                      for e in events if e.kind in ("compute", "send"))

    real_events = [i for i in view.items if hasattr(i, "kind")]
    assert shape(sim.events) == shape(real_events)
    real_tokens = sorted((t.micro_batch, t.step, t.sequence_ids) for t in view.items if hasattr(t, "token_ids"))
    assert sorted((t.micro_batch, t.step, t.sequence_ids) for t in sim.tokens) == real_tokens
