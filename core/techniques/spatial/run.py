"""A real spatial run on agents: scatter strips with halos, compute, gather, FC head.

The run driver of the spatial technique over the agent link (``core.devices.agent_link``):
for each image and each tile of the plan, every device with a strip gets a ``ComputeStrip``
holding exactly the input columns its strip needs (``group_input_ranges``, the agent's own
geometry) and answers with its output columns; the strips are concatenated into the next
tile's input map, and the gateway's agent runs the FC head on the last map. The devices of a
tile compute at the same time (requests are sent before any reply is awaited).

What differs from the paper's map-reduce: the coordinator's process relays the scatter and the
gather over the encrypted control channel (so a strip must fit one control frame, 1 MiB), and
the gateway device computes its own strip and the head; the emulated data-plane links
(``--link-mbit``) do not shape this traffic. Times are recorded as the shared
``TimelineEvent``s (scatter = ``recv_wait``, ``compute``, gather = ``send``, on each device's
lane, agent clocks mapped through the link's offset estimates) so recording, replay and the
timeline take a real run like a simulated one.
"""

from __future__ import annotations

import time

import msgspec

from agents.protocol import MAX_CONTROL_FRAME, ComputeStrip, ErrorReply, SpatialNet, StripComputed, TimelineEvent, TokenEvent
from agents.spatial import group_input_ranges, strip_bounds
from core.errors import RunFailed
from core.reporting import Reporter
from core.runs.metrics import RunFigures, compute_figures
from core.techniques.spatial.problem import SpatialInputError, SpatialPlan, SpatialProblem, check

FRAME_SLACK = 512
"""Bytes of a ComputeStrip besides its tensor (header fields), kept free under the frame limit."""


class SpatialRun(msgspec.Struct, frozen=True, kw_only=True):
    scores: tuple[tuple[float, ...], ...]
    """Class scores per image."""
    events: tuple[TimelineEvent, ...]
    tokens: tuple[TokenEvent, ...]
    figures: RunFigures


def _to_bytes(t) -> bytes:
    return t.contiguous().float().numpy().astype("<f4", copy=False).tobytes()


def _from_reply(reply: StripComputed):
    import numpy as np
    import torch

    return torch.from_numpy(np.frombuffer(reply.data, dtype="<f4").reshape(reply.shape).copy())


def run_spatial(link, problem: SpatialProblem, plan: SpatialPlan, images, *, seed: int = 0,
                timeout_s: float = 120.0, reporter: Reporter | None = None) -> SpatialRun:
    """Run ``images`` (N×3×H×W float tensor) one after another on the plan's agents (named as the
    plan's devices). ``RunFailed`` names the device that failed; ``SpatialInputError`` a strip too
    large for one control frame before anything is sent."""
    check(problem, plan)
    spec = problem.model.spec()
    ref = problem.model
    net = SpatialNet(network=ref.network, image=ref.image, width_div=ref.width_div, classes=ref.classes, seed=seed)
    if tuple(images.shape[1:]) != (3, spec.image, spec.image):
        raise SpatialInputError(f"images must be N×3×{spec.image}×{spec.image} for {spec.name}, "
                                f"got {list(images.shape)}")
    _check_frames(spec, plan)
    t_run = time.time()
    events: list[TimelineEvent] = []
    tokens: list[TokenEvent] = []
    scores = []
    for i in range(images.shape[0]):
        if reporter is not None:
            if reporter.cancel_requested():
                break
            reporter.progress(i, images.shape[0])
        h = images[i:i + 1]
        for g, ((start, end), widths) in enumerate(zip(plan.groups, plan.widths)):
            sent = []
            for device, (lo, hi) in zip(plan.devices, strip_bounds(widths)):
                if hi <= lo:
                    continue
                a, b = group_input_ranges(spec.layers[start:end], lo, hi)[0]
                piece = h[..., a:b]
                msg = ComputeStrip(net=net, start=start, end=end, x_lo=a, lo=lo, hi=hi, shape=tuple(piece.shape),
                                   data=_to_bytes(piece))
                sent.append((device, time.time(), len(msg.data), link.request_async(device, msg)))
            parts = []
            for device, t0, nbytes, fut in sent:
                reply = _reply(link, device, fut, timeout_s, f"computing tile {g} of image {i}")
                events += _events(link, device, g, i, t0, time.time(), reply, nbytes, problem.gateway, t_run)
                parts.append(_from_reply(reply))
            import torch

            h = torch.cat(parts, dim=-1)
        gw = problem.gateway
        t0 = time.time()
        msg = ComputeStrip(net=net, start=len(spec.layers), end=len(spec.layers), x_lo=0, lo=0, hi=h.shape[-1],
                           shape=tuple(h.shape), data=_to_bytes(h), head=True)
        reply = _reply(link, gw, link.request_async(gw, msg), timeout_s, f"running the head of image {i}")
        events += _events(link, gw, len(plan.groups), i, t0, time.time(), reply, len(msg.data), gw, t_run)
        out = _from_reply(reply)[0]
        scores.append(tuple(float(v) for v in out))
        tokens.append(TokenEvent(micro_batch=0, step=i, sequence_ids=(i,), token_ids=(int(out.argmax()),),
                                 t_s=time.time() - t_run))
    events.sort(key=lambda e: (e.start_s, e.device))
    return SpatialRun(scores=tuple(scores), events=tuple(events), tokens=tuple(tokens),
                      figures=compute_figures(events, tokens))


def _check_frames(spec, plan: SpatialPlan) -> None:
    """Refuse, before sending anything, a strip or map that cannot travel in one control frame."""
    limit = MAX_CONTROL_FRAME - FRAME_SLACK
    for (start, end), widths in zip(plan.groups, plan.widths):
        for device, (lo, hi) in zip(plan.devices, strip_bounds(widths)):
            if hi <= lo:
                continue
            a, b = group_input_ranges(spec.layers[start:end], lo, hi)[0]
            nbytes = max(spec.layers[start].in_bytes(b - a), spec.layers[end - 1].out_bytes(hi - lo))
            if nbytes > limit:
                raise SpatialInputError(
                    f"{device}'s strip of layers [{start}, {end}) is {nbytes} bytes, over one control frame "
                    f"({MAX_CONTROL_FRAME} bytes): use a smaller image or width_div, or more devices")
    if spec.layers[-1].out_bytes() > limit:
        raise SpatialInputError(f"the last map ({spec.layers[-1].out_bytes()} bytes) does not fit one control "
                                f"frame for the head: use a smaller image or width_div")


def _reply(link, device: str, fut, timeout_s: float, what: str) -> StripComputed:
    reply = link.await_reply(device, fut, timeout_s, what)
    if isinstance(reply, ErrorReply):
        raise RunFailed(f"{what}: refused ({reply.code}): {reply.message}", device)
    if not isinstance(reply, StripComputed):
        raise RunFailed(f"{what}: unexpected answer {type(reply).__name__}", device)
    return reply


def _events(link, device: str, stage: int, image: int, t0: float, t3: float, reply: StripComputed, in_bytes: int,
            gateway: str, t_run: float) -> list[TimelineEvent]:
    """Scatter (request sent → compute starts), compute, gather (compute ends → reply here),
    on the coordinator's clock relative to the run's start."""
    clock = link.clock_of(device)
    offset = clock.offset_s if clock is not None else 0.0
    unc = clock.uncertainty_s if clock is not None else 0.0
    ts = min(max(reply.t_start - offset, t0), t3)
    te = min(max(reply.t_end - offset, ts), t3)
    common = dict(device=device, stage=stage, phase="prefill", step=image, micro_batch=0, clock_uncertainty_s=unc)
    return [
        TimelineEvent(kind="recv_wait", start_s=t0 - t_run, end_s=ts - t_run, nbytes=in_bytes, peer=gateway, **common),
        TimelineEvent(kind="compute", start_s=ts - t_run, end_s=te - t_run, **common),
        TimelineEvent(kind="send", start_s=te - t_run, end_s=t3 - t_run, nbytes=len(reply.data), peer=gateway,
                      **common),
    ]
