"""Four stages chained in one process, with what a hand-off does to a core in between; one JSON line.

Four agent processes cost ~10-12 % more CPU per token than one (``bench/runtime.py``,
``bench/runtime_threads.py``) although the same four ``StageExecutor``s chained in one
process cost about what one does. Between two stages of a real run the core runs other
work (the next stage's agent, libzmq's IO threads, other processes), so a stage starts
with cold caches and TLB. This bench emulates that in one process, 1 torch thread, on the
benchmark Llama (``bench/runtime.py`` makes it): per decode step the solo executor and the
four stage executors, each call timed alone in CPU seconds of this thread
(``time.thread_time``), with between calls: nothing, a write over 64 MiB (2x this
machine's L3: evicts the caches), a 4 ms sleep (the core goes to other work), or both.
The variants alternate per round; medians of the per-step CPU time.

Usage: python bench/investigations/stage_handoff.py [--model DIR] [--rounds 3] [--new-tokens 24]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve()
sys.path[:0] = [str(_HERE.parents[2]), str(_HERE.parents[1])]  # this checkout's code, bench/'s shared modules

import torch  # noqa: E402

KINDS = ("none", "evict", "sleep", "evict+sleep")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(Path.home() / ".cache" / "edgeshard" / "bench-llama-170m"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=24)
    args = ap.parse_args()
    from agents.shard import StageExecutor
    from core.models.checkpoints import make_benchmark_model

    torch.set_num_threads(1)
    if not (Path(args.model) / "config.json").exists():
        make_benchmark_model(args.model)
    units = json.loads((Path(args.model) / "config.json").read_text())["num_hidden_layers"] + 2
    q = units // 4  # bench/runtime.py's split
    solo = StageExecutor(args.model, 0, units)
    stages = [StageExecutor(args.model, a, b) for a, b in ((0, q), (q, 2 * q), (2 * q, 3 * q), (3 * q, units))]
    ids = torch.randint(3, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(1, 16, dtype=torch.long)
    junk = torch.zeros(64 * 2**20 // 4)

    def between(kind: str) -> None:
        if "evict" in kind:
            junk.add_(1.0)
        if "sleep" in kind:
            time.sleep(0.004)

    def run(kind: str) -> tuple[float, float]:
        solo.prefill(0, ids, mask)
        h = ids
        for s in stages:
            h = s.prefill(0, h, mask)
        tok = ids[:, -1:]
        one, four = [], []
        for _ in range(args.new_tokens):
            between(kind)
            c = time.thread_time()
            solo.decode(0, tok)
            one.append(time.thread_time() - c)
            total, h = 0.0, tok
            for s in stages:
                between(kind)
                c = time.thread_time()
                h = s.decode(0, h)
                total += time.thread_time() - c
            four.append(total)
        return statistics.median(one), statistics.median(four)

    per: dict[str, list[tuple[float, float]]] = {k: [] for k in KINDS}
    load = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for k in KINDS:
            per[k].append(run(k))
    load.append(os.getloadavg()[0])
    out: dict = {"bench": "stage_handoff", "unit": "CPU ms per decode step (this thread)",
                 "load_avg_1min": [round(x, 2) for x in load], "rounds": args.rounds}
    for k, v in per.items():
        one, four = statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)
        out[k] = {"one_stage_ms": round(one * 1e3, 2), "four_stages_sum_ms": round(four * 1e3, 2),
                  "four_over_one": round(four / one, 3)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
