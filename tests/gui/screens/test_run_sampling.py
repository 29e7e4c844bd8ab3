"""The Run screen's OpenAI frequency and presence penalties (``edgeshard run --frequency-penalty /
--presence-penalty``): a value outside [-2, 2] or not a number is refused at Start with one line that
says the range; a run over agents on localhost applies them as OpenAI's rule does in a plain torch
greedy loop; they are recorded with the run and restored at the next launch."""

from __future__ import annotations

import pytest

from core.models.checkpoints import ModelRecipe, make_model
from core.planning.plan import plan_from_boundaries
from core.sessions.store import SessionStore
from gui.last_workspace import run_settings_from_json
from gui.screens.run import RunPanel, RunSettings
from gui.studio_state import StudioState
from tests.gui.run_backends import PacedBackend, cluster_run_panel, simulated_run

DEVICES = ["pen-src", "pen-head"]
PROMPT = "the river and its banks"
NEW = 12
FREQUENCY, PRESENCE = 1.5, 0.5


@pytest.fixture(scope="module")
def penalty_cluster(tmp_path_factory):
    from tests.core.in_process_agents import in_process_cluster

    root = tmp_path_factory.mktemp("gui-openai-penalties")
    model = str(make_model(ModelRecipe(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=320, seed=7),
                           root / "tiny-llama"))
    plan = plan_from_boundaries("tiny-llama", 4, DEVICES, [2])
    with in_process_cluster(DEVICES) as (coordinator, _):
        yield coordinator, plan, model


def _panel(qtbot) -> RunPanel:
    problem, plan, events, tokens = simulated_run(generated_tokens=4)
    state = StudioState()
    state.set_profile(problem.profile, source=problem.source, workload=problem.workload)
    state.set_plan(plan)
    panel = RunPanel(state, PacedBackend(events, tokens, speed=8.0))
    qtbot.addWidget(panel)
    return panel


@pytest.mark.parametrize("frequency, presence, said", [
    ("2.5", "", "Frequency penalty must be a finite number in [-2, 2] (0 = off), got 2.5"),
    ("", "-3", "Presence penalty must be a finite number in [-2, 2] (0 = off), got -3.0"),
    ("", "lots", "Presence penalty 'lots' is not a number: enter one in [-2, 2] (0 = off)."),
])
def test_an_openai_penalty_outside_minus_2_to_2_is_refused_at_start_saying_the_range(qtbot, frequency, presence, said):
    panel = _panel(qtbot)
    panel.sampling.openai_edits["frequency_penalty"].setText(frequency)
    panel.sampling.openai_edits["presence_penalty"].setText(presence)
    panel.start_run()
    assert not panel.is_running()
    assert panel.message.isVisibleTo(panel) and said in panel.message.text()
    panel.shutdown()


def test_the_openai_penalties_are_off_by_default_and_restored_from_the_last_workspace(qtbot):
    panel = _panel(qtbot)
    assert (panel.settings().frequency_penalty, panel.settings().presence_penalty) == (0.0, 0.0)
    saved = RunSettings(model_dir="", prompts=("a",), max_new_tokens=4, mode="sequential", micro_batches=None,
                        frequency_penalty=-1.25, presence_penalty=2.0)
    panel.apply_settings(saved)
    assert (panel.settings().frequency_penalty, panel.settings().presence_penalty) == (-1.25, 2.0)
    assert run_settings_from_json('{"model_dir": "", "prompts": ["a"], "max_new_tokens": 4, "mode": "sequential", "micro_batches": null, '
                                  '"presence_penalty": 0.5}').presence_penalty == 0.5
    with pytest.raises(ValueError, match="frequency_penalty = 3"):
        run_settings_from_json('{"model_dir": "", "prompts": ["a"], "max_new_tokens": 4, "mode": "sequential", "micro_batches": null, '
                               '"frequency_penalty": 3}')
    panel.shutdown()


def _greedy_with_openai_penalties(model_dir: str, frequency: float, presence: float) -> list[int]:
    """A plain torch greedy loop applying OpenAI's rule to the generated tokens (no EOS stop)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(PROMPT, return_tensors="pt").input_ids[0].tolist()
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out: list[int] = []
    with torch.no_grad():
        for _ in range(NEW):
            logits = model(torch.tensor([ids + out])).logits[0, -1].float()
            for token in set(out):
                logits[token] -= out.count(token) * frequency + presence
            out.append(int(logits.argmax()))
    return out


def test_the_openai_penalties_set_on_the_run_screen_shape_the_agents_greedy_tokens_as_openais_rule(
        qtbot, penalty_cluster, tmp_path):
    coordinator, plan, model = penalty_cluster
    want = _greedy_with_openai_penalties(model, FREQUENCY, PRESENCE)
    assert want != _greedy_with_openai_penalties(model, 0.0, 0.0)  # the penalties change this text
    state, panel = cluster_run_panel(qtbot, coordinator, plan, tmp_path / "ws.sqlite", model, [PROMPT], NEW)
    panel.mode_combo.setCurrentText("sequential")
    panel.pace_check.setChecked(True)  # every token, as the reference loop generates them
    panel.sampling.openai_edits["frequency_penalty"].setText(str(FREQUENCY))
    panel.sampling.openai_edits["presence_penalty"].setText(str(PRESENCE))
    with qtbot.waitSignal(panel.run_finished, timeout=60_000) as done:
        panel.start_run()
    assert done.args == ["completed"], panel.message.text()
    panel.monitor.flush()
    got = [t for e in sorted(panel.monitor.tokens, key=lambda e: e.step) for t in e.token_ids]
    assert got == want
    assert panel.shutdown()
    with SessionStore(state.workspace) as store:  # recorded with the run's settings
        [run] = store.runs()
        assert (run.settings["frequency_penalty"], run.settings["presence_penalty"]) == (FREQUENCY, PRESENCE)
