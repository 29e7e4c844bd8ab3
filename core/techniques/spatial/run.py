"""A real spatial run on agents: the gateway agent scatters strips over the data plane, gathers, runs the head.

The run driver of the spatial technique over the agent link (``core.devices.agent_link``), as
EdgeMI's map-reduce: every device of the plan gets a ``SpatialSetup`` (the network by name and
seed, the tiles, each device's columns, every device's data address and key; workers first),
then the coordinator only hands the gateway each image (``ClassifyImage``) and receives the
class scores (``ImageClassified``). The gateway agent cuts each worker's strip with its halo and
pushes it to that worker's data socket; workers push their output columns back; the gateway
concatenates, goes on to the next tile and runs the FC head (``agents.spatial_run``). Strips
never pass through this process or the control channel, and the agents' emulated links
(``--link-mbit``) shape them. Each strip's times come back with the scores and become the
shared ``TimelineEvent``s (scatter = ``recv_wait``, ``compute``, gather = ``send``, on each
device's lane; agent clocks mapped through the link's offset estimates) so recording, replay
and the timeline take a real run like a simulated one; ``on_image`` gets them image by image
(the live timeline).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import msgspec

from agents.protocol import (
    MAX_CONTROL_FRAME, ClassifyImage, ErrorReply, ImageClassified, PeerSpec, SpatialNet, SpatialSetup, StopRun,
    StripTimes, TimelineEvent, TokenEvent,
)
from core.errors import RunFailed
from core.reporting import Reporter
from core.runs.metrics import RunFigures, compute_figures
from core.techniques.spatial.problem import SpatialInputError, SpatialPlan, SpatialProblem, check

FRAME_SLACK = 512
"""Bytes of a ClassifyImage besides the image (header fields), kept free under the frame limit."""
IN_FLIGHT = 2
"""Images handed to the gateway ahead of the one awaited, so it never idles on a round trip."""


class SpatialRun(msgspec.Struct, frozen=True, kw_only=True):
    scores: tuple[tuple[float, ...], ...]
    """Class scores per image."""
    events: tuple[TimelineEvent, ...]
    tokens: tuple[TokenEvent, ...]
    figures: RunFigures


def run_spatial(link, problem: SpatialProblem, plan: SpatialPlan, images, *, seed: int = 0,
                timeout_s: float = 120.0, reporter: Reporter | None = None,
                on_image: Callable[[list[TimelineEvent], TokenEvent], None] | None = None) -> SpatialRun:
    """Run ``images`` (N×3×H×W float tensor) on the plan's agents (named as the plan's devices).
    ``RunFailed`` names the device that failed; ``SpatialInputError`` an image too large for one
    control frame before anything is sent. The agents are stopped however the run ends."""
    check(problem, plan)
    spec = problem.model.spec()
    if tuple(images.shape[1:]) != (3, spec.image, spec.image):
        raise SpatialInputError(f"images must be N×3×{spec.image}×{spec.image} for {spec.name}, "
                                f"got {list(images.shape)}")
    if 3 * spec.image * spec.image * 4 > MAX_CONTROL_FRAME - FRAME_SLACK:
        raise SpatialInputError(f"a {spec.image}×{spec.image} image does not fit one control frame "
                                f"({MAX_CONTROL_FRAME} bytes): use a smaller image")
    ref = problem.model
    net = SpatialNet(network=ref.network, image=ref.image, width_div=ref.width_div, classes=ref.classes, seed=seed)
    gw = problem.gateway
    statuses = link.status_of(list(plan.devices))
    peers = tuple(PeerSpec(device=d, stage=i, data_address=statuses[d].data_address,
                           public_key=statuses[d].public_key) for i, d in enumerate(plan.devices))
    run_id = uuid.uuid4().hex[:12]
    setup = SpatialSetup(run_id=run_id, net=net, devices=peers, gateway=gw, groups=plan.groups, widths=plan.widths,
                         lease_s=max(10.0, 4 * link.heartbeat_interval_s), strip_timeout_s=timeout_s)
    t_run = time.time()
    events: list[TimelineEvent] = []
    tokens: list[TokenEvent] = []
    scores = []
    try:
        workers = [d for d in plan.devices if d != gw]
        futs = [(d, link.request_async(d, setup)) for d in workers]  # workers first: they then allow the gateway
        for d, fut in futs:
            _reply(link, d, fut, timeout_s, "joining the spatial run", expect=None)
        _reply(link, gw, link.request_async(gw, setup), timeout_s, "joining the spatial run as gateway", expect=None)
        t_run = time.time()
        n = images.shape[0]
        sent: dict[int, object] = {}
        for i in range(n):
            if reporter is not None:
                if reporter.cancel_requested():
                    break
                reporter.progress(i, n)
            for j in range(i, min(n, i + IN_FLIGHT)):
                if j not in sent:
                    x = images[j:j + 1].contiguous().float()
                    sent[j] = (time.time(), link.request_async(
                        gw, ClassifyImage(run_id=run_id, image=j, shape=tuple(x.shape),
                                          data=x.numpy().astype("<f4").tobytes())))
            t_sent, fut = sent.pop(i)
            reply = _reply(link, gw, fut, timeout_s * (len(plan.groups) + 1), f"classifying image {i}",
                           expect=ImageClassified)
            window = (t_sent - t_run, time.time() - t_run)
            if len(reply.scores) != ref.classes or reply.image != i:
                raise RunFailed(f"image {i}: the gateway answered image {reply.image} with {len(reply.scores)} "
                                f"scores, expected {ref.classes}", gw)
            mine = [e for st in reply.strips for e in strip_events(link, gw, i, st, t_run, window)]
            token = TokenEvent(micro_batch=0, step=i, sequence_ids=(i,),
                               token_ids=(max(range(len(reply.scores)), key=reply.scores.__getitem__),),
                               t_s=time.time() - t_run)
            events += mine
            tokens.append(token)
            scores.append(reply.scores)
            if on_image is not None:
                on_image(mine, token)
        for _, fut in sent.values():
            link.forget(fut)
    finally:
        _stop(link, plan.devices, run_id)
    events.sort(key=lambda e: (e.start_s, e.device))
    return SpatialRun(scores=tuple(scores), events=tuple(events), tokens=tuple(tokens),
                      figures=compute_figures(events, tokens))


def _stop(link, devices, run_id: str) -> None:
    """End the run on every device (a lost one ends it through its lease)."""
    futs = [(d, link.request_async(d, StopRun(run_id=run_id))) for d in devices]
    for d, fut in futs:
        try:
            link.await_reply(d, fut, 10.0, "stopping the spatial run")
        except RunFailed:
            pass


def _reply(link, device: str, fut, timeout_s: float, what: str, *, expect):
    reply = link.await_reply(device, fut, timeout_s, what)
    if isinstance(reply, ErrorReply):
        raise RunFailed(f"{what}: refused ({reply.code}): {reply.message}", device)
    if expect is not None and not isinstance(reply, expect):
        raise RunFailed(f"{what}: unexpected answer {type(reply).__name__}", device)
    return reply


def strip_events(link, gateway: str, image: int, st: StripTimes, t_run: float,
                 window: tuple[float, float]) -> list[TimelineEvent]:
    """One strip's scatter (``recv_wait``: handed to the gateway's link → arrived), ``compute``, and
    gather (``send``: computed → arrived at the gateway), on the coordinator's clock relative to
    the run's start, kept inside ``window`` (the image's request sent → its reply here: an
    offset estimate's error must not move a strip outside what this clock saw); a strip the
    gateway computes itself (and the head) has only its compute."""

    def offset(device):
        clock = link.clock_of(device)
        return (clock.offset_s, clock.uncertainty_s) if clock is not None else (0.0, 0.0)

    og, ug = offset(gateway)
    od, ud = offset(st.device)
    lo, hi = window[0] + t_run, window[1] + t_run
    t0 = min(max(st.scattered - og, lo), hi)
    t3 = min(max(st.gathered - og, t0), hi)
    t1 = min(max(st.received - od, t0), t3)
    ts = min(max(st.start - od, t1), t3)
    te = min(max(st.end - od, ts), t3)
    common = dict(device=st.device, stage=st.group, phase="prefill", step=image, micro_batch=0,
                  clock_uncertainty_s=max(ug, ud))
    out = [TimelineEvent(kind="compute", start_s=ts - t_run, end_s=te - t_run, **common)]
    if st.device != gateway:
        out.insert(0, TimelineEvent(kind="recv_wait", start_s=t0 - t_run, end_s=ts - t_run, nbytes=st.in_bytes,
                                    peer=gateway, **common))
        out.append(TimelineEvent(kind="send", start_s=te - t_run, end_s=t3 - t_run, nbytes=st.out_bytes,
                                 peer=gateway, **common))
    return out
