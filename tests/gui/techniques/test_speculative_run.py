"""Starting a speculative run from the Run screen (its Draft model and Speculate k): over agents on
localhost its greedy tokens are transformers' ``generate``'s on the same checkpoint, the timeline
draws the draft's boxes and the trip plot fills; a draft the model cannot verify, or settings a
speculative run cannot take, are refused at Start with one line that says what to do."""

from __future__ import annotations

import pytest

from core.models.checkpoints import ModelRecipe, make_model
from core.planning.plan import plan_from_boundaries
from core.sessions.store import SessionStore
from tests.gui.run_backends import cluster_run_panel

DEVICES = ["spec-src", "spec-head"]
SHAPE = dict(family="llama", hidden=64, heads=4, kv_heads=2)
PROMPT = "the river and its banks"
NEW = 10


@pytest.fixture(scope="module")
def spec_cluster(tmp_path_factory):
    from tests.core.in_process_agents import in_process_cluster

    root = tmp_path_factory.mktemp("gui-speculative")
    target = str(make_model(ModelRecipe(layers=4, vocab=512, seed=3, **SHAPE), root / "tiny-llama"))
    draft = str(make_model(ModelRecipe(layers=1, vocab=512, seed=5, **SHAPE), root / "tiny-llama-draft"))
    other = str(make_model(ModelRecipe(layers=1, vocab=384, seed=5, **SHAPE), root / "other-vocab"))
    plan = plan_from_boundaries("tiny-llama", 6, DEVICES, [3])
    with in_process_cluster(DEVICES) as (coordinator, _):
        yield coordinator, plan, target, draft, other


def test_a_speculative_run_started_on_the_run_screen_gives_transformers_greedy_tokens(qtbot, spec_cluster, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    coordinator, plan, target, draft, _ = spec_cluster
    state, panel = cluster_run_panel(qtbot, coordinator, plan, tmp_path / "ws.sqlite", target, [PROMPT], NEW)
    panel.mode_combo.setCurrentText("sequential")
    combo = panel.speculative_controls.draft_combo
    assert panel.speculative_controls.options() == ("", None)  # none by default; the shipped <name>-draft offered
    assert combo.findData(draft) > 0 and combo.itemText(combo.findData(draft)) == "shipped"
    combo.setCurrentIndex(combo.findData(draft))
    panel.speculative_controls.k_spin.setValue(3)
    with qtbot.waitSignal(panel.run_finished, timeout=60_000) as done:
        panel.start_run()
    assert done.args == ["completed"], panel.message.text()
    panel.monitor.flush()
    got = [t for e in sorted(panel.monitor.tokens, key=lambda e: e.step) for t in e.token_ids]
    ids = AutoTokenizer.from_pretrained(target)(PROMPT, return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert got == want
    assert panel.monitor.timeline.box_count(DEVICES[0], "draft") > 0  # the draft's marks, live
    assert not panel.monitor.trips_plot.isHidden() and sum(panel.monitor.trips_plot.counts) == len(got) - 1
    assert panel.shutdown()
    with SessionStore(state.workspace) as store:  # recorded with the run's settings
        [run] = store.runs()
        assert run.settings["draft_dir"] == draft and run.settings["speculate_k"] == 3


def test_a_seeded_speculative_sampling_run_on_the_run_screen_draws_the_papers_rule_reproducibly(qtbot, spec_cluster,
                                                                                                    tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.core.runs.test_speculative import reference_speculative_sampling

    coordinator, plan, target, draft, _ = spec_cluster
    got = []
    for seed in (11, 11, 12):
        _, panel = cluster_run_panel(qtbot, coordinator, plan, tmp_path / f"ws{len(got)}.sqlite", target, [PROMPT], NEW)
        panel.mode_combo.setCurrentText("sequential")
        panel.pace_check.setChecked(True)  # every token, past EOS, as the reference draws them
        panel.speculative_controls.apply(draft, 3, seed)
        with qtbot.waitSignal(panel.run_finished, timeout=60_000) as done:
            panel.start_run()
        assert done.args == ["completed"], panel.message.text()
        panel.monitor.flush()
        got.append([t for e in sorted(panel.monitor.tokens, key=lambda e: e.step) for t in e.token_ids])
        assert panel.settings().speculate_seed == seed and panel.shutdown()
    assert got[0] == got[1] != got[2]
    ids = AutoTokenizer.from_pretrained(target)(PROMPT)["input_ids"]
    models = [AutoModelForCausalLM.from_pretrained(d).eval() for d in (target, draft)]
    assert got[0] == reference_speculative_sampling(*models, ids, 3, NEW, 11)


def test_the_run_screen_refuses_a_draft_of_another_vocabulary_and_two_prompts_at_start(qtbot, spec_cluster, tmp_path):
    coordinator, plan, target, _, other = spec_cluster
    _, panel = cluster_run_panel(qtbot, coordinator, plan, tmp_path / "ws.sqlite", target, [PROMPT], NEW)
    panel.mode_combo.setCurrentText("sequential")
    panel.speculative_controls.apply(other, 2)
    panel.start_run()
    assert not panel.is_running()
    assert "vocabulary of 384 tokens" in panel.message.text() and "tokenizer" in panel.message.text()
    panel.speculative_controls.apply(target + "-draft", 2)
    panel.prompts_edit.setPlainText("one\ntwo")
    panel.start_run()
    assert not panel.is_running() and "takes one prompt (2 given)" in panel.message.text()
    panel.speculative_controls.apply("", None)  # None: plain decoding, nothing to refuse
    from gui.techniques.speculative import speculative_refusals

    assert speculative_refusals(panel.settings(), panel.state.problem, panel.state.plan) == []  # as Start asks
    assert panel.shutdown()


def test_the_draft_and_k_are_saved_with_the_run_settings_and_restored(qtbot, spec_cluster, tmp_path):
    import json
    from dataclasses import asdict

    from gui.last_workspace import run_settings_from_json

    coordinator, plan, target, draft, _ = spec_cluster
    _, panel = cluster_run_panel(qtbot, coordinator, plan, tmp_path / "ws.sqlite", target, [PROMPT], NEW)
    panel.speculative_controls.apply(draft, 5, 42)
    saved = json.dumps(asdict(panel.settings()))
    _, other = cluster_run_panel(qtbot, coordinator, plan, tmp_path / "ws2.sqlite", "", [PROMPT], NEW)
    other.apply_settings(run_settings_from_json(saved))
    assert other.speculative_controls.options() == (draft, 5) and other.speculative_controls.sample_seed() == 42
    with pytest.raises(ValueError, match="speculate_k"):
        run_settings_from_json(json.dumps({**json.loads(saved), "speculate_k": 9}))
    assert panel.shutdown() and other.shutdown()
