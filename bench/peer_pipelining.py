"""This runtime beside torch.distributed.pipelining, same model, same splits, one run; one JSON line.

The peer: ``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe``, gloo,
one process per stage on loopback, CPU). Its stages run the very same computation as
this project's agents (``agents.shard.StageExecutor`` on the same units, same torch
thread count), so the figures compare the pipelining runtimes, not the model code.

What torch's pipelining can and cannot do here (PLATFORM-NOTES.md):
- it runs one ``step``/``eval`` per call with shapes fixed at construction, so KV-cached
  decode needs separate prefill and decode stage objects with shapes given up front, and
  the stage module keeps the caches itself (one per micro-batch, called in order);
- it has no way back from the last stage to the first: the generated token returns by an
  explicit ``dist.send``/``recv`` on a two-rank gloo group (our runtime's token hop);
- within a step it pipelines micro-batches (GPipe) but every decode step ends in a flush,
  so its only multi-micro-batch decode is our ``bubbles`` mode; our ``no-bubbles`` (micro-
  batches of different steps in flight together) has no torch counterpart and is
  reported beside it, not as a ratio.

Figures, torch vs ours, rounds interleaved (medians): decode tokens/s for 2 and 4 sequential
stages (1 sequence) and for 2 stages × 4 micro-batches (4 sequences), and prefill time for 2
and 4 sequential stages. Ratios are ours/torch (tokens/s) and torch/ours (prefill time): ≥ 1
means this runtime is at least as fast.

Prefill time: a 16-token prompt, from the command to the first token back at the first stage,
each runtime's dispatch included — ours from the run's t0 (set right before the coordinator
sends the source's ``StartRun``; the other stages were started before) to the token's arrival
at the source (the run's TTFT); torch's from the moment the bench writes its command line to
rank 0 (readline, the command's broadcast to every rank, the schedule's start) to the token's
arrival at rank 0 (one host, one wall clock). ``torch_in_rank0`` is torch's prefill as rank 0
times it from its schedule's start, without that dispatch (what this bench reported before,
beside a TTFT of ours that included it). A prefill varies ±10 % from run to run on a shared
machine, so it is measured on prefill-only runs (1 new token): ``--prefill-repeats`` per round
and stage count of each runtime, their order alternating, a median over rounds × repeats runs.
Each run is split into phases (``prefill_phases``: dispatch, each stage's compute, each hop,
the token's way back, and overhead = all but compute; ours from the agents' timeline events
on the coordinator's clock, torch's from each rank's forward spans), medians per phase.

Usage: python bench/peer_pipelining.py [--model DIR] [--rounds 3] [--new-tokens 32] [--threads 1]
       [--prefill-repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

PROMPT_TOKENS = 16
MICRO_BATCHES = 4


def _boundaries(units: int, stages: int) -> list[int]:
    """The same even split as bench/runtime.py: stage ends at multiples of units // stages."""
    q = units // stages
    return [q * i for i in range(1, stages)]


# ------------------------------------------------------------------------- the peer
class _PeerStageModule(torch.nn.Module):
    """One pipeline stage for torch: the agents' executor, a KV cache per micro-batch.

    torch calls ``forward`` once per micro-batch, in order; the last stage returns the
    greedy token ids (int64 [mb, 1]) so the token hop is as small as ours.
    """

    def __init__(self, executor, phase: str, micro_batches: int):
        super().__init__()
        self.executor, self.phase, self.micro_batches = executor, phase, micro_batches
        self.calls = 0
        self.spans: list[tuple[float, float]] = []
        """(start, end) on the wall clock of each call since the last command (the phase breakdown)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.calls % self.micro_batches
        self.calls += 1
        t0 = time.time()
        if self.phase == "prefill":
            y = self.executor.prefill(group, x, torch.ones(x.shape[0], x.shape[1], dtype=torch.long))
        else:
            y = self.executor.decode(group, x)
        y = y.argmax(-1, keepdim=True) if self.executor.is_last else y
        self.spans.append((t0, time.time()))
        return y


def _peer_rank(rank: int, world: int, port: int, model_dir: str, threads: int, new_tokens: int,
               micro_batches: int) -> None:
    """One torch.distributed process. Rank 0 reads commands on stdin (``sequences micro-batches
    steps``; steps 0 = ``new_tokens``) and prints one JSON result per command: the decode rate
    (None below 3 steps), the prefill time from its own start of the schedule, the wall-clock
    time the first token was back, and every rank's prefill forward spans (gathered after the
    timed steps)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from agents.shard import StageExecutor

    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    token_group = dist.new_group([0, world - 1]) if world > 1 else None
    config = json.loads((Path(model_dir) / "config.json").read_text())
    units = int(config["num_hidden_layers"]) + 2
    hidden = int(config["hidden_size"])
    ends = _boundaries(units, world) + [units]
    start = 0 if rank == 0 else ends[rank - 1]
    executor = StageExecutor(model_dir, start, ends[rank], threads=threads)
    last = rank == world - 1
    meta = torch.device("meta")

    def schedule(phase: str, mb: int, seqs: int) -> ScheduleGPipe:
        length = PROMPT_TOKENS if phase == "prefill" else 1
        per = seqs // mb
        if rank == 0:
            inp = torch.empty(per, length, dtype=torch.long, device=meta)
        else:
            inp = torch.empty(per, length, hidden, dtype=torch.float32, device=meta)
        out = (torch.empty(per, 1, dtype=torch.long, device=meta) if last
               else torch.empty(per, length, hidden, dtype=torch.float32, device=meta))
        module = _PeerStageModule(executor, phase, mb)
        stage = PipelineStage(module, rank, world, torch.device("cpu"), input_args=(inp,), output_args=(out,))
        return ScheduleGPipe(stage, n_microbatches=mb), module

    # (sequences, micro-batches) → (prefill, decode) schedules, built once like our loaded shards
    configs = {(1, 1): (schedule("prefill", 1, 1), schedule("decode", 1, 1))}
    if micro_batches > 1:
        configs[(micro_batches, micro_batches)] = (schedule("prefill", micro_batches, micro_batches),
                                                   schedule("decode", micro_batches, micro_batches))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, int(config["vocab_size"]), (max(micro_batches, 1), PROMPT_TOKENS), generator=gen)
    cmd = torch.zeros(3, dtype=torch.long)
    while True:
        if rank == 0:
            line = sys.stdin.readline().split()
            cmd[0], cmd[1], cmd[2] = (int(line[0]), int(line[1]), int(line[2])) if line else (0, 0, 0)
        dist.broadcast(cmd, src=0)
        seqs = int(cmd[0])
        if seqs == 0:
            break
        (prefill, prefill_module), (decode, _) = configs[(seqs, int(cmd[1]))]
        prefill_module.spans.clear()
        steps = int(cmd[2]) or new_tokens
        tok = torch.empty(seqs, 1, dtype=torch.long)
        stamps = []
        with torch.inference_mode():
            for step in range(steps):
                sched = prefill if step == 0 else decode
                t0 = time.perf_counter()
                if rank == 0:
                    sched.eval(ids[:seqs] if step == 0 else tok)
                elif last:
                    out = sched.eval()
                else:
                    sched.eval()
                if world == 1:
                    tok = out
                elif last:
                    dist.send(out.contiguous(), dst=0, group=token_group)
                elif rank == 0:
                    dist.recv(tok, src=world - 1, group=token_group)
                stamps.append(time.perf_counter())
                if step == 0:
                    t_first = time.time()
                    prefill_s = stamps[-1] - t0
        spans = [prefill_module.spans] * world
        if world > 1:
            dist.gather_object(prefill_module.spans, spans if rank == 0 else None, dst=0)
        if rank == 0:
            rate = (len(stamps) - 2) * seqs / (stamps[-1] - stamps[1]) if len(stamps) >= 3 else None
            print(json.dumps({"decode_tok_s": rate, "prefill_s": prefill_s, "t_first": t_first, "spans": spans,
                              "tokens": tok[:, 0].tolist()}), flush=True)
    dist.destroy_process_group()


class _Peer:
    """A torch.distributed pipeline of ``world`` processes kept alive across rounds."""

    def __init__(self, world: int, model_dir: str, threads: int, new_tokens: int):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")]))
        self.procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--peer-rank", str(r), str(world), str(port), model_dir, str(threads),
                 str(new_tokens), str(MICRO_BATCHES if world == 2 else 1)],
                stdin=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, text=True, env=env)
            for r in range(world)
        ]

    def round(self, seqs: int, micro_batches: int, steps: int = 0) -> dict:
        """One command; ``steps`` 0 = the pipeline's new tokens. Adds ``t_command``: the wall
        clock when the command was written (the start of torch's dispatch, as ``run.t0`` is ours)."""
        head = self.procs[0]
        t_command = time.time()
        head.stdin.write(f"{seqs} {micro_batches} {steps}\n")
        head.stdin.flush()
        line = head.stdout.readline()
        if not line:
            raise RuntimeError("the torch pipeline's rank 0 ended early (see its stderr)")
        return dict(json.loads(line), t_command=t_command)

    def close(self) -> None:
        try:
            self.procs[0].stdin.write("0 0 0\n")
            self.procs[0].stdin.flush()
        except OSError:
            pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# ------------------------------------------------------------------- prefill by phase
def prefill_phases(start: float, spans: list[tuple[float, float]], first: float) -> dict[str, float]:
    """A prefill, phase by phase (seconds): from ``start`` (the command) to ``first`` (the first
    token back at the first stage), each stage's compute span in stage order between.
    ``dispatch``: start to stage 0's compute; ``hop{i}{i+1}``: one stage's compute end to the
    next one's start (framing, transfer, receive); ``back``: the last stage's compute end to the
    token at the first stage; ``overhead``: everything but compute."""
    out = {"total": first - start, "dispatch": spans[0][0] - start}
    for i, (a, b) in enumerate(spans):
        out[f"compute{i}"] = b - a
        if i:
            out[f"hop{i - 1}{i}"] = a - spans[i - 1][1]
    out["back"] = first - spans[-1][1]
    out["overhead"] = out["total"] - sum(b - a for a, b in spans)
    return out


def torch_prefill_phases(result: dict) -> dict[str, float]:
    """torch's prefill from the command written to rank 0 (its dispatch: the line, the broadcast)."""
    return prefill_phases(result["t_command"], [tuple(rank[0]) for rank in result["spans"]], result["t_first"])


def ours_prefill_phases(result) -> dict[str, float]:
    """Ours from the run's t0 (right before the source's ``StartRun``), on the coordinator's clock."""
    from core.runs.metrics import ttft_s

    compute = {e.stage: e for e in result.events if e.kind == "compute" and e.step == 0}
    return prefill_phases(0.0, [(compute[i].start_s, compute[i].end_s) for i in sorted(compute)],
                          ttft_s(result.token_events))


# --------------------------------------------------------------------------- the bench
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(Path.home() / ".cache" / "edgeshard" / "bench-llama-170m"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per stage, both runtimes")
    ap.add_argument("--prefill-repeats", type=int, default=5,
                    help="prefill-only runs per round and stage count, each runtime, order alternating")
    args = ap.parse_args()

    from agents.protocol import SamplingSpec
    from core.devices.local_cluster import LocalCluster
    from core.models.checkpoints import make_benchmark_model
    from core.planning.plan import plan_from_boundaries
    from core.runs.coordinator import Coordinator, RunRequest
    from core.runs.metrics import decode_tokens_per_s

    model_dir = Path(args.model)
    if not (model_dir / "config.json").exists():
        make_benchmark_model(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    units = int(config["num_hidden_layers"]) + 2
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, int(config["vocab_size"]), (MICRO_BATCHES, PROMPT_TOKENS), generator=gen)

    def request(n_seqs: int, mode: str, micro_batches: int, new_tokens: int = args.new_tokens) -> RunRequest:
        rows = tuple(tuple(r) for r in ids[:n_seqs].tolist())
        return RunRequest(input_ids=rows, attention_mask=tuple((1,) * PROMPT_TOKENS for _ in rows),
                          max_new_tokens=new_tokens, mode=mode, micro_batches=micro_batches,
                          eos_token_ids=(), sampling=SamplingSpec())

    names = {s: [f"s{s}-{i}" for i in range(s)] for s in (2, 4)}
    plans = {s: plan_from_boundaries("bench", units, names[s], _boundaries(units, s)) for s in (2, 4)}
    figures: dict[str, list[float]] = {}
    phases: dict[str, list[dict[str, float]]] = {}
    same_tokens = True

    def add(key: str, value: float) -> None:
        figures.setdefault(key, []).append(value)

    def prefill_series(s: int, record: bool) -> None:
        """``--prefill-repeats`` prefill-only runs of each runtime, the order alternating."""
        for k in range(args.prefill_repeats):
            for who in (("torch", "ours") if k % 2 == 0 else ("ours", "torch")):
                if who == "torch":
                    t = peers[s].round(1, 1, steps=1)
                    got, split = t["tokens"][0], torch_prefill_phases(t)
                    if record:
                        add(f"torch{s}_prefill_in_rank0", t["prefill_s"])
                else:
                    r = co.run(plans[s], request(1, "sequential", 1, new_tokens=1))
                    got, split = r.tokens[0][0], ours_prefill_phases(r)
                firsts.setdefault(s, set()).add(got)
                if record:
                    phases.setdefault(f"{who}{s}", []).append(split)

    firsts: dict[int, set[int]] = {}
    load_before = os.getloadavg()[0]
    peers = {s: _Peer(s, str(model_dir), args.threads, args.new_tokens) for s in (2, 4)}
    try:
        with tempfile.TemporaryDirectory(prefix="edgeshard-peer-") as tmp:
            with LocalCluster(tmp, names[2] + names[4], threads_per_agent=args.threads) as cluster:
                with Coordinator(cluster.endpoints, cluster.keys, request_timeout_s=120) as co:
                    for s in (2, 4):
                        co.load(plans[s], str(model_dir), threads=args.threads)
                    co.sync_clocks()
                    for rnd in range(args.rounds + 1):  # the first round warms up
                        print(f"round {rnd}/{args.rounds}", file=sys.stderr, flush=True)
                        for s in (2, 4):
                            t = peers[s].round(1, 1)
                            r = co.run(plans[s], request(1, "sequential", 1))
                            same_tokens &= t["tokens"][0] == r.tokens[0][-1]
                            if rnd:
                                add(f"torch{s}_decode", t["decode_tok_s"])
                                add(f"ours{s}_decode", decode_tokens_per_s(r.token_events))
                            prefill_series(s, record=rnd > 0)
                        t = peers[2].round(MICRO_BATCHES, MICRO_BATCHES)
                        if rnd:
                            add("torch2x4_decode", t["decode_tok_s"])
                        for mode in ("bubbles", "no-bubbles"):
                            r = co.run(plans[2], request(MICRO_BATCHES, mode, MICRO_BATCHES))
                            if rnd:
                                add(f"ours2x4_{mode}_decode", decode_tokens_per_s(r.token_events))
    finally:
        for p in peers.values():
            p.close()
    med = {k: statistics.median(v) for k, v in figures.items()}
    out = {
        "bench": "peer_pipelining",
        "peer": f"torch {torch.__version__} distributed.pipelining ScheduleGPipe, gloo, loopback",
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch threads per stage {args.threads}",
        "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "rounds": args.rounds, "new_tokens": args.new_tokens, "prompt_tokens": PROMPT_TOKENS,
        "same_last_token": same_tokens,
        "same_first_token": all(len(f) == 1 for f in firsts.values()),
        "prefill_runs_each": args.rounds * args.prefill_repeats,
    }
    for s in (2, 4):
        out[f"stages{s}_decode_tok_s"] = {"ours": round(med[f"ours{s}_decode"], 2), "torch": round(med[f"torch{s}_decode"], 2)}
        out[f"stages{s}_decode_ratio"] = round(med[f"ours{s}_decode"] / med[f"torch{s}_decode"], 3)
        split = {who: {k: round(statistics.median(p[k] for p in phases[f"{who}{s}"]) * 1e3, 2)
                       for k in phases[f"{who}{s}"][0]} for who in ("ours", "torch")}
        out[f"stages{s}_prefill_ms"] = {"ours": split["ours"]["total"], "torch": split["torch"]["total"],
                                        "torch_in_rank0": round(med[f"torch{s}_prefill_in_rank0"] * 1e3, 2)}
        out[f"stages{s}_prefill_ratio"] = round(split["torch"]["total"] / split["ours"]["total"], 3)
        out[f"stages{s}_prefill_phases_ms"] = split
    out["stages2x4_decode_tok_s"] = {"ours_bubbles": round(med["ours2x4_bubbles_decode"], 2),
                                     "ours_no_bubbles": round(med["ours2x4_no-bubbles_decode"], 2),
                                     "torch_gpipe": round(med["torch2x4_decode"], 2)}
    out["stages2x4_bubbles_ratio"] = round(med["ours2x4_bubbles_decode"] / med["torch2x4_decode"], 3)
    out["stages2x4_no_bubbles_vs_torch_gpipe"] = round(med["ours2x4_no-bubbles_decode"] / med["torch2x4_decode"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    if len(sys.argv) == 9 and sys.argv[1] == "--peer-rank":
        a = sys.argv[2:]
        _peer_rank(int(a[0]), int(a[1]), int(a[2]), a[3], int(a[4]), int(a[5]), int(a[6]))
    else:
        main()
