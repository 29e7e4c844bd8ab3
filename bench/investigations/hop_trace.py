"""Where a hop's own CPU goes: each step of the stage loop's hot path, timed alone; one JSON line.

A hop between two stages runs, on the sender's worker thread: frame the output
(``tensor_frame``, ``DataHeader``, ``data_message``), hand it to libzmq (``send_multipart``);
libzmq's IO threads encrypt (CurveZMQ), write, read and decrypt it; on the receiver's worker
thread: ``recv_multipart``, ``decode_data``, the frame checks, ``tensor_from_frame``, then
compute. Around each step the runtime records timeline events (``AgentEvent`` + deque).
Per decode step each stage also pays fixed costs before its blocks: positions, the
attention mask, the rotary embedding, and the KV cache keyword transformers deprecates.

This bench times every one of those pieces on one thread with ``time.thread_time`` (CPU
seconds of the calling thread, which a loaded machine moves least), for the benchmark
Llama's activation (1×1×hidden fp32), plus one framed round trip through a CurveZMQ
PUSH/PULL pair in this process (the worker-thread CPU of send and of receive). What a hop
costs beyond the sum is waiting: the IO threads' and the worker's wake-ups, which on a
shared 2-core machine wait for a core (``bench/runtime.py`` measures the hop's wall time).

Usage: python bench/investigations/hop_trace.py [--model DIR] [--n 2000]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
import warnings
from pathlib import Path

_HERE = Path(__file__).resolve()
sys.path[:0] = [str(_HERE.parents[2]), str(_HERE.parents[1])]  # this checkout's code, bench/'s shared modules

import torch  # noqa: E402
import zmq  # noqa: E402

from agents.protocol import DataHeader  # noqa: E402
from agents.transport import data_message, tensor_frame  # noqa: E402


def frame_activation(x: torch.Tensor) -> list:
    """What a stage does to its output before the send (``_StageRun._send``): the tensor's frame,
    its header, the message's frames (``bench/investigations/wake_after_idle.py`` times it after idleness)."""
    spec, buf = tensor_frame(x)
    header = DataHeader(run_id="r" * 12, kind="hidden", phase="decode", step=7, micro_batch=0, sender="four-1",
                        tensors=(spec,), t_sent=time.time())
    return data_message(header, [buf])


def cpu_us(fn, n: int) -> float:
    """Median-of-5 CPU µs per call of ``fn`` (each of 5 batches of n // 5 calls)."""
    per = []
    for _ in range(5):
        c = time.thread_time()
        for _ in range(max(1, n // 5)):
            fn()
        per.append((time.thread_time() - c) / max(1, n // 5) * 1e6)
    return round(sorted(per)[2], 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(Path.home() / ".cache" / "edgeshard" / "bench-llama-170m"))
    ap.add_argument("--n", type=int, default=2000)
    args = ap.parse_args()
    from agents.protocol import AgentEvent, decode_data
    from agents.schedule import Step, step_operations
    from agents.transport import (DATA_DOMAIN, CurveKeys, KeyGate, curve_client, curve_server,
                                  start_authenticator, tensor_from_frame)

    torch.set_num_threads(1)
    hidden = json.loads((Path(args.model) / "config.json").read_text())["hidden_size"] \
        if (Path(args.model) / "config.json").exists() else 1024
    x = torch.randn(1, 1, hidden)
    n = args.n
    out: dict = {"bench": "hop_trace", "unit": "CPU µs per call (calling thread)", "hidden": hidden,
                 "load_avg_1min": round(os.getloadavg()[0], 2)}

    def encode():
        return frame_activation(x)

    frames = encode()
    raw = [zmq.Frame(bytes(f)) if isinstance(f, bytes) else zmq.Frame(f.tobytes()) for f in frames]
    header, bufs = decode_data(raw, 1 << 30)
    events: collections.deque = collections.deque(maxlen=100_000)
    sender: dict = {"tensor_frame + header + encode": cpu_us(encode, n)}
    receiver: dict = {"decode_data (msgspec, checks)": cpu_us(lambda: decode_data(raw, 1 << 30), n),
                      "tensor_from_frame": cpu_us(lambda: tensor_from_frame(header.tensors[0], bufs[0]), n),
                      "schedule step_operations": cpu_us(lambda: step_operations(2, 4, (7, 10), Step(0, 7)), n)}
    event = cpu_us(lambda: events.append(AgentEvent("compute", "decode", 7, 0, 1.0, 2.0, 0, "")), n)

    # one framed round trip through CurveZMQ on loopback, in this process: the app-thread CPU
    ctx = zmq.Context()
    a, b = CurveKeys.generate(), CurveKeys.generate()
    gate = KeyGate()
    gate.allow(DATA_DOMAIN, [a.public, b.public])
    auth = start_authenticator(ctx, gate)
    pull = ctx.socket(zmq.PULL)
    curve_server(pull, b, DATA_DOMAIN)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    curve_client(push, a, b.public)
    push.connect(f"tcp://127.0.0.1:{port}")
    for _ in range(50):
        push.send_multipart(encode(), copy=False)
        pull.recv_multipart(copy=False)
    send_c = recv_c = 0.0
    wall = []
    for _ in range(n):
        msg = encode()
        c0, w0 = time.thread_time(), time.perf_counter()
        push.send_multipart(msg, copy=False)
        c1 = time.thread_time()
        pull.recv_multipart(copy=False)
        wall.append(time.perf_counter() - w0)
        send_c += c1 - c0
        recv_c += time.thread_time() - c1
    push.close(0)
    pull.close(0)
    auth.stop()
    ctx.destroy(linger=0)
    sender["send_multipart (worker thread)"] = round(send_c / n * 1e6, 2)
    receiver["recv_multipart (worker thread)"] = round(recv_c / n * 1e6, 2)
    out["sender"] = sender
    out["receiver"] = receiver
    out["timeline_event"] = event
    out["events_per_hop"] = 3
    out["hop_cpu_us_worker_threads"] = round(sum(sender.values()) + sum(receiver.values()) + 3 * event, 1)
    out["loopback_one_way_wall_us_median"] = round(sorted(wall)[len(wall) // 2] * 1e6, 1)

    # per-stage fixed costs of a decode step (before the blocks), on a one-block stage
    cfg = Path(args.model) / "config.json"
    if cfg.exists():
        from transformers.masking_utils import create_causal_mask

        from agents.shard import StageExecutor

        ex = StageExecutor(args.model, 1, 2)
        ex.prefill(0, torch.randn(1, 16, hidden), torch.ones(1, 16, dtype=torch.long))
        ex.decode(0, torch.randn(1, 1, hidden))
        st = ex._groups[0]
        h = torch.randn(1, 1, hidden)
        pos = (st.mask.cumsum(-1) - 1)[:, -1:]
        fixed: dict = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.inference_mode():
                fixed["positions"] = cpu_us(lambda: (st.mask.cumsum(-1) - 1).masked_fill(st.mask == 0, 0)[:, -1:], n)
                for kw in ("past_key_values", "cache"):
                    fixed[f"mask: create_causal_mask({kw}=)"] = cpu_us(lambda: create_causal_mask(
                        config=ex._config, inputs_embeds=h, attention_mask=st.mask, position_ids=pos,
                        **{kw: st.cache}), n // 4)
                fixed["mask: padding mask view (decode)"] = cpu_us(lambda: st.mask.bool()[:, None, None, :], n)
                fixed["rotary embedding"] = cpu_us(lambda: ex._rotary(h, position_ids=pos), n)
                fixed["mask growth (cat)"] = cpu_us(lambda: torch.cat([st.mask, st.mask.new_ones((1, 1))], dim=1), n)
        fixed["deprecated keyword, per call (layer or mask)"] = round(
            fixed["mask: create_causal_mask(past_key_values=)"] - fixed["mask: create_causal_mask(cache=)"], 2)
        out["stage_fixed_per_decode_step"] = fixed
    print(json.dumps(out))


if __name__ == "__main__":
    main()
