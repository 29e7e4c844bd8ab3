"""Benchmark `edgeshard serve` over real local agents; prints one JSON line.

Model: the demo's recipe (``gui.demo.demo_recipe``: Llama, 6 layers, hidden 128, vocab 4096;
random weights, made into a temp dir unless ``--model``). For a 2- and a 3-stage plan (mode
no-bubbles, micro-batches = stages) a real server process is started (``python -m core.cli
serve --local``, recording into a temp workspace as a user's server would), and 1, 4 and 16
concurrent streaming clients (plain ``http.client``, so the client costs little CPU on the
shared cores) each send ``--requests`` requests of ``--new-tokens`` greedy tokens:

- ``tokens_per_s``: every client's completion tokens over the wall time of that level;
- ``ttft_ms_p50/p99``: the first token's chunk at the client, from sending the request;
- ``tpot_ms_p50/p99``: (last token's chunk − first) / (tokens − 1) per request;
- ``sixteen_vs_one``: aggregate tokens/s at 16 clients over 1 (issue 27's target >= 3);
- ``vs_hf_batched``: aggregate tokens/s at 16 clients over transformers' in-process batched
  ``generate`` of the 16 prompts (the better of 1 and 2 torch threads: the limit on these cores;
  target >= 0.7), measured in ``--rounds`` alternating pairs on the same warm server (``generate``,
  then 16 clients, then the other way round, ...): the median of the per-pair ratios, beside their
  spread (``vs_hf_rounds``: each pair's two figures and ratio). On shared cores ``generate``'s own
  speed moves 1.5x within minutes, so a ratio of two figures taken apart is as noisy as that. The
  limit is the best of four ``generate`` runs a round against one served level, so noise favours it;
  ``vs_hf_mean_run`` takes the same rounds against the mean of the better thread count's two runs
  (one figure of each side's typical run), beside it, not instead.
  ``cpu_ms_per_token_p50`` (and each round's ``cpu_ms_per_token``): CPU per completion token, from
  /proc, of the server process, its agents together (each in the round), the clients (this process
  while they ran) and ``generate`` (its own process time): what the served path spends where, which
  a tokens/s ratio on loaded cores hides; the agents' also by thread, from /proc/PID/task: ``agents_control``
  (their control threads, named ``agent-control``, which ``serve --local`` places with the server),
  ``agents_zmq_io`` (libzmq's IO threads) and ``agents_worker_and_rest`` (nearly all the stages' workers; a
  checkout whose agents do not name their control thread counts it here). The clients are not placed: they
  run where the scheduler puts them, the agents' core included (remote clients would not). With ``--baseline TREE`` that checkout's server is a third side
  of each round (the order rotating): ``baseline_vs_hf_batched``, ``vs_baseline`` (this tree's tokens/s
  over the baseline's, per round, median) and the baseline's CPU per token.
- ``http_overhead_ms_p50``: the median, over ``--pairs`` pairs, of one client's TTFT through an
  idle server minus the TTFT ``edgeshard run`` reports (``core.runs.generation.generate``, its
  figures: the run machinery ``edgeshard run`` uses, in this process, over its own local agents of
  the same plan and threads, loaded once and kept warm beside the server's) for the same prompt,
  the two taken one right after the other (which goes first alternates): the cost of HTTP, JSON,
  tokenization, queueing, recording and joining the open run (target <= 5 ms). Beside it both
  sides' medians, ``http_in_out_ms_p50`` (client TTFT − the server's own, from the request's
  admission) and ``join_ttft_ms_p50`` (the recorded request's TTFT, from its join). ``edgeshard run``'s
  figure is its token's time at the last stage; ``http_overhead_vs_arrival_ms_p50`` takes the same pairs
  against the token's arrival in the run's coordinator process (``edgeshard_run_arrival_ttft_ms_p50``),
  so both sides pay that hop, and ``server_last_hop_ms_p50`` is the hop on the server's side. With
  ``--baseline TREE`` a server of that checkout is a third side of each pair (``baseline_*`` figures,
  ``vs_baseline_ms_p50``): before and after a change in the same minutes.
- ``late_join``: a long request (4 × ``--new-tokens``) streams, and a short one is sent once
  the long one has its 4th token: the short one's TTFT, and the long one's time left then (the
  short one joins between the long one's steps, not after it).
- ``soak``: ``--soak`` requests from 32 clients on the 2-stage server, a tenth disconnecting
  mid-stream and a tenth malformed: how many were answered completely or with a clean error
  (must be all), and the server's RSS before and after.

The 1-minute load average is reported before and after: on shared cores figures swing.
Usage: python bench/serve.py [--new-tokens 32] [--requests 2] [--rounds 9] [--pairs 16] [--soak 300]
       [--baseline OTHER_CHECKOUT]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agents.arguments import int_in  # noqa: E402  (a bad number is one line and exit 2, before any work)
from agents.process_title import CONTROL_THREAD_NAME  # noqa: E402  (the name an agent gives its control thread)

PROMPTS = ["the river ran", "a cat sat on", "once upon a time", "snow fell on the", "the king said to",
           "we went to the", "in the morning", "she looked at", "the old man", "far away there",
           "it was a dark", "he ran into", "my friend and", "under the bridge", "the ship sailed", "at the end"]


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


class Server:
    def __init__(self, folder: Path, model: Path, plan: Path, stages: int, threads: int, tree: Path = ROOT) -> None:
        """``edgeshard serve`` of the checkout ``tree`` (its code and its agents')."""
        folder.mkdir(exist_ok=True)
        self.workspace = folder / "ws.sqlite"
        argv = [sys.executable, "-m", "core.cli", "serve", "--model", str(model), "--plan", str(plan), "--local",
                "--port", "0", "--workspace", str(self.workspace), "--mode", "no-bubbles", "--served-model-name", "demo",
                "--micro-batches", str(stages), "--threads", str(threads), "--max-queue", "256"]
        self.proc = subprocess.Popen(argv, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = ""
        while "serves" not in line:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                raise SystemExit("edgeshard serve did not start")
        url = line.split()[2]
        self.host, port = url.removeprefix("http://").removesuffix("/v1").split(":")
        self.port = int(port)

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


def stream_once(srv: Server, prompt: str, new_tokens: int, *, drop_after: int | None = None,
                body: bytes | None = None) -> dict:
    """One streaming completion; times at the client. ``drop_after``: disconnect after that many pieces."""
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=300)
    payload = body if body is not None else json.dumps(
        {"model": "demo", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True}).encode()
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", payload, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = {"status": resp.status, "pieces": 0, "done": False, "id": None}
    if resp.status != 200:
        error = json.loads(resp.read()).get("error", {})
        out["error"] = f'{error.get("type")}: {error.get("message")}'
        conn.close()
        return out
    first = last = None
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            out["done"] = True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            out["error"] = f'{chunk["error"]["type"]}: {chunk["error"]["message"]}'
            break
        out["id"] = chunk["id"]
        if chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:  # a token's chunk (its text may
            now = time.perf_counter()                                         # wait for a character's last byte)
            first = first or now
            last = now
            out["pieces"] += 1
            if drop_after is not None and out["pieces"] >= drop_after:
                conn.sock.close()
                break
    conn.close()
    out["ttft_s"] = None if first is None else first - t0
    out["span_s"] = None if first is None else last - first
    return out


def load_level(srv: Server, clients: int, requests: int, new_tokens: int) -> dict:
    def client(i: int) -> list[dict]:
        return [stream_once(srv, PROMPTS[(i + k) % len(PROMPTS)], new_tokens) for k in range(requests)]

    t0, cpu0 = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(client, range(clients)) for r in rs]
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    failed = [r for r in results if r["id"] is None]
    results = [r for r in results if r["id"] is not None]
    ids = [r["id"] for r in results]
    tokens = _completion_tokens(srv, ids)
    ttft = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    tpot = [r["span_s"] / (tokens[r["id"]] - 1) for r in results if r["ttft_s"] is not None and tokens[r["id"]] > 1]
    return {"clients": clients, "requests": len(results) + len(failed), "all_done": all(r["done"] for r in results)
            and not failed, "errors": [(r["status"], r.get("error")) for r in failed],
            "tokens_per_s": sum(tokens.values()) / wall, "wall_s": wall, "clients_cpu_s": cpu, "ttft_ms_p50": _pct(ttft, .5) * 1e3,
            "ttft_ms_p99": _pct(ttft, .99) * 1e3, "tpot_ms_p50": _ms(_pct(tpot, .5)), "tpot_ms_p99": _ms(_pct(tpot, .99))}


def _ms(v):
    return None if v is None else v * 1e3


def _recorded(srv: Server, ids: list[str]) -> dict[str, object]:
    from core.sessions.store import SessionStore

    deadline = time.monotonic() + 30
    while True:
        with SessionStore(srv.workspace) as store:
            runs = {r.settings.get("request_id"): r for r in store.runs()}
        if all(i in runs and runs[i].status != "running" for i in ids) or time.monotonic() > deadline:
            return runs
        time.sleep(0.05)  # the server is still recording them: leave it the cores


def _completion_tokens(srv: Server, ids: list[str]) -> dict[str, int]:
    runs = _recorded(srv, ids)
    return {i: int(runs[i].figures.get("completion_tokens", 0)) for i in ids}


class RunPath:
    """``edgeshard run``'s own path (``core.runs.generation.generate``) over local agents of ``plan``,
    loaded once and kept warm: each ``ttft_s`` is one prompt run as ``edgeshard run --prompt`` runs it."""

    def __init__(self, model: Path, plan_path: Path, new_tokens: int, threads: int) -> None:
        from core import formats
        from core.devices.local_cluster import LocalCluster
        from core.planning.plan import ShardPlan
        from core.runs.coordinator import Coordinator
        from core.runs.generation import GenerationSettings

        self.model, self.plan = str(model), formats.load(plan_path, ShardPlan)
        self.settings = GenerationSettings(max_new_tokens=new_tokens, mode="no-bubbles",
                                           micro_batches=len(self.plan.stages), threads=threads)
        self._tmp = tempfile.TemporaryDirectory(prefix="bench-run-")
        self._cluster = LocalCluster(self._tmp.name, list(self.plan.devices()), threads_per_agent=threads)
        self._cluster.__enter__()
        self._coord = Coordinator(self._cluster.endpoints, self._cluster.keys)
        self._coord.__enter__()
        self.ttft_s("warm up", load=True)

    def ttft_s(self, prompt: str, *, load: bool = False) -> tuple[float, float]:
        """The TTFT the run reports (its first token's time at the last stage, on the run's clock), and the
        first token's arrival here (the coordinator's process, where ``edgeshard run`` prints it)."""
        from core.runs.generation import generate

        coord, arrived = self._coord, []

        class FirstArrival:
            def on_event(self, event) -> None:
                pass

            def on_tokens(self, tokens) -> None:
                if not arrived:
                    arrived.append(time.time() - coord.active_run.t0)

        got = generate(coord, self.plan, self.model, [prompt], self.settings, load=load, sink=FirstArrival())
        return got.figures.ttft_s, arrived[0]

    def close(self) -> None:
        self._coord.__exit__(None, None, None)
        self._cluster.__exit__(None, None, None)
        self._tmp.cleanup()


def http_overhead(srv: Server, run: RunPath, new_tokens: int, pairs: int, base: Server | None = None) -> dict:
    """Per pair, the same prompt through the idle server (client TTFT) and through ``edgeshard run``'s
    path (its reported TTFT), one right after the other, which goes first alternating; medians of the
    per-pair differences and of each side, with the server's own view of the request (its recording).
    ``base``: a server of another checkout, a third side in rotating order (``baseline_*``, and
    ``vs_baseline_ms_p50``: the median of this tree's client TTFT minus the baseline's, per triple)."""
    servers = [srv] if base is None else [srv, base]
    results: list[list[dict]] = [[] for _ in servers]
    run_ttfts = []
    sides = list(range(len(servers) + 1))  # the last one is edgeshard run's
    for k in range(pairs):
        prompt = PROMPTS[k % len(PROMPTS)]
        for side in sides[k % len(sides):] + sides[:k % len(sides)]:
            time.sleep(0.3)  # both clusters idle (the last request recorded: 0.25 s after its end) when it arrives
            if side == len(servers):
                run_ttfts.append(run.ttft_s(prompt))
            else:
                results[side].append(stream_once(servers[side], prompt, new_tokens))
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    out: dict = {}
    for server, got, prefix in zip(servers, results, ("", "baseline_")):
        runs = _recorded(server, [r["id"] for r in got])
        rows = [(r["ttft_s"], ref, arrived, runs[r["id"]].figures) for r, (ref, arrived) in zip(got, run_ttfts)
                if r["ttft_s"] is not None and runs[r["id"]].figures.get("ttft_s") is not None]
        diffs = [c - ref for c, ref, _, _ in rows]
        out.update({f"{prefix}http_overhead_ms_p50": med(diffs),
                    f"{prefix}http_overhead_ms_min_max": [min(diffs) * 1e3, max(diffs) * 1e3],
                    f"{prefix}pairs": len(rows), f"{prefix}client_ttft_ms_p50": med([c for c, _, _, _ in rows]),
                    # the same pairs against the first token's arrival in edgeshard run's process (both sides then
                    # pay the token's hop from the last stage), and that hop on the server's side
                    f"{prefix}http_overhead_vs_arrival_ms_p50": med([c - a for c, _, a, _ in rows]),
                    f"{prefix}join_ttft_ms_p50": med([f["ttft_s"] for _, _, _, f in rows]),
                    f"{prefix}server_last_hop_ms_p50": med([f["server_ttft_s"] - f["queue_s"] - f["ttft_s"]
                                                            for _, _, _, f in rows]),
                    f"{prefix}http_in_out_ms_p50": med([c - f["server_ttft_s"] for c, _, _, f in rows])})
    out["edgeshard_run_ttft_ms_p50"] = med([ref for ref, _ in run_ttfts])
    out["edgeshard_run_arrival_ttft_ms_p50"] = med([a for _, a in run_ttfts])
    if base is not None:
        out["vs_baseline_ms_p50"] = med([a["ttft_s"] - b["ttft_s"] for a, b in zip(*results)
                                         if a["ttft_s"] is not None and b["ttft_s"] is not None])
    return out


def late_join(srv: Server, new_tokens: int) -> dict:
    """A short request sent while a long one decodes: its TTFT against the long one's time left."""
    long_out: dict = {}
    got_four = threading.Event()

    def long_one():
        conn = http.client.HTTPConnection(srv.host, srv.port, timeout=300)
        conn.request("POST", "/v1/completions", json.dumps({"model": "demo", "prompt": "the long one",
                     "max_tokens": 4 * new_tokens, "temperature": 0, "stream": True}).encode(),
                     {"Content-Type": "application/json"})
        resp, n = conn.getresponse(), 0
        while line := resp.readline():
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                n += 1
                if n == 4:
                    got_four.set()
        long_out["end"] = time.perf_counter()
        conn.close()

    t = threading.Thread(target=long_one)
    t.start()
    got_four.wait(60)
    sent = time.perf_counter()
    short = stream_once(srv, "a short one", 4)
    t.join()
    return {"short_ttft_ms": short["ttft_s"] * 1e3, "long_left_ms_when_sent": (long_out["end"] - sent) * 1e3}


PLAN_BOUNDS = {2: [4], 3: [3, 6]}
"""The 2- and 3-stage plans' boundaries over the model's 8 units (embeddings, 6 blocks, head)."""


def encoded_prompts(model: Path):
    """The 16 prompts through ``model``'s tokenizer, left-padded (as batched ``generate`` takes them)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    tok.padding_side = "left"
    return tok(PROMPTS, return_tensors="pt", padding=True)


class HfBatched:
    """transformers' in-process batched ``generate`` of the 16 prompts (the limit on these cores)."""

    def __init__(self, model: Path, new_tokens: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch, self.new_tokens = torch, new_tokens
        self.m = AutoModelForCausalLM.from_pretrained(model).eval()
        self.enc = encoded_prompts(model)
        self.tokens_per_s(1)  # warm up

    def tokens_per_s(self, threads: int) -> float:
        return self.timed(threads)[0]

    def timed(self, threads: int) -> tuple[float, float]:
        """Tokens/s of one ``generate`` of the 16 prompts, and its CPU per token (ms; this process's)."""
        self.torch.set_num_threads(threads)
        t0, cpu0 = time.perf_counter(), time.process_time()
        with self.torch.no_grad():
            out = self.m.generate(**self.enc, max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens,
                                  do_sample=False, pad_token_id=0, eos_token_id=2)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        tokens = (out.shape[1] - self.enc["input_ids"].shape[1]) * len(PROMPTS)
        return tokens / wall, cpu / tokens * 1e3

    def best(self) -> dict[int, tuple[float, float, float]]:
        """Per thread count (1 and 2): the faster of two runs' (tokens/s, CPU ms per token), and the two runs'
        mean tokens/s."""
        out = {}
        for t in (1, 2):
            runs = [self.timed(t) for _ in range(2)]
            out[t] = (*max(runs, key=lambda got: got[0]), statistics.fmean(got[0] for got in runs))
        return out


def _stat_cpu_s(stat: Path) -> float:
    """CPU seconds (user + system) in a /proc ``stat`` file (a process's, or one thread's under ``task/``)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used, from /proc."""
    return _stat_cpu_s(Path(f"/proc/{pid}/stat"))


def _thread_kind(name: str) -> str:
    """An agent's thread by its kernel name: its control thread (``agent-control``, placed with the server),
    libzmq's IO thread(s), or the rest (the stage's worker, whose forwards are nearly all of it, and idle ones)."""
    return ("control" if name == CONTROL_THREAD_NAME else "zmq_io" if name.startswith("ZMQbg/IO")
            else "worker_and_rest")


def _cpu_s_by_thread_kind(pid: int) -> dict[str, float]:
    """CPU seconds a process's live threads have used, by ``_thread_kind``, from /proc/PID/task."""
    out = {"control": 0.0, "zmq_io": 0.0, "worker_and_rest": 0.0}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            cpu_s = _stat_cpu_s(Path(f"/proc/{pid}/task/{tid}/stat"))
        except OSError:
            continue
        out[_thread_kind(name)] += cpu_s
    return out


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (the server's zygote and the agents it forked), from /proc."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, todo = [], [pid]
    while todo:
        kids = [p for p, pp in parent.items() if pp == todo[-1]]
        todo.pop()
        found += kids
        todo += kids
    return sorted(found)


def served_cpu(srv: Server, clients: int, requests: int, new_tokens: int) -> dict:
    """``load_level`` with each process's CPU per completion token (ms): the server, its agents (and their
    zygote), the clients (this process, while they ran)."""
    pids = [srv.proc.pid, *_descendants(srv.proc.pid)]
    before = {p: _cpu_s(p) for p in pids}
    kinds_before = {p: _cpu_s_by_thread_kind(p) for p in pids[1:]}
    got = load_level(srv, clients, requests, new_tokens)
    after = {p: _cpu_s(p) for p in pids}
    kinds_after = {p: _cpu_s_by_thread_kind(p) for p in pids[1:]}
    tokens = got["tokens_per_s"] * got["wall_s"]
    per = {p: (after[p] - before[p]) / tokens * 1e3 for p in pids}
    got["cpu_ms_per_token"] = {"server": per[srv.proc.pid], "agents": [per[p] for p in pids[1:] if per[p] > 0],
                               "clients": got["clients_cpu_s"] / tokens * 1e3}
    for kind in ("control", "zmq_io", "worker_and_rest"):  # a thread that ended meanwhile is left out
        got["cpu_ms_per_token"][f"agents_{kind}"] = sum(kinds_after[p][kind] - kinds_before[p][kind]
                                                        for p in pids[1:]) / tokens * 1e3
    return got


def vs_hf_rounds(srv: Server, hf: HfBatched, rounds: int, requests: int, new_tokens: int,
                 base: Server | None = None) -> dict:
    """``rounds`` rounds of (``generate`` of the 16 prompts, 16 server clients), which goes first
    alternating: the median of the per-round ratios and their spread, with each side's CPU per token.
    ``base``: a server of another checkout, a third side, the order rotating (each side in each place once
    every three rounds): ``baseline_vs_hf_batched``, ``vs_baseline`` (this tree's tokens/s over the
    baseline's, per round) and the baseline's CPU per token, before and after a change in the same minutes."""
    sides = ("hf", "srv") if base is None else ("hf", "srv", "base")
    pairs = []
    for k in range(rounds):
        got: dict = {}
        for side in sides[k % len(sides):] + sides[:k % len(sides)]:
            got[side] = hf.best() if side == "hf" else served_cpu(srv if side == "srv" else base, 16, requests,
                                                                  new_tokens)
        threads = max(got["hf"], key=lambda t: got["hf"][t][0])
        limit, hf_cpu, typical = got["hf"][threads]
        pair = {"hf_tokens_per_s": limit, "hf_threads": threads, "hf_mean_run_tokens_per_s": typical,
                "load_1min": os.getloadavg()[0]}
        for side, prefix in (("srv", ""), ("base", "baseline_")):
            if side in got:
                cpu = got[side]["cpu_ms_per_token"]
                pair |= {f"{prefix}server_tokens_per_s": got[side]["tokens_per_s"],
                         f"{prefix}all_done": got[side]["all_done"], f"{prefix}ratio": got[side]["tokens_per_s"] / limit,
                         f"{prefix}ratio_to_mean_run": got[side]["tokens_per_s"] / typical,
                         f"{prefix}cpu_ms_per_token": {**cpu, "agents_total": sum(cpu["agents"]), "generate": hf_cpu}}
        pairs.append(pair)
    out = {"hf_batched_16_tokens_per_s_p50": statistics.median(p["hf_tokens_per_s"] for p in pairs)}
    for prefix in ("",) if base is None else ("", "baseline_"):
        ratios = [p[f"{prefix}ratio"] for p in pairs]
        out |= {f"{prefix}vs_hf_batched": statistics.median(ratios), f"{prefix}vs_hf_min_max": [min(ratios), max(ratios)],
                f"{prefix}vs_hf_mean_run": statistics.median(p[f"{prefix}ratio_to_mean_run"] for p in pairs),
                f"{prefix}clients_16_tokens_per_s_p50": statistics.median(p[f"{prefix}server_tokens_per_s"] for p in pairs),
                f"{prefix}cpu_ms_per_token_p50": {k: statistics.median(p[f"{prefix}cpu_ms_per_token"][k] for p in pairs)
                                                  for k in ("server", "agents_total", "agents_control", "agents_zmq_io",
                                                            "agents_worker_and_rest", "clients", "generate")}}
    if base is not None:
        out["vs_baseline"] = statistics.median(p["server_tokens_per_s"] / p["baseline_server_tokens_per_s"] for p in pairs)
    return out | {"vs_hf_rounds": pairs}


def soak(srv: Server, total: int, new_tokens: int) -> dict:
    rss0 = srv.rss_kib()
    rng = random.Random(0)
    kinds = ["drop" if k % 10 == 0 else "bad" if k % 10 == 5 else "ok" for k in range(total)]
    rng.shuffle(kinds)

    def one(k: int) -> tuple[str, dict]:
        kind = kinds[k]
        if kind == "bad":
            return kind, stream_once(srv, "", new_tokens, body=b'{"model": "demo", "prompt": 5')
        return kind, stream_once(srv, PROMPTS[k % len(PROMPTS)], new_tokens,
                                 drop_after=2 if kind == "drop" else None)

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(total)))
    ok = [r for k, r in results if k == "ok"]
    bad = [r for k, r in results if k == "bad"]
    answered = sum(r["done"] or "error" in r for r in ok)
    after = stream_once(srv, "the river", 4)  # still answers once the soak is over
    return {"requests": total, "well_formed": len(ok), "answered_completely_or_clean_error": answered,
            "answered_completely": sum(r["done"] for r in ok), "errors": sorted({r["error"] for r in ok if "error" in r}),
            "malformed_400": sum(r["status"] == 400 for r in bad), "malformed": len(bad),
            "disconnected": kinds.count("drop"), "answers_after": after["done"],
            "rss_mib_before": rss0 / 1024, "rss_mib_after": srv.rss_kib() / 1024}


def _stage_counts(text: str) -> tuple[int, ...]:
    """``--stages``: the plans this bench knows (2 and 3 stages), comma-separated, each once."""
    parts = [p.strip() for p in text.split(",")]
    if any(p not in ("2", "3") for p in parts) or len(set(parts)) != len(parts):
        raise argparse.ArgumentTypeError(f"must be 2, 3 or 2,3 (the plans this bench makes), got {text!r}")
    return tuple(int(p) for p in parts)


def _checkpoint(text: str) -> Path:
    """``--model``: a checkpoint the agents can run (``check_model_dir``) of 6 blocks (the 2- and 3-stage plans
    split 6)."""
    from core.errors import UnsupportedModelError
    from core.models.checkpoints import check_model_dir

    try:
        layers = check_model_dir(text).layers
    except UnsupportedModelError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not a checkpoint the agents can run: {err}") from None
    if layers != 6:
        raise argparse.ArgumentTypeError(f"{text!r} has {layers} blocks; this bench's plans split 6")
    return Path(text)


def checkout_arg(text: str) -> Path:
    """``--baseline``: a checkout of this project (its ``core/cli`` is what the baseline's server runs)."""
    path = Path(text)
    if not (path / "core" / "cli").is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a checkout of this project (no core/cli in it); "
                                         "make one with: git worktree add --detach DIR REV")
    return path.resolve()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=_checkpoint, help="checkpoint dir of a 6-block model (default: the demo recipe, "
                    "random weights, in a temp dir)")
    ap.add_argument("--new-tokens", type=int_in(2, 256), default=32, help="tokens per request (2-256)")
    ap.add_argument("--requests", type=int_in(1, 100), default=2, help="requests per client per level")
    ap.add_argument("--threads", type=int_in(1, 64), default=1, help="torch threads per agent")
    ap.add_argument("--rounds", type=int_in(0, 1000), default=9, help="alternating (generate, 16 clients) pairs per "
                    "plan: one pair's ratio spread 0.54-0.83 on 3 stages within minutes (stop 41), so the median "
                    "takes 9 (0: none)")
    ap.add_argument("--pairs", type=int_in(0, 1000), default=16,
                    help="alternating (server, edgeshard run) TTFT pairs per plan (0: none)")
    ap.add_argument("--stages", type=_stage_counts, default=(2, 3), help="plans to bench, by stage count: 2, 3 or 2,3")
    ap.add_argument("--soak", type=int_in(0, 100_000), default=300, help="soak requests (0: no soak)")
    ap.add_argument("--baseline", type=checkout_arg, help="another checkout (e.g. main's) whose server runs beside this "
                    "tree's in the HTTP-cost pairs and the vs-generate rounds, in rotating order: before/after in "
                    "the same minutes")
    args = ap.parse_args()
    from core import formats
    from core.models.checkpoints import ModelRecipe, make_model
    from core.planning.plan import plan_from_boundaries

    load_before = os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    model = args.model if args.model else make_model(
        ModelRecipe(family="llama", layers=6, hidden=128, heads=4, kv_heads=2, vocab=4096, seed=7), tmp / "demo")
    units = 8  # embeddings, 6 blocks, head
    out: dict = {"bench": "serve", "new_tokens": args.new_tokens, "load_1min_before": load_before,
                 "clients_placed": "no: the clients' threads run where the scheduler puts them, the agents' cores "
                                   "included (remote clients would not)"}
    hf = HfBatched(model, args.new_tokens) if args.rounds else None
    for stages in args.stages:
        folder = tmp / f"s{stages}"
        folder.mkdir()
        plan = folder / "plan.json"
        formats.save(plan, plan_from_boundaries("demo", units, [f"edge-{i}" for i in range(stages)],
                                                PLAN_BOUNDS[stages]))
        srv = Server(folder, model, plan, stages, args.threads)
        run = base = None
        res: dict = {}
        try:
            stream_once(srv, "warm up", 4)
            levels = {c: load_level(srv, c, args.requests, args.new_tokens) for c in (1, 4, 16)}
            res.update({f"clients_{c}": v for c, v in levels.items()})
            res["sixteen_vs_one"] = levels[16]["tokens_per_s"] / levels[1]["tokens_per_s"]
            if args.baseline is not None and (args.pairs or hf is not None):
                base = Server(folder / "baseline", model, plan, stages, args.threads, tree=args.baseline)
                stream_once(base, "warm up", 4)
            if args.pairs:
                run = RunPath(model, plan, args.new_tokens, args.threads)
                res.update(http_overhead(srv, run, args.new_tokens, args.pairs, base))
                run.close()
                run = None
            if hf is not None:
                res.update(vs_hf_rounds(srv, hf, args.rounds, args.requests, args.new_tokens, base))
            res["late_join"] = late_join(srv, args.new_tokens)
            if stages == 2 and args.soak:
                res["soak"] = soak(srv, args.soak, args.new_tokens)
        finally:
            if run is not None:
                run.close()
            if base is not None:
                res["baseline_exit_status"] = base.stop()
            res["exit_status"] = srv.stop()
        out[f"stages_{stages}"] = res
    out["load_1min_after"] = os.getloadavg()[0]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
