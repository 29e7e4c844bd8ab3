"""Runs are named by technique wherever they are shown, and their times in words."""

from __future__ import annotations

from datetime import datetime, timezone

from core.sessions.store import RunInfo
from gui.screens.run_names import human_time, run_name, run_style, run_title


def _info(run_id=7, mode="no-bubbles", **settings) -> RunInfo:
    return RunInfo(id=run_id, session_id=1, model="demo-llama", mode=mode, kind="measured", status="completed",
                   started_at="2026-12-06T14:32:05.000+00:00", ended_at=None, settings=settings, figures={})


def test_an_attention_offload_run_is_named_by_its_technique_not_a_pipeline_mode():
    info = _info(technique="attention-offload", technique_options={"compute_replicas": 2, "schedule": "rotational"})
    assert run_name(info) == "Attention offloading #7"
    assert run_style(info) == "2 replicas, rotational" and "no-bubbles" not in run_title(info)


def test_an_older_attention_offload_record_is_known_by_its_options():
    assert run_name(_info(technique_options={"compute_replicas": 1, "schedule": "fixed"})).startswith("Attention")


def test_a_layer_sharding_run_keeps_its_pipeline_mode():
    info = _info(technique="layer-sharding")
    assert run_title(info) == "Layer sharding #7 · demo-llama · no-bubbles · completed"


def test_times_read_as_words_relative_to_now():
    now = datetime(2026, 12, 6, 18, 0, tzinfo=timezone.utc).astimezone()
    local = datetime(2026, 12, 6, 14, 32, 5, tzinfo=timezone.utc).astimezone()
    assert human_time("2026-12-06T14:32:05.000+00:00", now) == local.strftime("%H:%M")
    assert human_time("2025-03-01T10:00:00+00:00", now) == "1 Mar 2025"
    assert human_time("not a time", now) == "not a time"


def test_a_replay_starts_just_before_the_runs_first_item_not_at_its_loading():
    from core.sessions.store import RecordedItem
    from gui.screens.sessions import REPLAY_LEAD_S, replay_start_s

    items = [RecordedItem(seq=i, recv_s=t) for i, t in enumerate((0.58, 0.6, 0.72))]
    assert replay_start_s(items) == 0.58 - REPLAY_LEAD_S and replay_start_s([]) == 0.0


def test_a_spatial_run_shows_its_strategy_as_its_style_and_counts_images_not_tokens():
    from gui.screens.run_names import run_count

    info = RunInfo(id=3, session_id=1, model="resnet-style-32-w8", mode="sequential", kind="measured",
                   status="completed", started_at="2026-12-06T14:32:05.000+00:00", ended_at=None,
                   settings={"technique": "spatial", "strategy": "fused"}, figures={"tokens": 10})
    assert run_style(info) == "fused" and run_count(info) == "10 images"
    tokens = RunInfo(id=4, session_id=1, model="demo-llama", mode="no-bubbles", kind="measured", status="completed",
                     started_at="2026-12-06T14:32:05.000+00:00", ended_at=None, settings={}, figures={"tokens": 64})
    assert run_count(tokens) == "64" and run_count(_info()) == ""  # a language model's tokens; none recorded


def test_an_expert_offload_run_is_styled_by_its_expert_buffer_in_the_sessions_list(qtbot, tmp_path):
    """Recorded as ``run_box.run_job`` records it (mode "sequential", its buffer in its plan's stage options),
    the Sessions list's Style read blank; it names the buffer's policy, slots and preload."""
    from core.planning.plan import ShardPlan, Stage
    from core.sessions.recording import record_run
    from tests.gui.opened_run import sessions_with_run_open

    options = {"slots": 8, "policy": "lru", "preload": 2, "whole_layers": False}
    plan = ShardPlan(model="demo-moe", num_units=4, stages=(Stage(device="phone", start=0, end=4,
                                                                  kind="expert-offload", options=options),))
    workspace = str(tmp_path / "ws.sqlite")
    with record_run(workspace, model="demo-moe", mode="sequential", plan=plan,
                    settings={"prompts": ["a"], "lanes": ["phone"], "technique": "expert-offload"}) as run:
        run.status = "completed"
    panel = sessions_with_run_open(qtbot, workspace, run.run_id)
    item = panel.run_items()[run.run_id]
    assert item.text(1) == "LRU, 8 slots, preload 2"
    assert run_title(panel.loaded.info) == "MoE expert offloading #1 · demo-moe · LRU, 8 slots, preload 2 · completed"
    assert panel.shutdown()


def test_a_whole_layers_expert_buffer_is_named_so_and_a_buffer_not_recorded_leaves_the_style_blank():
    from gui.screens.run_names import buffer_style

    assert buffer_style({"slots": 4, "policy": "edgemoe", "preload": 0, "whole_layers": True}) == "whole layers, 4 slots"
    assert buffer_style({"slots": 1, "policy": "edgemoe"}) == "EdgeMoE, 1 slot"
    assert run_style(_info(technique="expert-offload", mode="sequential")) == ""
