"""Memory model vs measured RSS growth, per technique: prints one JSON line.

``rss_over_predicted`` = {technique: the agent process's measured RSS growth / the planner's
predicted memory}, each on real agent processes (a local cluster) with a model large enough that
the allocator's and the model code's fixed costs are small beside it. Each agent first loads a tiny
model of the same family and kind and lets it go (the model code imported, the allocator warm), so
the growth measured is the stage's, not the first import's. Growth is VmRSS after load and a short
run less VmRSS before the load (RssAnon and RssFile reported beside it); a memory agent's KV hold
ends with its run, so its growth is its peak (VmHWM) during the run.

- layer-sharding: one stage, every unit, KV reserved for the run (``LoadShard.kv``); predicted:
  ``core.planning.precision.stage_weight_bytes`` + the reservation's bytes from the unit table's
  ``kv_bytes_per_token``.
- attention-offload: the memory agent's KV hold (its share of the heads, the run's batch and
  context); predicted: the offload cost model's per-device KV memory (``cost.evaluate``'s
  ``memory_bytes``). The dense agent's weights: ``OffloadModel.weight_bytes``.
- expert-offload: a Mixtral stage with 6 expert slots; predicted: the planner's
  ``cost.evaluate(...).memory_bytes`` (resident weights + slots × expert bytes).
- spatial: three agents, a VGG16 (64², channels / 2) in strips, warmed by the same network with 11
  classes (torch's code at this size) and then a tiny one (which replaces it); each agent's VmRSS growth against
  ``cost.evaluate(...).memory_need`` for its device (the figure: the worst agent).
- phase-disaggregation: an encode, a prefill and a decode agent serving four Llava requests at once;
  each agent's peak (VmHWM) growth against ``memory.device_memory`` for its device (the figure: the agent
  farthest from its prediction).

Run: python bench/memory_fidelity.py [TECHNIQUE ...]  (all of them by default)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import msgspec  # noqa: E402

from core.models.checkpoints import ModelRecipe, make_model  # noqa: E402

MIB = 1 << 20


def memory_of(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of a process, in bytes."""
    out = {}
    for line in open(f"/proc/{pid}/status"):
        key = line.split(":")[0]
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(line.split()[1]) * 1024
    return out


def reset_peak(pid: int) -> None:
    """The process's VmHWM back to its VmRSS (``/proc/PID/clear_refs``), so a peak after it is this step's."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def growth(before: dict, after: dict, key: str = "VmRSS") -> dict:
    """``key`` after less VmRSS before (a peak, VmHWM, is measured from a ``reset_peak`` to it)."""
    return {"measured_mib": round((after[key] - before["VmRSS"]) / MIB, 2),
            "anon_mib": round((after["RssAnon"] - before["RssAnon"]) / MIB, 2),
            "file_mib": round((after["RssFile"] - before["RssFile"]) / MIB, 2)}


def _request(batch: int, prompt: int, new: int):
    from core.runs.run_stream import RunRequest

    ids = tuple(tuple(3 + (7 * i + 13 * j) % 500 for j in range(prompt)) for i in range(batch))
    return RunRequest(input_ids=ids, attention_mask=tuple((1,) * prompt for _ in range(batch)), max_new_tokens=new)


def _with_kind(plan, kind: str):
    return msgspec.structs.replace(plan, stages=tuple(msgspec.structs.replace(s, kind=kind) for s in plan.stages))


def layer_sharding(root: Path, co, lc) -> dict:
    from core.models.units import load_model_spec
    from core.planning.plan import plan_from_boundaries
    from core.planning.precision import stage_weight_bytes
    from core.runs.batching import kv_reservation

    tiny = str(make_model(ModelRecipe(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=1),
                          root / "ls-tiny"))
    model = str(make_model(ModelRecipe(family="llama", layers=8, hidden=512, heads=8, kv_heads=2, vocab=512, seed=1),
                           root / "ls-model"))
    batch, prompt, new = 4, 200, 8
    kv = kv_reservation((tuple(range(batch)),), prompt + new)
    co.load(plan_from_boundaries("tiny", 4, ["ls"], []), tiny, kv=kv_reservation(((0,),), 8))
    co.run(plan_from_boundaries("tiny", 4, ["ls"], []), _request(1, 4, 2))
    co.unload()
    spec = load_model_spec(model, dtype="fp32")
    plan = plan_from_boundaries("model", len(spec.units), ["ls"], [])
    pid = lc.pid_of("ls")
    before = memory_of(pid)
    co.load(plan, model, kv=kv)
    co.run(plan, _request(batch, prompt, new))
    after = memory_of(pid)
    co.unload()
    # what core.planning.cost.memory_of counts for a stage: weights, KV of the sequences resident
    # over the context, the largest unit's workspace per token of a prefill pass
    weights = stage_weight_bytes(spec, 0, len(spec.units))
    kv_bytes = sum(u.kv_bytes_per_token for u in spec.units) * kv.groups * kv.sequences * kv.context_tokens
    workspace = max(u.workspace_bytes_per_token for u in spec.units) * batch * prompt
    return {**growth(before, after), "predicted_mib": round((weights + kv_bytes + workspace) / MIB, 2),
            "weights_mib": round(weights / MIB, 2), "kv_mib": round(kv_bytes / MIB, 2),
            "workspace_mib": round(workspace / MIB, 2)}


def attention_offload(root: Path, co, lc) -> dict:
    from core.techniques.attention_offload import cost
    from core.techniques.attention_offload.problem import OffloadPlan
    from core.techniques.attention_offload.run import checkpoint_model, run_offload
    from core.techniques.attention_offload import scenarios

    tiny = str(make_model(ModelRecipe(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=1),
                          root / "ao-tiny"))
    model_dir = str(make_model(ModelRecipe(family="llama", layers=8, hidden=512, heads=8, kv_heads=2, vocab=512,
                                           seed=1), root / "ao-model"))
    batch, prompt, new = 8, 400, 8
    run_offload(co, tiny, "c", ["m0", "m1"], _request(1, 4, 2))
    co.unload()
    pids = {d: lc.pid_of(d) for d in ("c", "m0", "m1")}
    for p in pids.values():
        reset_peak(p)
    before = {d: memory_of(p) for d, p in pids.items()}
    run_offload(co, model_dir, "c", ["m0", "m1"], _request(batch, prompt, new))
    after = {d: memory_of(p) for d, p in pids.items()}
    co.unload()
    model = checkpoint_model(model_dir)
    base = scenarios.paper()
    problem = msgspec.structs.replace(base, model=model, workload=msgspec.structs.replace(
        base.workload, prompt_tokens=prompt, generated_tokens=new))
    plan = OffloadPlan(compute=(base.devices[0].id,), memory=tuple(d.id for d in base.devices[2:4]),
                       batch=batch, in_flight=1)
    predicted = cost.evaluate(problem, plan)
    memory = {"memory_agent": {**growth(before["m0"], after["m0"], "VmHWM"),
                               "predicted_mib": round(predicted.memory_bytes / MIB, 2)},
              "dense_agent": {**growth(before["c"], after["c"]),
                              "predicted_mib": round(model.weight_bytes / MIB, 2)}}
    return memory


def expert_offload(root: Path, co, lc) -> dict:
    from core.planning.plan import plan_from_boundaries
    from core.techniques.expert_offload.cost import evaluate
    from core.techniques.expert_offload.problem import MoeModel, OffloadPlan, OffloadProblem
    from core.techniques.expert_offload.scenarios import _resident_and_expert_bytes

    slots = 6
    tiny = make_model(ModelRecipe(family="mixtral", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=1,
                                  experts=4), root / "eo-tiny")
    model_dir = make_model(ModelRecipe(family="mixtral", layers=4, hidden=512, heads=8, kv_heads=2, vocab=512, seed=1,
                                       experts=8), root / "eo-model")
    from agents.techniques.expert_offload.options import OffloadOptions

    options = {"eo": OffloadOptions(slots=slots, preload=1)}  # the stage's settings travel in its load message
    tiny_plan = _with_kind(plan_from_boundaries("tiny", 4, ["eo"], []), "expert-offload")
    co.load(tiny_plan, str(tiny), kind="expert-offload", options=options)
    co.run(tiny_plan, _request(1, 4, 2))
    co.unload()
    config = json.loads((Path(model_dir) / "config.json").read_text())
    plan = _with_kind(plan_from_boundaries("model", config["num_hidden_layers"] + 2, ["eo"], []), "expert-offload")
    pid = lc.pid_of("eo")
    before = memory_of(pid)
    co.load(plan, str(model_dir), kind="expert-offload", options=options)
    co.run(plan, _request(2, 32, 16))
    after = memory_of(pid)
    co.unload()
    resident, expert = _resident_and_expert_bytes(str(model_dir), config)
    moe = MoeModel(name="bench", layers=config["num_hidden_layers"], experts=config["num_local_experts"],
                   top_k=int(config.get("num_experts_per_tok", 2)), expert_bytes=expert, resident_bytes=resident,
                   layer_compute_s=1e-3, expert_compute_s=1e-3)
    problem = OffloadProblem(model=moe, device="a", memory_budget_bytes=1 << 40, bandwidth_bps=1e9)
    predicted = evaluate(problem, OffloadPlan(device="a", slots=slots)).memory_bytes
    return {**growth(before, after), "predicted_mib": round(predicted / MIB, 2), "slots": slots,
            "resident_mib": round(resident / MIB, 2), "expert_mib": round(expert / MIB, 3)}


def spatial(root: Path) -> dict:
    """Three agents, a VGG16 (64², channels / 2) split in strips by the planner; growth of each
    agent's VmRSS over the run against ``cost.evaluate(...).memory_need`` for its device."""
    import torch

    from core.devices.agent_link import AgentLink
    from core.devices.local_cluster import LocalCluster
    from core.techniques.spatial.cost import evaluate
    from core.techniques.spatial.problem import CnnRef, SpatialDevice, SpatialProblem, TimeModel
    from core.techniques.spatial.run import run_spatial
    from core.techniques.spatial.strategies import run_strategy

    def problem(image: int, width_div: int, classes: int = 10) -> SpatialProblem:
        devices = tuple(SpatialDevice(id=f"local-{i}", time=TimeModel(a=1 / (g * 1e9), b=1e-4),
                                      bandwidth_Bps=100e6 / 8, latency_s=1e-4) for i, g in enumerate((4.0, 2.0, 1.0)))
        return SpatialProblem(name="bench", model=CnnRef(network="vgg16", image=image, width_div=width_div,
                                                         classes=classes), devices=devices, gateway="local-0")

    with LocalCluster(root / "spatial", 3, threads_per_agent=1) as lc, \
            AgentLink(lc.endpoints, lc.keys, heartbeat_timeout_s=30.0, request_timeout_s=120.0) as link:
        link.wait_ready(timeout_s=60)
        # warm torch's code for this size (a network of the same shapes but 11 classes: 8 MiB of
        # libtorch_cpu.so's pages, file-backed and shared, were first touched by the measured run),
        # then a tiny one, which replaces it on the agents (they keep one network): its weights go
        warm = problem(64, 2, classes=11)
        run_spatial(link, warm, run_strategy(warm, "even").plan, torch.randn(2, 3, 64, 64))
        tiny = problem(32, 8)
        run_spatial(link, tiny, run_strategy(tiny, "even").plan, torch.randn(1, 3, 32, 32))
        big = problem(64, 2)
        plan = run_strategy(big, "even").plan
        pids = {d: lc.pid_of(d) for d in plan.devices}
        before = {d: memory_of(p) for d, p in pids.items()}
        run_spatial(link, big, plan, torch.randn(2, 3, 64, 64))
        after = {d: memory_of(p) for d, p in pids.items()}
    need = evaluate(big, plan).memory_need
    return {d: {**growth(before[d], after[d]), "predicted_mib": round(need.get(d, 0) / MIB, 2)} for d in plan.devices}


EPD_CASES = {
    # name: (Llava recipe, images per request, tiles per image); the first is the one the bench always ran,
    # the others change the tiles per request and the model (vision tower, tile size, text model)
    "vit6x384-64px-8tiles": (dict(layers=6, hidden=512, heads=8, kv_heads=2, intermediate=1408, vision_layers=6,
                                  vision_hidden=384, vision_heads=6, tile=64, patch=8), 2, 4),
    "vit6x384-64px-16tiles": (dict(layers=6, hidden=512, heads=8, kv_heads=2, intermediate=1408, vision_layers=6,
                                   vision_hidden=384, vision_heads=6, tile=64, patch=8), 2, 8),
    "vit4x256-96px-8tiles": (dict(layers=4, hidden=384, heads=6, kv_heads=2, intermediate=1024, vision_layers=4,
                                  vision_hidden=256, vision_heads=4, tile=96, patch=8), 2, 4),
    "vit4x256-96px-2tiles": (dict(layers=4, hidden=384, heads=6, kv_heads=2, intermediate=1024, vision_layers=4,
                                  vision_hidden=256, vision_heads=4, tile=96, patch=8), 1, 2),
}


def phase_disaggregation(root: Path) -> dict:
    """Three agents (encode, prefill, decode) serving a Llava model, four requests at once (the decode
    agent batches them); each agent's peak (VmHWM) growth over load and run against
    ``memory.device_memory`` for its device (weights from the checkpoint's headers, tokens from the
    model's geometry and the workload), for each of ``EPD_CASES`` (two models, two tile counts each),
    each on agents of its own (what one case's model left in an agent's heap would hide the next one's)."""
    from core.devices.local_cluster import LocalCluster
    from core.models.multimodal import TINY_LLAVA, MultimodalRecipe, check_multimodal_dir, make_multimodal_model
    from core.runs.coordinator import Coordinator
    from core.techniques.phase_disaggregation.memory import device_memory, phase_weights
    from core.techniques.phase_disaggregation import runtime
    from core.techniques.phase_disaggregation.types import PhaseCosts, PoolConfig, Request, Workload

    tiny = make_multimodal_model(TINY_LLAVA, root / "epd-tiny")
    pools = PoolConfig(encode=("e",), prefill=("p",), decode=("d",), decode_batch=4)

    def workload(n: int, images: int, tiles: int, prompt: int, output: int) -> Workload:
        return Workload(requests=tuple(Request(id=i, arrival_s=0.0, images=images, tiles_per_image=tiles,
                                               prompt_tokens=prompt, output_tokens=output) for i in range(n)))

    cases = {}
    for name, (recipe, images, tiles) in EPD_CASES.items():
        model = root / f"epd-{recipe['vision_hidden']}"
        if not model.exists():
            make_multimodal_model(MultimodalRecipe(**recipe), model)
        with LocalCluster(root / f"epd-cluster-{name}", list(pools.devices), threads_per_agent=1) as lc, \
                Coordinator(lc.endpoints, lc.keys) as co:
            co.wait_ready(timeout_s=60)
            runtime.run_epd(co.link, tiny, workload(1, 1, 1, 4, 2), pools)
            co.unload()
            pids = {d: lc.pid_of(d) for d in pools.devices}
            for p in pids.values():
                reset_peak(p)
            before = {d: memory_of(p) for d, p in pids.items()}
            work = workload(4, images, tiles, 32, 16)
            runtime.run_epd(co.link, model, work, pools)
            after = {d: memory_of(p) for d, p in pids.items()}
        info = check_multimodal_dir(model)
        costs = PhaseCosts(encode_s_per_tile=1.0, mm_tokens_per_tile=info.tokens_per_tile, prefill_s_per_token=1.0,
                           decode_step_s=((1, 1.0),), mm_token_bytes=info.hidden * 4,
                           kv_token_bytes=info.layers * 2 * info.kv_heads * info.head_dim * 4, link_bandwidth_Bps=1e9)
        weights = phase_weights(model)
        need = device_memory(weights, costs, work, pools)
        # a request's tokens and KV are held during the run only: each agent's growth is its peak (VmHWM)
        cases[name] = {d: {**growth(before[d], after[d], "VmHWM"), "predicted_mib": round(need[d] / MIB, 2)}
                       for d in pools.devices} | {
            "weights_mib": {"encode": round(weights.encode_bytes / MIB, 2), "text": round(weights.text_bytes / MIB, 2)}}
    return cases


def _agents_of(cases: dict) -> dict:
    """Every (case, agent) figure of ``phase_disaggregation`` by 'case/agent'."""
    return {f"{c}/{d}": v for c, f in cases.items() for d, v in f.items() if d != "weights_mib"}


ON_ONE_CLUSTER = {"layer-sharding": layer_sharding, "expert-offload": expert_offload,
                  "attention-offload": attention_offload}


def main(only: list[str]) -> None:
    """``only``: the techniques to measure (every one when empty)."""
    from core.devices.local_cluster import LocalCluster
    from core.runs.coordinator import Coordinator

    t0 = time.perf_counter()
    figures = {}
    wanted = [t for t in [*ON_ONE_CLUSTER, "phase-disaggregation", "spatial"] if not only or t in only]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # one agent per technique: what one technique's run freed into an agent's heap would hide the next one's growth
        with LocalCluster(root / "cluster", ["ls", "eo", "c", "m0", "m1"], threads_per_agent=1) as lc, \
                Coordinator(lc.endpoints, lc.keys) as co:
            co.wait_ready(timeout_s=60)
            for name in wanted:
                if name in ON_ONE_CLUSTER:
                    figures[name] = ON_ONE_CLUSTER[name](root, co, lc)
        if "phase-disaggregation" in wanted:
            figures["phase-disaggregation"] = phase_disaggregation(root)
        if "spatial" in wanted:
            figures["spatial"] = spatial(root)
    worst = {"spatial": lambda f: max(f.values(), key=lambda v: v["measured_mib"] / v["predicted_mib"]),
             "phase-disaggregation": lambda f: max(_agents_of(f).values(),
                                                   key=lambda v: abs(v["measured_mib"] / v["predicted_mib"] - 1)),
             "attention-offload": lambda f: f["memory_agent"]}
    ratios = {name: worst.get(name, lambda f: f)(f) for name, f in figures.items()}
    if "phase-disaggregation" in figures:  # each EPD agent's worst case
        for agent in ("e", "p", "d"):
            ratios[f"phase-disaggregation-{agent}"] = max(
                (v for k, v in _agents_of(figures["phase-disaggregation"]).items() if k.endswith(f"/{agent}")),
                key=lambda v: abs(v["measured_mib"] / v["predicted_mib"] - 1))
    if "attention-offload" in figures:
        ratios["attention-offload-dense"] = figures["attention-offload"]["dense_agent"]
    print(json.dumps({
        "bench": "memory_fidelity",
        "rss_over_predicted": {k: round(v["measured_mib"] / v["predicted_mib"], 3) for k, v in ratios.items()},
        "within_20pct": {k: abs(v["measured_mib"] / v["predicted_mib"] - 1) <= 0.2 for k, v in ratios.items()},
        "figures": figures,
        "elapsed_s": round(time.perf_counter() - t0, 1),
        "loadavg": open("/proc/loadavg").read().split()[:3],
    }))


if __name__ == "__main__":
    main(sys.argv[1:])
