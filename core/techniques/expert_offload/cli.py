"""``edgeshard moe ...``: the technique's own verbs (registered through Technique.register_cli).

scenario writes a problem; compare/plan read one; configure writes a plan's buffer options
beside a checkpoint (``expert-offload.json``), which agents loading the ``expert-offload``
stage kind read. Errors are one line (EdgeShardError), exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import msgspec

from core.arguments import float_in, int_in
from core.formats import load, save


def register(sub: argparse._SubParsersAction) -> None:
    top = sub.add_parser("moe", help="MoE expert offloading (EdgeMoE): scenario, compare, plan, configure",
                         description="Experts on storage, a bounded expert buffer (docs/expert-offload.md).")
    verbs = top.add_subparsers(dest="moe_command", metavar="VERB", required=True)

    s = verbs.add_parser("scenario", help="write a problem shaped like EdgeMoE's setting (assumed sizes and times)")
    s.add_argument("--budget-fraction", type=float_in(0.0, 1.0, lo_open=True), default=0.25,
                   help="memory budget as a fraction of the whole model")
    s.add_argument("--bandwidth-mbps", type=float_in(0.0, 1e6, lo_open=True), default=200.0,
                   help="storage read bandwidth, MB/s")
    s.add_argument("--out", required=True, metavar="PROBLEM.json")
    s.add_argument("--activations", metavar="FILE", help="expert-activations.json (profile-activations): its "
                   "measured top-k recall replaces the assumed one")
    s.add_argument("--storage", metavar="FILE", help="storage-profile.json (profile-storage): its measured "
                   "read cost (warm: page-cached reads, as local agents find them) replaces --bandwidth-mbps")
    s.add_argument("--bits", metavar="FILE", help="expert-bits.json (adapt-bits): its measured bit options "
                   "(fp32, int8, int4, int2, adapted) replace the assumed ones")
    s.add_argument("--profile", metavar="PROFILE.json", help="a measured profile (edgeshard profile) of this model: "
                   "with --device and --model, the model's sizes come from the checkpoint and its compute times "
                   "from the device's profile instead of the paper-shaped assumptions")
    s.add_argument("--device", metavar="ID", help="with --profile: the device whose times to use")
    s.add_argument("--model", metavar="MODEL_DIR", help="with --profile: the checkpoint (sizes, experts, top-k)")
    s.set_defaults(func=_scenario)

    a = verbs.add_parser("profile-activations", help="offline activation profile: transitions between blocks' "
                         "expert picks on calibration text, and its top-k recall on held-out text")
    a.add_argument("model_dir", metavar="MODEL_DIR")
    a.add_argument("--texts", required=True, metavar="FILE", help="calibration text, one per line")
    a.add_argument("--held-out", required=True, metavar="FILE", help="other text, one per line (recall)")
    a.set_defaults(func=_profile_activations)

    t = verbs.add_parser("profile-storage", help="measure how fast this storage reads the checkpoint's experts")
    t.add_argument("model_dir", metavar="MODEL_DIR")
    t.add_argument("--repeats", type=int_in(1, 100), default=1)
    t.add_argument("--out", metavar="FILE", help="default: MODEL_DIR/storage-profile.json")
    t.set_defaults(func=_profile_storage)

    b = verbs.add_parser("adapt-bits", help="EdgeMoE's expert-wise bit-width adaptation (writes the "
                         "quantised experts beside the checkpoint)")
    b.add_argument("model_dir", metavar="MODEL_DIR")
    b.add_argument("--texts", required=True, metavar="FILE", help="held-out text for perplexity, one per line")
    b.add_argument("--bound", type=float_in(0.0, 1.0, lo_open=True), default=0.05,
                   help="largest relative perplexity increase allowed (0.05 = 5 %%)")
    b.set_defaults(func=_adapt_bits)

    c = verbs.add_parser("compare", help="EdgeMoE and the paper's baselines side by side")
    c.add_argument("problem", metavar="PROBLEM.json")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=_compare)

    p = verbs.add_parser("plan", help="one strategy's plan")
    p.add_argument("problem", metavar="PROBLEM.json")
    p.add_argument("--strategy", choices=("edgemoe", "io-free", "io-exp", "io-qexp", "sti"), default="edgemoe")
    p.add_argument("--out", metavar="PLAN.json")
    p.set_defaults(func=_plan)

    g = verbs.add_parser("configure", help="write a plan's buffer options beside a checkpoint for its agents")
    g.add_argument("plan", metavar="PLAN.json")
    g.add_argument("model_dir", metavar="MODEL_DIR")
    g.add_argument("--bandwidth-mbps", type=float_in(0.0, 1e6, lo_open=True), default=None,
                   help="make agents throttle expert reads to this (emulate slower storage)")
    g.add_argument("--run-plan", metavar="RUN_PLAN.json",
                   help="also write the plan `edgeshard run --plan` runs: one expert-offload stage on the "
                        "plan's device (its live timeline shows expert reads on a storage lane)")
    g.add_argument("--sharded", metavar="SHARD_PLAN.json",
                   help="with --run-plan: a layer-sharded plan (edgeshard plan) whose every stage holding MoE "
                        "blocks offloads its own blocks' experts, each with the plan's buffer")
    g.set_defaults(func=_configure)


def _problem(path: str):
    from core.techniques.expert_offload.problem import OffloadProblem

    return load(path, OffloadProblem)


def _scenario(args) -> int:
    from core.errors import EdgeShardError
    from core.techniques.expert_offload.scenarios import measured, paper_shaped

    given = [name for name in ("profile", "device", "model") if getattr(args, name)]
    if given and len(given) != 3:
        raise EdgeShardError("--profile, --device and --model go together (the profile's device times for "
                             "this checkpoint)")
    if given:
        from core.devices.profile import Profile, profile_errors
        from core.errors import FormatError
        from core.techniques.expert_offload.scenarios import from_profile

        profile = load(args.profile, Profile)
        errors = profile_errors(profile)
        if errors:
            field, _, msg = errors[0].partition(": ")
            raise FormatError(args.profile, msg, field)
        problem = from_profile(profile, args.device, args.model, args.budget_fraction, args.bandwidth_mbps * 1e6)
    else:
        problem = paper_shaped(args.budget_fraction, args.bandwidth_mbps * 1e6)
    problem = measured(problem, activations=args.activations, storage=args.storage, bits=args.bits)
    save(args.out, problem)
    print(f"wrote {args.out}")
    return 0


def _profile_activations(args) -> int:
    from core.reporting import TerminalReporter
    from core.techniques.expert_offload.profiling import (
        ACTIVATIONS_FILE, activation_profile, read_texts, require_moe,
    )

    require_moe(args.model_dir)  # before a tokenizer or the model is loaded
    texts, held_out = read_texts(args.texts, args.model_dir), read_texts(args.held_out, args.model_dir)
    out = activation_profile(args.model_dir, texts, held_out, TerminalReporter())
    recall = "n/a" if out["recall"] is None else f"{out['recall']:.3f}"
    print(f"top-{out['top_k']} recall on {out['held_out_texts']} held-out texts: {recall}; "
          f"wrote {Path(args.model_dir) / 'expert-profile.safetensors'} and {Path(args.model_dir) / ACTIVATIONS_FILE}")
    return 0


def _profile_storage(args) -> int:
    from core.formats import check_writable
    from core.reporting import TerminalReporter
    from core.techniques.expert_offload.profiling import STORAGE_FILE, require_moe, storage_bandwidth

    require_moe(args.model_dir)  # before a tokenizer or the model is loaded
    path = Path(args.out) if args.out else Path(args.model_dir) / STORAGE_FILE
    check_writable(path)
    out = storage_bandwidth(args.model_dir, args.repeats, TerminalReporter())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    cold = "" if out["caches_dropped"] else " (page cache could not be dropped: may be the cache's speed)"
    w = out["warm"]
    print(f"{out['bytes'] / 1e6:.1f} MB in {out['seconds']:.3f} s: {out['bandwidth_bps'] / 1e6:.0f} MB/s{cold}; "
          f"from the page cache {w['read_s'] * 1e3:.3f} ms an expert ({w['fixed_s'] * 1e3:.3f} ms fixed + "
          f"{w['bandwidth_bps'] / 1e6:.0f} MB/s); wrote {path}")
    return 0


def _adapt_bits(args) -> int:
    from core.reporting import TerminalReporter
    from core.techniques.expert_offload.profiling import BITS_FILE, bit_options, read_texts, require_moe

    require_moe(args.model_dir)  # before a tokenizer or the model is loaded
    out = bit_options(args.model_dir, read_texts(args.texts, args.model_dir), args.bound, TerminalReporter())
    adapted = out["options"][-1]
    if out["upper_bits"] is None:
        split = "no width keeps the model within the bound: every expert stays fp32"
    else:
        split = (f"{out['low_experts']} of {out['experts']} experts at INT{out['lower_bits']}, the rest "
                 f"INT{out['upper_bits']}")
    print(f"perplexity fp32 {out['perplexity_fp32']:.2f}, uniform INT4 {out['perplexity_int4']:.2f}, adapted "
          f"{out['perplexity_adapted']:.2f} ({split}; {adapted['avg_bits']:.2f} bits per expert weight, "
          f"{out['evaluations']} evaluations); wrote {Path(args.model_dir) / BITS_FILE} and the quantised experts")
    return 0


def _compare(args) -> int:
    from core.techniques import technique_named

    problem = _problem(args.problem)
    outs = technique_named("expert-offload").compare(problem, "latency")
    if args.json:
        rows = [{"strategy": o.strategy, "status": o.status, "error": o.error, "tokens_per_s": o.tokens_per_s,
                 "plan": msgspec.to_builtins(o.plan) if o.plan else None,
                 "memory_bytes": o.cost.memory_bytes if o.cost else None} for o in outs]
        print(json.dumps({"format": "edgeshard.expert-offload-comparison", "version": 1, "strategies": rows},
                         indent=2))
        return 0
    print(f"{problem.model.name}: budget {problem.memory_budget_bytes / 1e6:.0f} MB, "
          f"storage {problem.bandwidth_bps / 1e6:.0f} MB/s")
    print(f"  {'strategy':<8} {'tokens/s':>9} {'slots':>6} {'bits':>10} {'preload':>8} {'MB':>7}  status")
    for o in outs:
        if o.cost is None:
            print(f"  {o.strategy:<8} {'—':>9} {'—':>6} {'—':>10} {'—':>8} {'—':>7}  {o.status}: {o.error}")
            continue
        print(f"  {o.strategy:<8} {o.tokens_per_s:9.2f} {o.plan.slots:>6} {o.plan.bits.name:>10} "
              f"{o.plan.preload:>8} {o.cost.memory_bytes / 1e6:7.0f}  {o.status}")
    return 0


def _plan(args) -> int:
    from core.errors import EdgeShardError
    from core.techniques.expert_offload.strategies import run_strategy

    out = run_strategy(_problem(args.problem), args.strategy)
    if out.plan is None:
        raise EdgeShardError(out.error)
    if args.out:
        save(args.out, out.plan)
    sys.stdout.write(msgspec.json.encode(out.plan).decode() + "\n")
    return 0


def _configure(args) -> int:
    from core.errors import EdgeShardError
    from core.techniques.expert_offload.problem import OffloadPlan
    from core.techniques.expert_offload.running import run_plan, write_options

    plan = load(args.plan, OffloadPlan)
    bandwidth = None if args.bandwidth_mbps is None else args.bandwidth_mbps * 1e6
    if args.sharded and not args.run_plan:
        raise EdgeShardError("--sharded needs --run-plan RUN.json (the sharded plan with expert-offload stages)")
    if args.run_plan:
        from core.planning.plan import ShardPlan

        sharded = load(args.sharded, ShardPlan) if args.sharded else None
        save(args.run_plan, run_plan(plan, args.model_dir, bandwidth, sharded))
        print(f"wrote {Path(args.model_dir) / 'expert-offload.json'} and {args.run_plan} "
              f"(run it: edgeshard run --plan {args.run_plan} --model {args.model_dir} ...)")
        return 0
    print(f"wrote {write_options(plan, args.model_dir, bandwidth)}")
    return 0
