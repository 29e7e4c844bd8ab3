"""What this machine charges a message that follows idleness, with no runtime at all; one JSON line.

In a sequential 4-stage decode each stage waits ≈ ¾ of a token (≈ 36 ms here) for the other
three, then receives an activation. This bench times the floor under any runtime's hop: two
processes, raw blocking TCP on loopback, 16 KiB + an 8-byte send timestamp one way (the size
of the benchmark Llama's 1×4096 fp32 activation), CLOCK_MONOTONIC on both sides, the sender
waiting ``gap`` before each message, for gaps of 0, 2, 10 and 36 ms:

- ``blocking``: the receiver sleeps in ``recv`` (as a stage's threads do) and the sender
  sleeps through the gap — what a hop pays for both sides having been idle;
- ``spinning``: both spin through the gap (the receiver polls a non-blocking socket, the
  sender busy-waits) — no thread sleeps and no CPU halts, so what remains is what idleness
  costs the cache and TLB state of the message path, not a wake-up.

Medians (and 10th/90th percentiles) in µs, over 150 messages per row after 10 warm-up ones.

And the runtime's own code in the same conditions: ``framing_after_{gap}ms`` times, on one
thread, what a stage does to frame its output before the send (``tensor_frame``,
``DataHeader``, ``data_message`` for a 1×1×4096 fp32 activation) after sleeping ``gap`` —
thread CPU time (µs), so it is the code running slower, not waiting for a core.
Usage: python bench/investigations/wake_after_idle.py [--messages 150]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import sys
import time
from multiprocessing import Process, Queue
from pathlib import Path

_HERE = Path(__file__).resolve()
sys.path[:0] = [str(_HERE.parents[2]), str(_HERE.parents[1])]  # this checkout's code, bench/'s shared modules

from agents.arguments import int_in  # noqa: E402

SIZE = 16384
GAPS_MS = (0, 2, 10, 36)


def receive(port: int, n: int, spin: bool, out: Queue) -> None:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(1)
    out.put("ready")
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.setblocking(not spin)
    buf = bytearray(SIZE + 8)
    view = memoryview(buf)
    delays = []
    for _ in range(n):
        got = 0
        while got < SIZE + 8:
            try:
                got += conn.recv_into(view[got:], SIZE + 8 - got)
            except BlockingIOError:
                pass
        delays.append((time.perf_counter() - struct.unpack("<d", buf[:8])[0]) * 1e6)
        conn.setblocking(True)
        conn.sendall(b"k")
        conn.setblocking(not spin)
    out.put(delays)


def send(port: int, n: int, gap_s: float, spin: bool) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = os.urandom(SIZE)
    for _ in range(n):
        if spin:
            end = time.perf_counter() + gap_s
            while time.perf_counter() < end:
                pass
        elif gap_s:
            time.sleep(gap_s)
        sock.sendall(struct.pack("<d", time.perf_counter()) + payload)
        sock.recv(1)
    sock.close()


def one_row(port: int, n: int, gap_ms: float, spin: bool) -> dict[str, float]:
    q: Queue = Queue()
    p = Process(target=receive, args=(port, n + 10, spin, q))
    p.start()
    q.get(timeout=30)
    send(port, n + 10, gap_ms / 1e3, spin)
    delays = sorted(q.get(timeout=60)[10:])
    p.join(timeout=10)
    return {"median": round(statistics.median(delays), 1), "p10": round(delays[len(delays) // 10], 1),
            "p90": round(delays[9 * len(delays) // 10], 1)}


def framing_cpu_us(gap_s: float, n: int) -> dict[str, float]:
    import torch
    from hop_trace import frame_activation  # this folder: the script's own

    x = torch.randn(1, 1, 4096)
    cpu = []
    for i in range(n + 10):
        if gap_s:
            time.sleep(gap_s)
        started = time.thread_time()
        frame_activation(x)
        if i >= 10:
            cpu.append((time.thread_time() - started) * 1e6)
    cpu.sort()
    return {"median": round(statistics.median(cpu), 1), "p10": round(cpu[len(cpu) // 10], 1),
            "p90": round(cpu[9 * len(cpu) // 10], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int_in(1, 100_000), default=150, help="timed messages per row")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    out: dict = {"bench": "wake_after_idle", "unit": "µs one way, 16 KiB on loopback TCP",
                 "cpus": os.cpu_count()}
    port = 47100 + os.getpid() % 500
    for mode, spin in (("blocking", False), ("spinning", True)):
        for gap in GAPS_MS:
            out[f"{mode}_after_{gap}ms"] = one_row(port, args.messages, gap, spin)
            port += 1
    for gap in GAPS_MS:
        out[f"framing_after_{gap}ms"] = framing_cpu_us(gap / 1e3, min(args.messages, 80))
    out["load_avg_1min_before_after"] = [round(load, 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
