"""Running an expert-offloading plan on agents: the shared run path with ``expert-offload`` stages.

An ``OffloadPlan`` (buffer slots, eviction, preload depth, bit widths) runs as a one-stage
``ShardPlan`` whose stage kind is ``expert-offload``: ``edgeshard run`` and the Run screen
load each stage as its kind (core.runs.generation), so the run, its live timeline (expert
reads, hits, evictions as ``io`` events on the device's storage lane), its recording and
its replay are the shared ones. Each stage carries its settings (``Stage.options``: an
``OffloadOptions`` with the sha256 of every file beside the checkpoint it reads), which go in its
``LoadShard.options``; ``expert-offload.json`` beside the checkpoint is only where the operator's
configuration (and ``adapt-bits``' bit widths) is kept between commands: no agent reads it.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from core.errors import EdgeShardError
from core.models.checkpoints import check_model_dir
from core.planning.plan import ShardPlan, Stage, layout_problems
from core.techniques.expert_offload.problem import OffloadPlan

STAGE_KIND = "expert-offload"
OPTIONS_FILE = "expert-offload.json"


def write_options(plan: OffloadPlan, model_dir: str | Path, bandwidth_bps: float | None = None) -> Path:
    """Write ``plan``'s buffer options into ``model_dir/expert-offload.json`` (other keys kept)."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise EdgeShardError(f"{model_dir}: no config.json; give the checkpoint directory the agents load")
    path = model_dir / OPTIONS_FILE
    try:
        options = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError as err:
        raise EdgeShardError(f"{path} is not JSON ({err}): delete it and configure again") from None
    if plan.bits.avg_bits < 32 and not options.get("expert_bits"):
        raise EdgeShardError(f"the plan's experts are {plan.bits.name}: write the quantised experts first "
                             "(edgeshard moe adapt-bits); only full-precision plans run without them")
    options.update(slots=plan.slots, policy=plan.policy, preload=plan.preload, whole_layers=plan.whole_layers)
    if bandwidth_bps is not None:
        options["bandwidth_bps"] = bandwidth_bps
    path.write_text(json.dumps(options, indent=1))
    return path


def stage_options(model_dir: Path) -> dict:
    """The ``OffloadOptions`` (as ``Stage.options``) that ``model_dir``'s configuration says, with the
    sha256 of the quantised experts and the activation profile where the stage reads them."""
    from agents.techniques.expert_offload.options import PROFILE_FILE, QUANTIZED_FILE, OffloadOptions
    from core.runs.weights import file_digest

    config = json.loads((model_dir / OPTIONS_FILE).read_text())
    bits = tuple(sorted((*map(int, str(k).split(".")), int(b)) for k, b in config.get("expert_bits", {}).items()))
    files = tuple((name, file_digest(model_dir / name)) for name in (QUANTIZED_FILE, PROFILE_FILE)
                  if (model_dir / name).is_file() and (name != QUANTIZED_FILE or bits))
    try:
        options = OffloadOptions(slots=int(config["slots"]), policy=str(config["policy"]),
                                 preload=int(config["preload"]), whole_layers=bool(config.get("whole_layers")),
                                 bandwidth_bps=config.get("bandwidth_bps"), expert_bits=bits, files=files)
    except (KeyError, TypeError, ValueError) as err:
        raise EdgeShardError(f"{model_dir / OPTIONS_FILE}: {err}: delete it and configure again") from None
    if options.problem():
        raise EdgeShardError(f"{model_dir / OPTIONS_FILE}: {options.problem()}: configure again")
    return msgspec.to_builtins(options)


def run_plan(plan: OffloadPlan, model_dir: str | Path, bandwidth_bps: float | None = None,
             sharded: ShardPlan | None = None) -> ShardPlan:
    """The ``ShardPlan`` that runs ``plan`` over ``model_dir`` (whose options it writes): one stage on the
    plan's device, or, given a layer-sharded plan ``sharded``, its stages with every stage that holds
    decoder (MoE) blocks offloading its own blocks' experts (each with the plan's buffer)."""
    info = check_model_dir(model_dir)
    if info.family != "mixtral":
        raise EdgeShardError(f"{model_dir} is a {info.family} model: expert offloading needs a Mixtral (MoE) one")
    if sharded is not None:
        problems = layout_problems(sharded, info.num_units)
        if problems:
            raise EdgeShardError(f"the layer-sharded plan cannot run on {model_dir}: {'; '.join(problems)}")
    options = stage_options(write_options(plan, model_dir, bandwidth_bps).parent)
    if sharded is None:
        stages = (Stage(device=plan.device, start=0, end=info.num_units, kind=STAGE_KIND, options=options),)
    else:
        blocks_end = info.num_units - 1  # units 1 .. L are the decoder blocks
        stages = tuple(msgspec.structs.replace(s, kind=STAGE_KIND, options=options) if s.start < blocks_end and s.end > 1
                       else s for s in sharded.stages)
    return ShardPlan(model=Path(model_dir).name, num_units=info.num_units, stages=stages,
                     strategy=f"expert-offload:{plan.policy}")
