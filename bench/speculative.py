"""Speculative decoding over the demo's emulated cluster against plain sequential decoding; prints one JSON line.

The trained demo model (``resources/demo_models/demo-llama``, or ``--model``) on the demo's three
agents (``gui.demo_cluster``: edge-a 1×, edge-b 1.5×, edge-c 8× slower, their memory budgets, links
and 2 ms latency), a draft checkpoint sharing its tokenizer (``--draft``; without it, a 1-block draft
is trained here with the demo's recipe and text for ``--draft-seconds``). For 2 stages (edge-a,
edge-c) and 3 (edge-a, edge-b, edge-c), per round and prompt, a plain sequential run and a
speculative one (``--k``) in turn, greedy, ``--tokens`` new tokens each (no stop token: the demo's
greedy answers end after 6-10 tokens, too few to measure decoding):

- ``tokens_equal``: every speculative run's tokens equal the plain run's and transformers'
  ``generate`` (and ``generate(assistant_model=draft)``) in process;
- ``acceptance_rate``: the draft's proposals the target accepted (``core.runs.speculative``);
- ``speedup_over_plain``: {stages: plain run wall time / speculative run wall time}, the median over
  the runs (same prompts, interleaved); ``tokens_per_trip``;
- ``hf_assisted_over_plain``: transformers' assisted generation against its own plain ``generate``,
  in process (the peer; no pipeline, no links);
- ``predicted_over_measured``: null — the cost model and simulator do not know speculation yet.

The 1-minute load is read before and after. Usage: python bench/speculative.py [--k 3] [--tokens 32]
[--rounds 2] [--draft DIR] [--draft-seconds 90]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPTS = ("The secret of life is", "A wise man once said", "Love is", "The best way to")
PLANS = {2: (("edge-a", "edge-c"), [3]), 3: (("edge-a", "edge-b", "edge-c"), [3, 5])}
"""Stages over the demo model's 8 units (embedding, 6 blocks, head) within the demo's budgets."""


def load1() -> float:
    return os.getloadavg()[0]


def train_draft(out: Path, seconds: float) -> Path:
    from core.models.demo_models import LLAMA
    from core.models.training import TrainingSettings, fortune_lines, train_model

    return train_model(dataclasses.replace(LLAMA, layers=1), fortune_lines(), out,
                       settings=TrainingSettings(max_seconds=seconds, threads=1))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--draft-seconds", type=float, default=90.0)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from core.devices.local_cluster import LocalCluster
    from core.models.demo_models import shipped
    from core.planning.plan import plan_from_boundaries
    from core.runs.coordinator import Coordinator
    from core.runs.generation import GenerationSettings, load_plan, load_tokenizer
    from core.runs.run_stream import RunRequest
    from core.runs.speculative import acceptance_rate, check_draft, speculative_request, trips
    from gui.demo_cluster import DEMO_DEVICES, DEMO_LINK_LATENCY_MS, demo_emulation, demo_shape

    model = Path(args.model) if args.model else shipped("llama")
    work = Path(tempfile.mkdtemp(prefix="bench-speculative-"))
    draft = Path(args.draft) if args.draft else train_draft(work / "draft", args.draft_seconds)
    spec = check_draft(model, draft, args.k)
    tok = load_tokenizer(str(model))
    stops = ()  # no stop token: every run decodes --tokens (the demo's greedy answers end after 6-10)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]

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
    equal, rates, per_trip, speedup = True, [], [], {}
    with LocalCluster(work / "cluster", list(DEMO_DEVICES), link_mbit={d: demo_shape(d).link_mbit for d in DEMO_DEVICES},
                      link_latency_ms=DEMO_LINK_LATENCY_MS, emulation=demo_emulation(DEMO_DEVICES, model)) as cluster, \
            Coordinator(cluster.endpoints, cluster.keys) as coord:
        for n, (devices, bounds) in PLANS.items():
            plan = plan_from_boundaries(model.name, 8, list(devices), bounds)
            load_plan(coord, plan, str(model), GenerationSettings(threads=1))
            ratios = []
            for _ in range(args.rounds):
                for ids, ref in zip(prompts, hf):
                    plain = coord.run(plan, RunRequest(input_ids=(tuple(ids),), attention_mask=((1,) * len(ids),),
                                                       max_new_tokens=args.tokens, eos_token_ids=stops))
                    fast = coord.run(plan, speculative_request(ids, args.tokens, spec, eos_token_ids=stops))
                    got = list(fast.tokens[0])
                    equal &= got == list(plain.tokens[0]) == ref["plain"][:len(got)] == ref["assisted"][:len(got)]
                    ratios.append(plain.wall_s / fast.wall_s)
                    rate = acceptance_rate(fast, args.k, args.tokens)
                    if rate is not None:
                        rates.append(rate)
                    per_trip.append((len(got) - 1) / max(1, trips(fast)))
            speedup[f"{n}_stages"] = round(statistics.median(ratios), 3)
    print(json.dumps({
        "tokens_equal": equal,
        "acceptance_rate": round(statistics.mean(rates), 3) if rates else None,
        "tokens_per_trip": round(statistics.mean(per_trip), 3),
        "speedup_over_plain": speedup,
        "hf_assisted_over_plain": round(statistics.median(p / a for p, a in zip(hf_times["plain"], hf_times["assisted"])), 3),
        "predicted_over_measured": None,
        "predicted_over_measured_why": "the cost model and simulator do not model speculation yet",
        "k": args.k, "tokens": args.tokens, "rounds": args.rounds, "prompts": len(prompts),
        "model": str(model), "draft": str(draft), "cluster": "gui.demo_cluster: edge-a 1x, edge-b 1.5x, edge-c 8x",
        "load_1min": {"before": round(load_before, 2), "after": round(load1(), 2)},
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
