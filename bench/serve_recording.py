"""What recording costs `edgeshard serve`: the server process's CPU per token, side by side; one JSON line.

Why its own script (``bench/serve.py`` measures the whole serving path): recording shares a
micro-batch's timeline events between the requests in it, and what that saves is the server
process's own CPU, which ``bench/serve.py`` does not read. Here each configuration is a real
server (``python -m core.cli serve --local`` on a 2-stage plan of the demo recipe, recording into
a temp workspace) started from a source tree (``--tree``: e.g. a ``git archive`` of main beside
this checkout), and ``--clients`` concurrent streaming clients each send ``--requests`` greedy
requests of ``--new-tokens``; rounds alternate the trees (interleaved, so the host's load falls
on both alike). Per tree and round:

- ``server_cpu_ms_per_token``: the server process's user+system CPU (``/proc/PID/stat``, its own,
  not its agents') over the level, per completion token the clients streamed;
- ``tokens_per_s``: those tokens over the level's wall time;
- ``event_rows`` / ``runs``: timeline rows the workspace holds after the level (``events`` plus
  ``stream_events`` where the tree has it) and recorded runs.

``--no-record`` adds a configuration of the first tree with recording off (the floor). The
1-minute load is reported per round. Usage:
``python bench/serve_recording.py --tree before=/tmp/main-tree --tree after=. --rounds 3``
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = ["the river ran", "a cat sat on", "once upon a time", "snow fell on the", "the king said to",
           "we went to the", "in the morning", "she looked at", "the old man", "far away there",
           "it was a dark", "he ran into", "my friend and", "under the bridge", "the ship sailed", "at the end"]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` itself (fields 14 and 15 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Server:
    def __init__(self, tree: Path, folder: Path, model: Path, plan: Path, record: bool) -> None:
        self.workspace = folder / "ws.sqlite"
        argv = [sys.executable, "-m", "core.cli", "serve", "--model", str(model), "--plan", str(plan), "--local",
                "--port", "0", "--mode", "no-bubbles", "--served-model-name", "demo", "--micro-batches", "2",
                "--threads", "1", "--max-queue", "256"]
        argv += ["--workspace", str(self.workspace)] if record else ["--no-record"]
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        line = ""
        while "serves" not in line:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                raise SystemExit(f"edgeshard serve ({tree}) did not start")
        self.host, port = line.split()[2].removeprefix("http://").removesuffix("/v1").split(":")
        self.port = int(port)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


def stream_tokens(srv: Server, prompt: str, new_tokens: int) -> int:
    """One streaming greedy completion; the completion tokens its last chunk's usage reports."""
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=300)
    body = {"model": "demo", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    tokens = 0
    for line in resp:
        if line.startswith(b"data: {"):
            usage = json.loads(line[6:]).get("usage")
            if usage:
                tokens = usage["completion_tokens"]
    conn.close()
    return tokens


def rows(workspace: Path) -> dict:
    if not workspace.exists():
        return {}
    conn = sqlite3.connect(workspace)
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    events = sum(conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("events", "stream_events")
                 if t in tables)
    out = {"event_rows": events, "runs": conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0]}
    conn.close()
    return out


def level(tree: Path, folder: Path, model: Path, plan: Path, record: bool, clients: int, requests: int,
          new_tokens: int) -> dict:
    folder.mkdir(parents=True)
    srv = Server(tree, folder, model, plan, record)
    try:
        stream_tokens(srv, "warm up", 4)
        time.sleep(0.5)
        load = os.getloadavg()[0]
        cpu0, t0 = cpu_s(srv.proc.pid), time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            tokens = sum(pool.map(lambda i: sum(stream_tokens(srv, PROMPTS[(i + k) % len(PROMPTS)], new_tokens)
                                                for k in range(requests)), range(clients)))
        wall = time.perf_counter() - t0
        time.sleep(0.6)  # the last recordings close (their events' lag) and are counted in the CPU
        cpu = cpu_s(srv.proc.pid) - cpu0
    finally:
        code = srv.stop()
    return {"load_1min": load, "tokens": tokens, "tokens_per_s": tokens / wall,
            "server_cpu_ms_per_token": cpu / max(tokens, 1) * 1e3, "exit_status": code, **rows(srv.workspace)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH of a source tree (repeatable)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-record", action="store_true", help="also the first tree with recording off")
    args = ap.parse_args()
    from core import formats
    from core.models.checkpoints import ModelRecipe, make_model
    from core.planning.plan import plan_from_boundaries

    trees = [(n, Path(p).resolve()) for n, p in (t.split("=", 1) for t in args.tree)]
    configs = [(n, p, True) for n, p in trees] + ([(f"{trees[0][0]}-no-record", trees[0][1], False)]
                                                  if args.no_record else [])
    tmp = Path(tempfile.mkdtemp(prefix="bench-serve-rec-"))
    model = make_model(ModelRecipe(family="llama", layers=6, hidden=128, heads=4, kv_heads=2, vocab=4096, seed=7),
                       tmp / "demo")
    plan = tmp / "plan.json"
    formats.save(plan, plan_from_boundaries("demo", 8, ["edge-0", "edge-1"], [4]))
    out: dict = {"bench": "serve_recording", "clients": args.clients, "requests": args.requests,
                 "new_tokens": args.new_tokens, "rounds": {}}
    for k in range(args.rounds):
        for name, tree, record in (configs if k % 2 == 0 else configs[::-1]):
            res = level(tree, tmp / f"{name}-{k}", model, plan, record, args.clients, args.requests, args.new_tokens)
            out["rounds"].setdefault(name, []).append(res)
            print(name, k, json.dumps(res), file=sys.stderr, flush=True)
    out["median"] = {name: {key: statistics.median(r[key] for r in rs)
                            for key in ("server_cpu_ms_per_token", "tokens_per_s", "load_1min")}
                     for name, rs in out["rounds"].items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
