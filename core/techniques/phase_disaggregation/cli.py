"""``edgeshard epd ...``: EPD's own verbs (registered through Technique.register_cli).

workload writes requests (Poisson from a seed, or a CSV trace); costs writes a calibration
(the illustrative one, until ``profiling`` measures agents); simulate runs a workload through
a pool configuration; search picks a configuration by black-box optimisation and shows the
baselines beside it. Every file is validated on load; errors are one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import msgspec

from core.arguments import SEED, float_in, int_in
from core.formats import load, save


def int_range(lo: int):
    """``N`` or ``LO..HI`` (inclusive, drawn uniformly per request), each >= ``lo``."""

    def convert(text: str) -> tuple[int, int]:
        parts = text.split("..")
        try:
            values = [int(p, 10) for p in parts]
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be N or LO..HI (integers), got {text!r}") from None
        if len(values) == 1:
            values = values * 2
        if len(values) != 2 or values[0] < lo or values[1] < values[0]:
            raise argparse.ArgumentTypeError(f"must be N or LO..HI with {lo} <= LO <= HI, got {text!r}")
        return values[0], values[1]

    convert.__name__ = "range"
    return convert


def register(sub: argparse._SubParsersAction) -> None:
    top = sub.add_parser("epd", help="encode/prefill/decode disaggregation: workload, costs, simulate, search",
                         description="Serve multimodal requests from three device pools (docs/phase-disaggregation.md).")
    verbs = top.add_subparsers(dest="epd_command", metavar="VERB", required=True)

    w = verbs.add_parser("workload", help="write a request workload: Poisson arrivals from a seed, or a CSV trace")
    w.add_argument("--trace", metavar="TRACE.csv", help="arrival_s,images,tiles_per_image,prompt_tokens,"
                                                        "output_tokens per row (instead of Poisson)")
    w.add_argument("--rate", type=float_in(0.0, 1e6, lo_open=True), default=1.0, help="requests per second")
    w.add_argument("--requests", type=int_in(1, 1_000_000), default=200)
    w.add_argument("--seed", type=SEED, default=0)
    w.add_argument("--images", type=int_range(0), default=(1, 1), metavar="N|LO..HI")
    w.add_argument("--tiles", type=int_range(1), default=(4, 4), metavar="N|LO..HI", help="tiles per image")
    w.add_argument("--prompt", type=int_range(1), default=(32, 32), metavar="N|LO..HI", help="prompt tokens")
    w.add_argument("--output", type=int_range(1), default=(32, 32), metavar="N|LO..HI", help="output tokens")
    w.add_argument("--out", required=True, metavar="WORKLOAD.json")
    w.set_defaults(func=_workload)

    c = verbs.add_parser("costs", help="write the illustrative calibration (profile agents for a measured one)")
    c.add_argument("--out", required=True, metavar="COSTS.json")
    c.set_defaults(func=_costs)

    m = verbs.add_parser("simulate", help="a workload through a pool configuration: TTFT, TPOT, SLO attainment")
    m.add_argument("--costs", required=True, metavar="COSTS.json")
    m.add_argument("--workload", required=True, metavar="WORKLOAD.json")
    m.add_argument("--pools", required=True, metavar="POOLS.json")
    _slo_args(m)
    m.add_argument("--goodput", action="store_true", help="also bisect for the goodput under the SLO")
    m.add_argument("--metrics-out", metavar="METRICS.json", help="write each request's simulated metrics")
    m.add_argument("--workspace", metavar="WS.sqlite", help="record the simulated run (timeline, tokens, metrics) "
                                                            "here, to replay in the studio")
    m.add_argument("--session", default="epd", help="session name to record under (with --workspace)")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=_simulate)

    s = verbs.add_parser("search", help="the configuration maximising goodput with the fewest devices, "
                                        "beside the aggregated and PD-only baselines")
    s.add_argument("--costs", required=True, metavar="COSTS.json")
    s.add_argument("--workload", required=True, metavar="WORKLOAD.json")
    s.add_argument("--devices", type=int_in(1, 1024), default=None, help="a budget of N devices (dev0…)")
    s.add_argument("--device-names", metavar="A,B,...", help="the devices by name (instead of --devices; "
                                                             "default: the devices COSTS.json was measured on)")
    _slo_args(s)
    s.add_argument("--trials", type=int_in(1, 10_000), default=40)
    s.add_argument("--time-limit", type=float_in(0.0, 86_400.0, lo_open=True), default=120.0, metavar="SECONDS")
    s.add_argument("--seed", type=SEED, default=0)
    s.add_argument("--mm-cache-tokens", type=int_in(1, 1 << 40), default=1 << 16)
    s.add_argument("--kv-cache-tokens", type=int_in(1, 1 << 40), default=1 << 20)
    s.add_argument("--model", metavar="MODEL_DIR", help="the Llava checkpoint: each device's memory is planned from "
                                                        "its weights (with --memory-mib)")
    s.add_argument("--memory-mib", type=float_in(0.0, 1e9, lo_open=True), default=None,
                   help="memory of each device: configurations needing more are not picked (needs --model)")
    s.add_argument("--layout", action="append", choices=("epd", "pd", "aggregated"), default=None,
                   help="search only this layout (repeatable; default: all three): epd (encode, prefill and decode "
                        "pools), pd (encode with prefill) or aggregated (every phase on every device)")
    s.add_argument("--out", metavar="POOLS.json", help="write the picked configuration")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_search)

    from core.techniques.phase_disaggregation.run_cli import register_run_verbs

    register_run_verbs(verbs)  # make-model, profile, run: the real half (run_cli.py)


def _slo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slo-ttft", type=float_in(0.0, 1e6, lo_open=True), default=2.5, metavar="SECONDS")
    p.add_argument("--slo-tpot", type=float_in(0.0, 1e6, lo_open=True), default=0.08, metavar="SECONDS")


def _workload(args) -> int:
    from core.techniques.phase_disaggregation.workload import load_trace, poisson_workload

    if args.trace:
        w = load_trace(args.trace)
    else:
        w = poisson_workload(rate_rps=args.rate, requests=args.requests, seed=args.seed, images=args.images,
                             tiles_per_image=args.tiles, prompt_tokens=args.prompt, output_tokens=args.output)
    save(args.out, w)
    tiles = sum(r.tiles for r in w.requests)
    print(f"wrote {args.out}: {len(w.requests)} requests over {w.duration_s:.1f} s, {tiles} tiles in all")
    return 0


def _costs(args) -> int:
    from core.techniques.phase_disaggregation.scenarios import illustrative_costs

    save(args.out, illustrative_costs())
    print(f"wrote {args.out} (illustrative, not measured)")
    return 0


def _inputs(args):
    from core.techniques.phase_disaggregation.types import SLO, PhaseCosts, Workload

    return (load(args.costs, PhaseCosts), load(args.workload, Workload),
            SLO(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot))


def _median(xs) -> float:
    return statistics.median(list(xs))


def _simulate(args) -> int:
    from core.techniques.phase_disaggregation.goodput import attainment, goodput
    from core.techniques.phase_disaggregation.simulator import simulate_pools
    from core.techniques.phase_disaggregation.types import MetricsFile, PoolConfig
    from core.techniques.phase_disaggregation.workload import mean_rate_rps

    costs, workload, slo = _inputs(args)
    pools = load(args.pools, PoolConfig)
    sim = simulate_pools(costs, workload, pools, record=bool(args.workspace))
    ms = sim.metrics
    out = {"requests": len(ms), "ttft_p50_s": _median(m.ttft_s for m in ms),
           "tpot_p50_s": _median(m.tpot_s for m in ms), "e2e_p50_s": _median(m.e2e_s for m in ms),
           "slo_attainment": attainment(ms, slo)}
    if args.goodput:
        out["goodput_rps"] = goodput(costs, workload, pools, slo, start_rps=mean_rate_rps(workload)).rate_rps
    if args.metrics_out:
        save(args.metrics_out, MetricsFile(origin="simulated", requests=ms))
    if args.workspace:
        from core.sessions.store import SessionStore
        from core.techniques.phase_disaggregation.simulator import record_simulation

        with SessionStore(args.workspace) as store:
            out["run_id"] = record_simulation(store, store.create_session(args.session), sim, model="simulated",
                                              workload=workload, pools=pools)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{pools.disaggregation} on {len(pools.devices)} devices: {len(ms)} requests, TTFT p50 "
          f"{out['ttft_p50_s']:.3f} s, TPOT p50 {out['tpot_p50_s'] * 1e3:.1f} ms, E2E p50 {out['e2e_p50_s']:.2f} s, "
          f"SLO attainment {out['slo_attainment']:.0%}"
          + (f", goodput {out['goodput_rps']:.3g} req/s" if args.goodput else "")
          + (f"; recorded as run {out['run_id']} in {args.workspace}" if args.workspace else ""))
    return 0


def search_devices(costs, count: int | None, names: str | None) -> tuple[str, ...]:
    """The search's devices: ``count`` (dev0…), ``names`` (A,B,...), or the devices ``costs`` were
    measured on (``epd profile``); one device without costs of its own is priced at the top-level
    speeds, said on stderr."""
    from core.errors import EdgeShardError

    if count is not None and names is not None:
        raise EdgeShardError("give the device budget as --devices N or --device-names A,B,... (not both)")
    if count is not None:
        out = tuple(f"dev{i}" for i in range(count))
    elif names is not None:
        out = tuple(n.strip() for n in names.split(",") if n.strip())
    elif costs.devices:
        return tuple(d.device for d in costs.devices)
    else:
        raise EdgeShardError("these costs are not per device (not measured by epd profile): give the device budget "
                             "as --devices N or --device-names A,B,...")
    unpriced = [d for d in out if costs.devices and d not in {c.device for c in costs.devices}]
    if unpriced:
        print(f"note: {', '.join(unpriced)} have no costs of their own in these costs (measured on "
              f"{', '.join(c.device for c in costs.devices)}): priced at their top-level speeds", file=sys.stderr)
    return out


def _search(args) -> int:
    from core.errors import EdgeShardError
    from core.reporting import TerminalReporter
    from core.techniques.phase_disaggregation.baselines import aggregated, pd_only
    from core.techniques.phase_disaggregation.search import search
    from core.techniques.phase_disaggregation.types import DISAGGREGATIONS
    from core.techniques.phase_disaggregation.types import EpdProblem

    costs, workload, slo = _inputs(args)
    names = search_devices(costs, args.devices, args.device_names)
    if args.memory_mib is not None and not args.model:
        raise EdgeShardError("--memory-mib plans each device's memory from the model's weights: give --model MODEL_DIR")
    from core.techniques.phase_disaggregation.memory import phase_weights

    problem = EpdProblem(costs=costs, workload=workload, slo=slo, devices=names,
                         mm_cache_tokens=args.mm_cache_tokens, kv_cache_tokens=args.kv_cache_tokens,
                         weights=phase_weights(args.model) if args.model else None,
                         memory_budget_bytes=int((args.memory_mib or 0) * (1 << 20)))
    base = [aggregated(problem)] + ([pd_only(problem)] if len(names) >= 2 else [])
    result = search(problem, modes=tuple(dict.fromkeys(args.layout or DISAGGREGATIONS)), trials=args.trials,
                    time_limit_s=args.time_limit, seed=args.seed, seeds=[b.config for b in base],
                    reporter=TerminalReporter())
    if args.out:
        save(args.out, result.best.config)
    rows = [("search", result.best)] + list(zip(("aggregated", "pd-only"), base))
    if args.json:
        print(json.dumps({"search_s": result.elapsed_s, "trials": len(result.candidates),
                          "best": msgspec.to_builtins(result.best.config),
                          "rows": [{"strategy": n, "goodput_rps": c.goodput_rps, "ttft_p50_s": c.ttft_p50_s,
                                    "tpot_p50_s": c.tpot_p50_s, "devices": c.devices, "memory_bytes": c.memory_bytes,
                                    "fits": c.fits} for n, c in rows]}))
        return 0
    print(f"searched {len(result.candidates)} configurations in {result.elapsed_s:.1f} s ({result.sampler})",
          file=sys.stderr)
    print(f"  {'strategy':<11} {'goodput':>10} {'TTFT p50':>9} {'TPOT p50':>9} {'devices':>8}  pools")
    for name, c in rows:
        cfg = c.config
        pools = (f"E{len(cfg.encode)} P{len(cfg.prefill)} D{len(cfg.decode)} irp {cfg.irp_degree}"
                 if cfg.disaggregation == "epd" else
                 f"P{len(cfg.prefill)} D{len(cfg.decode)}" if cfg.disaggregation == "pd" else f"all {len(cfg.prefill)}")
        print(f"  {name:<11} {c.goodput_rps:8.3g}/s {c.ttft_p50_s:8.3f}s {c.tpot_p50_s * 1e3:7.1f}ms "
              f"{c.devices:>8}  {cfg.disaggregation}: {pools}, batches {cfg.encode_batch}/{cfg.prefill_batch}/"
              f"{cfg.decode_batch}, {cfg.policy}")
    return 0
