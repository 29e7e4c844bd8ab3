"""How a recorded run is named wherever the studio shows it (Sessions, Compare, exports): by its
technique first ("Attention offloading #12"), its run style after ("2 replicas, rotational", a
pipeline mode, "pools"), and its start in words ("today 14:32") rather than an ISO stamp.

A run's technique is what it recorded (``settings["technique"]``: the Run screen, the CLI's
technique verbs, spatial and EPD records); older Run-screen records of attention offloading are
known by their technique options. Pure functions over ``RunInfo``: no widgets here.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import msgspec

from core.sessions.store import RunInfo
from core.techniques import UnknownTechnique, technique_named
from gui.widgets import counted

LAYER_SHARDING = "layer-sharding"


def run_technique(info: RunInfo) -> str:
    """The technique's name the run recorded (layer sharding when it recorded none)."""
    settings = info.settings or {}
    named = settings.get("technique")
    if isinstance(named, str) and named:
        return named
    if (settings.get("technique_options") or {}).get("compute_replicas"):
        return "attention-offload"  # recorded by the Run screen before runs carried their technique
    return LAYER_SHARDING


def technique_label(name: str) -> str:
    """The technique's title without its paper ("Attention offloading"), or its name if unknown."""
    try:
        return technique_named(name).title.split(" (")[0]
    except UnknownTechnique:
        return name


def run_style(info: RunInfo) -> str:
    """How the run ran, in the technique's own terms: layer sharding's pipeline mode; attention
    offloading's replicas and staggering; EPD's pools (never a pipeline mode it did not use)."""
    technique = run_technique(info)
    if technique == LAYER_SHARDING:
        return info.mode
    settings = info.settings or {}
    if technique == "spatial":  # the strip strategy it ran (fused, even, ...)
        return str(settings.get("strategy") or "")
    if technique == "attention-offload":
        options = settings.get("technique_options") or {}
        replicas = int(options.get("compute_replicas") or 1)
        schedule = options.get("schedule") or settings.get("schedule") or ""
        return f"{replicas} replica{'s' if replicas > 1 else ''}" + (f", {schedule}" if replicas > 1 and schedule else "")
    if technique == "expert-offload":  # its expert buffer (read from its recorded plan: with_expert_buffer)
        return buffer_style(settings.get("expert_buffer") or {})
    return info.mode if info.mode not in ("sequential", "bubbles", "no-bubbles") else ""


POLICY_NAMES = {"edgemoe": "EdgeMoE", "lru": "LRU", "lfu": "LFU"}


def buffer_style(buffer: dict) -> str:
    """An expert buffer in words: "EdgeMoE, 8 slots, preload 2", "whole layers, 8 slots" ("" unknown)."""
    if not buffer.get("slots"):
        return ""
    policy = "whole layers" if buffer.get("whole_layers") else POLICY_NAMES.get(buffer.get("policy"), buffer.get("policy"))
    preload = int(buffer.get("preload") or 0)
    return ", ".join(p for p in (policy, counted(int(buffer["slots"]), "slot"), preload and f"preload {preload}") if p)


def with_expert_buffer(store, info: RunInfo) -> RunInfo:
    """``info`` with an expert-offload run's buffer (``settings["expert_buffer"]``: policy, slots, preload,
    whole layers) read from the stage options of the plan it recorded, which is where the run kept it."""
    if run_technique(info) != "expert-offload" or info.plan_id is None or "expert_buffer" in (info.settings or {}):
        return info
    from core.errors import StoreError

    try:
        stages = store.plan(info.plan_id).stages
    except StoreError:  # an unreadable plan costs the run its style, not the list
        return info
    options = next((s.options or {} for s in stages if s.kind == "expert-offload"), {})
    buffer = {k: options[k] for k in ("policy", "slots", "preload", "whole_layers") if k in options}
    return msgspec.structs.replace(info, settings={**(info.settings or {}), "expert_buffer": buffer})


def run_count(info: RunInfo) -> str:
    """What the run produced, counted in its own unit: a spatial run's images ("10 images"), any other's tokens."""
    count = (info.figures or {}).get("tokens")
    if count is None:
        return ""
    return counted(count, "image") if run_technique(info) == "spatial" else str(count)


def run_model_name(state, model_dir: str) -> str:
    """The model a run is recorded under: the studio's model name, unless the run loads another
    checkpoint than the studio's model (the demo's MoE after *Use for Run*: its runs were recorded
    and replayed as "demo-llama"), then that checkpoint's folder."""
    name, path = getattr(state, "model_name", ""), getattr(state, "model_path", "")
    if name and (not path or not model_dir or Path(path).resolve() == Path(model_dir).resolve()):
        return name
    return Path(model_dir).name or name


def run_name(info: RunInfo) -> str:
    """The run's short name: technique and id ("Layer sharding #12")."""
    return f"{technique_label(run_technique(info))} #{info.id}"


def run_title(info: RunInfo) -> str:
    """The run's one-line title: name, model, style, status ("Layer sharding #12 · demo-llama · no-bubbles · completed")."""
    return " · ".join(p for p in (run_name(info), info.model, run_style(info), info.status) if p)


def run_plan(info: RunInfo) -> str:
    """The stored plan the run started on ("plan 3"), and the one it finished on when a lost device re-planned
    it ("plan 3, re-planned to 5"); "" for a run recorded without a plan."""
    if info.plan_id is None:
        return ""
    return f"plan {info.plan_id}" + (f", re-planned to {info.final_plan_id}" if info.final_plan_id is not None else "")


def human_time(iso: str, now: datetime | None = None) -> str:
    """A recorded UTC ISO time in the local zone, in words: "14:32" today, "yesterday 14:32",
    "3 Dec 14:32" this year, "3 Dec 2025" before; the text itself when it is not a time."""
    try:
        t = datetime.fromisoformat(iso)
    except (TypeError, ValueError):
        return str(iso or "")
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    now = (now or datetime.now(timezone.utc)).astimezone()
    t = t.astimezone(now.tzinfo)
    if t.date() == now.date():
        return t.strftime("%H:%M")
    if t.date() == (now - timedelta(days=1)).date():
        return "yesterday " + t.strftime("%H:%M")
    if t.year == now.year:
        return f"{t.day} {t.strftime('%b %H:%M')}"
    return f"{t.day} {t.strftime('%b %Y')}"
