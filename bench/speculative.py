"""Speculative decoding over the demo's emulated cluster against plain sequential decoding; prints one JSON line.

The trained demo model (``resources/demo_models/demo-llama``, or ``--model``) on the demo's three
agents (``gui.demo_cluster``: edge-a 1×, edge-b 1.5×, edge-c 8× slower, their memory budgets, links
and 2 ms latency), its shipped distilled draft (``resources/demo_models/demo-llama-draft``, or
``--draft``; ``core.models.draft_distillation``). The cluster is profiled first (compute per unit on
every agent and every link, as the studio does), and the cost model (``core.planning.speculation``)
predicts, per plan, plain and speculative tokens/s from that profile, the draft's *stored*
acceptance rate and its token's cost timed on each device while profiling (``profile_cluster(draft_dir=)``,
``Profile.draft_times``: what ``--speculate auto`` and Compare use; ``--draft-cost proxy``: the
target-profile proxy instead, as before those were timed); ``--k auto`` (the default) takes its choice of k. For 2 stages (edge-a, edge-c) and
3 (edge-a, edge-b, edge-c), per round and prompt, a plain sequential run and a speculative one in
turn, greedy, ``--tokens`` new tokens each (no stop token: the demo's greedy answers end after 6-10
tokens, too few to measure decoding):

- ``tokens_equal``: every speculative run's tokens equal the plain run's and transformers'
  ``generate`` (and ``generate(assistant_model=draft)``) in process;
- ``acceptance_rate``: the draft's proposals the target accepted (``core.runs.speculative``), beside
  ``stored_acceptance_rate`` (the draft's held-out figure) and ``tokens_per_trip``;
- ``speedup_over_plain``: {stages: plain run wall time / speculative run wall time}, the median over
  the runs (same prompts, interleaved);
- ``predicted_over_measured``: {stages: the cost model's predicted speedup (from the profile, the
  stored acceptance rate and the draft's profiled cost: nothing is taken from the scored runs) / the
  measured speedup};
  ``predicted_tokens_s_over_measured``: the same for the speculative runs' absolute tokens/s
  (the profile is taken minutes before the runs on a shared machine: a load change moves it);
  ``terms``: per plan, the plain runs' predicted/measured tokens/s, the draft's token by proxy and
  as its ``draft`` events measured it, and E(k) (compare ``tokens_per_trip``);
- ``hf_assisted_over_plain``: transformers' assisted generation against its own plain ``generate``,
  in process (the peer; no pipeline, no links).

The 1-minute load is read before and after. Usage: python bench/speculative.py [--k auto|K]
[--tokens 32] [--rounds 2] [--draft DIR] [--draft-device NAME] (NAME: a stage's device that drafts in
the plans that have it; ``terms.draft_device`` says where each plan's draft ran)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPTS = ("The secret of life is", "A wise man once said", "Love is", "The best way to")
PLANS = {2: (("edge-a", "edge-c"), [3]), 3: (("edge-a", "edge-b", "edge-c"), [3, 5])}
"""Stages over the demo model's 8 units (embedding, 6 blocks, head) within the demo's budgets."""


def load1() -> float:
    return os.getloadavg()[0]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--k", default="auto", help="auto (the cost model's choice per plan) or an integer")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--draft-cost", choices=("measured", "proxy"), default="measured",
                    help="the draft's token time the prediction uses: timed on the source while profiling "
                         "(Profile.draft_times), or the proxy from the target's units (draft_token_s)")
    ap.add_argument("--draft-device", default="",
                    help="a plan's stage device that runs the draft (plans without it draft on the source; default: "
                         "the source); its token is timed there and the two hops a trip are in the prediction")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from core.devices.local_cluster import LocalCluster
    from core.devices.profiling import profile_cluster
    from core.models.demo_models import shipped
    from core.models.draft_distillation import stored_acceptance
    from core.planning.plan import plan_from_boundaries
    from core.planning.problem import PlanningProblem, Workload
    from core.planning.speculation import choose_k, draft_token_s, expected_tokens_per_trip, predicted_run_s
    from core.runs.coordinator import Coordinator
    from core.runs.generation import GenerationSettings, load_plan, load_tokenizer
    from core.runs.run_stream import RunRequest
    from core.runs.speculative import acceptance_rate, check_draft, draft_figures, speculative_request, trips
    from gui.demo_cluster import DEMO_DEVICES, DEMO_LINK_LATENCY_MS, demo_emulation, demo_shape

    model = Path(args.model) if args.model else shipped("llama")
    draft = Path(args.draft) if args.draft else shipped("llama-draft")
    work = Path(tempfile.mkdtemp(prefix="bench-speculative-"))
    check_draft(model, draft, 1)
    tok = load_tokenizer(str(model))
    stops = ()  # no stop token: every run decodes --tokens (the demo's greedy answers end after 6-10)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    config = json.loads((model / "config.json").read_text())

    target_hf = AutoModelForCausalLM.from_pretrained(model).eval()
    draft_hf = AutoModelForCausalLM.from_pretrained(draft).eval()
    for m in (target_hf, draft_hf):
        m.generation_config.eos_token_id = None
    hf, hf_times = [], {"plain": [], "assisted": []}
    for ids in prompts:
        kw = dict(input_ids=torch.tensor([ids]), max_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
        out = {}
        for name, extra in (("plain", {}), ("assisted", {"assistant_model": draft_hf})):
            t = time.perf_counter()
            out[name] = target_hf.generate(**kw, **extra)[0, len(ids):].tolist()
            hf_times[name].append(time.perf_counter() - t)
        hf.append(out)

    load_before = load1()
    equal, rates, per_trip, speedup, predicted, chosen, absolute = True, [], [], {}, {}, {}, {}
    terms = {}  # per plan: the prediction's terms beside what the runs measured (which term is off)
    with LocalCluster(work / "cluster", list(DEMO_DEVICES), link_mbit={d: demo_shape(d).link_mbit for d in DEMO_DEVICES},
                      link_latency_ms=DEMO_LINK_LATENCY_MS, emulation=demo_emulation(DEMO_DEVICES, model)) as cluster, \
            Coordinator(cluster.endpoints, cluster.keys) as coord:
        coord.sync_clocks()
        profile = profile_cluster(coord, config, model_name=model.name, dtype="fp32", prompt_tokens=8,
                                  batch_sizes=(1,), repeats=5, threads=1, link_target_s=0.3,
                                  draft_dir=draft if args.draft_cost == "measured" else None).profile
        load_profiled = load1()
        problem = PlanningProblem(name="speculative", profile=profile, source=DEMO_DEVICES[0],
                                  workload=Workload(prompt_tokens=round(statistics.mean(map(len, prompts))),
                                                    generated_tokens=args.tokens))
        for n, (devices, bounds) in PLANS.items():
            plan = plan_from_boundaries(model.name, 8, list(devices), bounds)
            device = args.draft_device if args.draft_device in devices[1:] else ""
            figures = draft_figures(problem, plan, draft, device)  # as --speculate auto and Compare see the draft
            proxy_s = draft_token_s(problem, plan, json.loads((draft / "config.json").read_text())["num_hidden_layers"])
            k = choose_k(problem, plan, figures).k if args.k == "auto" else int(args.k)
            chosen[f"{n}_stages"] = k
            if k == 0:
                speedup[f"{n}_stages"] = None  # the cost model predicts plain decoding faster: nothing to run
                continue
            spec = replace(check_draft(model, draft, k), draft_device=device)
            pred_plain = predicted_run_s(problem, plan, figures, 0, args.tokens)
            pred_spec = predicted_run_s(problem, plan, figures, k, args.tokens)
            load_plan(coord, plan, str(model), GenerationSettings(threads=1))
            ratios, walls, plain_walls, drafted = [], [], [], []
            for _ in range(args.rounds):
                for ids, ref in zip(prompts, hf):
                    plain = coord.run(plan, RunRequest(input_ids=(tuple(ids),), attention_mask=((1,) * len(ids),),
                                                       max_new_tokens=args.tokens, eos_token_ids=stops))
                    fast = coord.run(plan, speculative_request(ids, args.tokens, spec, eos_token_ids=stops))
                    got = list(fast.tokens[0])
                    equal &= got == list(plain.tokens[0]) == ref["plain"][:len(got)] == ref["assisted"][:len(got)]
                    ratios.append(plain.wall_s / fast.wall_s)
                    walls.append(fast.wall_s)
                    plain_walls.append(plain.wall_s)
                    drafted += [e.duration_s / e.nbytes for e in fast.events if e.kind == "draft" and e.nbytes]
                    rate = acceptance_rate(fast, k, args.tokens)
                    if rate is not None:
                        rates.append(rate)
                    per_trip.append((len(got) - 1) / max(1, trips(fast)))
            measured = statistics.median(ratios)
            speedup[f"{n}_stages"] = round(measured, 3)
            predicted[f"{n}_stages"] = round((pred_plain / pred_spec) / measured, 3)
            absolute[f"{n}_stages"] = round(statistics.median(walls) / pred_spec, 3)
            terms[f"{n}_stages"] = {
                "plain_predicted_over_measured": round(statistics.median(plain_walls) / pred_plain, 3),
                "draft_token_ms": {"proxy": round(proxy_s * 1e3, 3), "used": round(figures.token_s * 1e3, 3),
                                   "used_measured": figures.measured,
                                   "scored_runs": round(statistics.median(drafted) * 1e3, 3) if drafted else None},
                "tokens_per_trip_predicted": round(expected_tokens_per_trip(figures.acceptance_rate, k), 3),
                "draft_device": device or devices[0]}
    print(json.dumps({
        "tokens_equal": equal,
        "acceptance_rate": round(statistics.mean(rates), 3) if rates else None,
        "stored_acceptance_rate": stored_acceptance(draft),
        "tokens_per_trip": round(statistics.mean(per_trip), 3) if per_trip else None,
        "speedup_over_plain": speedup,
        "k": chosen, "k_asked": args.k,
        "predicted_over_measured": predicted,
        "predicted_tokens_s_over_measured": absolute,
        "terms": terms,
        "hf_assisted_over_plain": round(statistics.median(p / a for p, a in zip(hf_times["plain"], hf_times["assisted"])), 3),
        "tokens": args.tokens, "rounds": args.rounds, "prompts": len(prompts),
        "model": str(model), "draft": str(draft), "cluster": "gui.demo_cluster: edge-a 1x, edge-b 1.5x, edge-c 8x",
        "load_1min": {"before": round(load_before, 2), "profiled": round(load_profiled, 2), "after": round(load1(), 2)},
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
