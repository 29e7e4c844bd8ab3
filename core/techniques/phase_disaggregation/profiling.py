"""``PhaseCosts`` measured on the pools' agents, so the simulator times what a real run does.

Probes are the run's own phase requests (agents.techniques.phase_disaggregation.phases) sent to the first device of each
pool: encode calls over 1..n tiles, prefill calls over prompts of several lengths (text only
and with image tokens), decode calls of several batch sizes (``DecodeTokens.copies``). An
agent reports when its compute ran (its own clock, so a duration needs no clock sync); the
coordinator times each round trip. What one message costs on the way (the control channel's
encryption, msgpack and scheduling) is what the round trip adds to the compute, fitted as
``a + bytes / bandwidth`` per hop by least squares.

The link: on the data plane (the run's default), pushes encode → prefill and prefill → decode
are timed from the sender's compute end to the receiver's arrival (clocks mapped through the
sync offsets) over several sizes and fitted as ``latency + bytes / bandwidth``. Relayed
(``transfers="relay"``), a transfer is two control hops (agent → coordinator → agent), so
``link_latency_s = 2a`` and ``link_bandwidth_Bps`` is half the hop's. Either way, the hop that
brings an encode agent its tiles from the coordinator has no transfer of its own in the model:
its per-tile pixel bytes are folded into the encode cost, and the rest into the dispatch delay.

The dispatch delay (``dispatch_delay_s``): probes released as the run releases a request (the
coordinator sleeps until the release time, then builds and sends the encode request), timed from
that release to the encode agent's compute start (clocks mapped through the sync offsets). It is
what a loaded coordinator machine adds before a request's first phase; the simulator otherwise
starts encode at the arrival itself.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from agents.techniques.phase_disaggregation.phases import to_bytes
from agents.techniques.phase_disaggregation.messages import (
    DecodeTokens,
    EncodeTiles,
    PrefillPrompt,
    PromptPrefilled,
    TilesEncoded,
    TokensDecoded,
)
from core.errors import RunFailed
from core.reporting import Cancelled, NullReporter, Reporter
from core.techniques.phase_disaggregation.types import EpdInputError, PhaseCosts, PoolConfig


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``y = slope·x + intercept``; a negative intercept (noise) is clamped to 0 with
    the slope refitted through the origin, so no probe size gets a negative time."""
    pts = [(float(x), float(y)) for x, y in points]
    if len({x for x, _ in pts}) < 2:
        raise EpdInputError("fitting a phase cost needs probes of two or more sizes")
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    intercept = my - slope * mx
    if intercept < 0 or slope <= 0:
        slope, intercept = sum(x * y for x, y in pts) / sum(x * x for x, _ in pts), 0.0
    return max(slope, 1e-12), intercept


def profile_phases(link, model_dir: str | Path, pools: PoolConfig, *, tiles: Sequence[int] = (1, 2, 4, 6),
                   prompt_tokens: Sequence[int] = (16, 64, 128), decode_batches: Sequence[int] = (1, 2, 4),
                   decode_steps: int = 8, repeats: int = 5, timeout_s: float = 120.0, transfers: str = "data-plane",
                   time_links: bool = True, warm_up: bool = True, reporter: Reporter | None = None) -> PhaseCosts:
    """Measure the phases on the first device of each pool (loaded with ``runtime.load_pools``).
    Each probe is sent ``repeats`` times and its median kept (shared CPUs are noisy).
    ``warm_up``: each phase is called once, untimed, before its probes. The first call of a phase
    after loading is 2–8× slower (one-off allocation and kernel set-up: on the demo, edge-a's first
    2-tile encode 31 ms then 4–5 ms; edge-a's first 48-token prefill 68 ms); with 3 repeats the
    medians took it in, and the decode steps' increasing-cost clamp spread a cold batch of 1 to every
    batch size. A run pays it once, on its first request; the medians it is scored by do not.
    (False: as before, for ``bench/epd_device_costs.py``'s side-by-side.)
    ``time_links=False``: phases only, the link figured from the control hops and no dispatch
    delay (``on_agents.measure_costs`` takes both from its first rotation)."""
    import torch

    from core.models.multimodal import check_multimodal_dir, load_image, synthetic_images

    reporter = reporter or NullReporter()
    info = check_multimodal_dir(model_dir)
    enc, pre, dec = pools.encode[0], pools.prefill[0], pools.decode[0]
    hops: list[tuple[float, float]] = []  # (bytes in + out, round trip − compute)

    def probe(device: str, msg, expected: type, in_bytes: int, out_bytes=None) -> tuple[float, object]:
        computes, overheads, reply = [], [], None
        for _ in range(repeats):
            if reporter.cancel_requested():
                raise Cancelled()
            t0 = time.perf_counter()
            reply = link.request(device, msg, timeout_s)
            rtt = time.perf_counter() - t0
            if not isinstance(reply, expected):
                raise RunFailed(f"profiling: unexpected answer {type(reply).__name__}", device)
            computes.append(reply.t_end - reply.t_start)
            overheads.append(rtt - computes[-1])
        if out_bytes is not None:  # a decode probe's round trip carries batched copies: not a plain hop
            hops.append((in_bytes + out_bytes(reply), statistics.median(overheads)))
        return statistics.median(computes), reply

    image = synthetic_images()[0]
    encode_pts, pixel_bytes = [], 0
    reporter.status(f"timing encode on {enc}")
    mm_probe = load_image(image, info.tile, max(tiles))

    def encode_mm():
        return link.request(enc, EncodeTiles(request=0, tiles=tuple(range(mm_probe.shape[0])),
                                              shape=tuple(mm_probe.shape), data=to_bytes(mm_probe)), timeout_s)

    mm = encode_mm() if warm_up else None  # the untimed first call: its tokens are the prefill probe's
    for n in tiles:
        x = load_image(image, info.tile, n)
        msg = EncodeTiles(request=0, tiles=tuple(range(n)), shape=tuple(x.shape), data=to_bytes(x))
        pixel_bytes = len(msg.data) // n
        s, _ = probe(enc, msg, TilesEncoded, len(msg.data), lambda r: len(r.data))
        encode_pts.append((n, s))
    mm = mm or encode_mm()
    if not isinstance(mm, TilesEncoded):
        raise RunFailed(f"profiling: unexpected answer {type(mm).__name__}", enc)
    reporter.status(f"timing prefill on {pre}")
    prefill_pts, prefilled = [], None
    mm_tokens = mm.shape[0] * mm.shape[1]
    mm_ids = (1,) + (info.image_token_id,) * mm_tokens + (3, 4, 5)
    mm_prompt = PrefillPrompt(request=0, input_ids=mm_ids, mm_shape=(mm_tokens, mm.shape[2]), mm=mm.data)
    warm = link.request(pre, mm_prompt, timeout_s) if warm_up else None  # untimed first calls
    if warm_up and isinstance(warm, PromptPrefilled):
        link.request(dec, DecodeTokens(request=0, first_token=warm.token, kv_shape=warm.kv_shape, kv=warm.kv,
                                       max_new_tokens=3, rng=warm.rng), timeout_s)
    for length in prompt_tokens:
        ids = (1,) + tuple(3 + (i * 7) % 200 for i in range(length - 1))
        s, prefilled = probe(pre, PrefillPrompt(request=0, input_ids=ids), PromptPrefilled, 8 * length,
                             lambda r: len(r.kv))
        prefill_pts.append((length, s))
    s, _ = probe(pre, mm_prompt, PromptPrefilled, len(mm.data), lambda r: len(r.kv))
    prefill_pts.append((len(mm_ids), s))
    reporter.status(f"timing decode on {dec}")
    decode_pts = []
    for batch in decode_batches:
        msg = DecodeTokens(request=0, first_token=prefilled.token, kv_shape=prefilled.kv_shape, kv=prefilled.kv,
                           max_new_tokens=decode_steps + 1, rng=prefilled.rng, copies=batch)
        steps = []
        for _ in range(repeats):
            r = link.request(dec, msg, timeout_s)
            if not isinstance(r, TokensDecoded):
                raise RunFailed(f"profiling: unexpected answer {type(r).__name__}", dec)
            steps += [b - a for a, b in zip(r.step_ends, r.step_ends[1:])]  # the first step also rebuilds the cache
        decode_pts.append((batch, statistics.median(steps)))
    dispatch = [0.0]
    if time_links:
        reporter.status(f"timing the dispatch to {enc}")
        dispatch = _dispatch_delays(link, enc, load_image(image, info.tile, 1), repeats, timeout_s)
    per_byte, two_hops = fit_line(hops)
    per_tile, encode_overhead = fit_line(encode_pts)
    per_token, prefill_overhead = fit_line(prefill_pts)
    for i in range(1, len(decode_pts)):  # the model needs increasing steps; noise may say otherwise
        decode_pts[i] = (decode_pts[i][0], max(decode_pts[i][1], decode_pts[i - 1][1]))
    hop_s = two_hops / 2
    if transfers == "relay" or not time_links:
        bandwidth, latency = 1.0 / (2 * per_byte), 2 * hop_s
    else:
        reporter.status(f"timing the data plane {enc} -> {pre} -> {dec}")
        per_byte_direct, latency = fit_line(_direct_transfers(link, info, enc, pre, dec, tiles, repeats, timeout_s))
        bandwidth = 1.0 / per_byte_direct
    return PhaseCosts(
        source=f"profiled on {enc}, {pre}, {dec} ({Path(model_dir).name}; transfers: {transfers})",
        encode_s_per_tile=per_tile + pixel_bytes * per_byte, encode_overhead_s=encode_overhead,
        encode_input_s_per_tile=pixel_bytes * per_byte,
        mm_tokens_per_tile=info.tokens_per_tile, prefill_s_per_token=per_token, prefill_overhead_s=prefill_overhead,
        decode_step_s=tuple(decode_pts), mm_token_bytes=info.hidden * 4,
        kv_token_bytes=info.layers * 2 * info.kv_heads * info.head_dim * 4,
        link_bandwidth_Bps=bandwidth, link_latency_s=latency,
        dispatch_delay_s=max(0.0, statistics.median(dispatch) - pixel_bytes * per_byte) if time_links else 0.0)


def _on_coordinator(link, device: str, t: float) -> float:
    """An agent-clock time on the coordinator's clock (the sync offset; none measured: as is)."""
    clock = link.clock_of(device)
    return t - (clock.offset_s if clock is not None else 0.0)


def _dispatch_delays(link, device: str, tile, repeats: int, timeout_s: float) -> list[float]:
    """Seconds from a one-tile request's release to its encode starting on ``device``, released
    as ``runtime`` releases one: sleep until the release time, then build and send the request."""
    out = []
    for k in range(max(3, repeats)):
        release = time.time() + 0.02
        time.sleep(max(0.0, release - time.time()))
        reply = link.request(device, EncodeTiles(request=(1 << 41) + k, tiles=(0,), shape=tuple(tile.shape),
                                                 data=to_bytes(tile)), timeout_s)
        if not isinstance(reply, TilesEncoded):
            raise RunFailed(f"profiling the dispatch: unexpected answer {type(reply).__name__}", device)
        out.append(_on_coordinator(link, device, reply.t_start) - release)
    return out


def _direct_transfers(link, info, enc: str, pre: str, dec: str, tiles: Sequence[int], repeats: int,
                      timeout_s: float) -> list[tuple[float, float]]:
    """(bytes, seconds) of agent-to-agent pushes: multimodal tokens encode → prefill over each tile
    count, and the resulting KV caches prefill → decode; a push lasts from the sender's compute end
    to the receiver's arrival, both mapped to the coordinator's clock (offsets from clock sync)."""
    from core.models.multimodal import load_image, synthetic_images

    samples, request = [], 1 << 40
    for n in tiles:
        x = load_image(synthetic_images()[0], info.tile, n)
        for _ in range(repeats):
            request += 1
            encoded = link.request(enc, EncodeTiles(request=request, tiles=tuple(range(n)), shape=tuple(x.shape),
                                                    data=to_bytes(x), send_to=pre, piece=0), timeout_s)
            m = n * info.tokens_per_tile
            ids = (1,) + (info.image_token_id,) * m + (3, 4, 5)
            prefilled = link.request(pre, PrefillPrompt(request=request, input_ids=ids, mm_shape=(m, info.hidden),
                                                        mm_pieces=(0,), send_to=dec), timeout_s)
            decoded = link.request(dec, DecodeTokens(request=request, first_token=prefilled.token,
                                                     kv_shape=prefilled.kv_shape, kv=b"", max_new_tokens=1,
                                                     kv_from=pre), timeout_s)
            if not (isinstance(encoded, TilesEncoded) and isinstance(prefilled, PromptPrefilled)
                    and isinstance(decoded, TokensDecoded)):
                raise RunFailed("profiling the data plane: unexpected answers", pre)
            samples.append((m * info.hidden * 4, _on_coordinator(link, pre, prefilled.mm_received)
                            - _on_coordinator(link, enc, encoded.t_end)))
            samples.append((math.prod(prefilled.kv_shape) * 4, _on_coordinator(link, dec, decoded.kv_received)
                            - _on_coordinator(link, pre, prefilled.t_end)))
    return samples
