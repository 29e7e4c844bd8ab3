"""A real spatial run on agents: the gateway agent scatters strips over the data plane, gathers, runs the head.

The run driver of the spatial technique over the agent link (``core.devices.agent_link``), as
EdgeMI's map-reduce: every device of the plan gets a ``SpatialSetup`` (the network by name and
seed, the tiles, each device's columns, every device's data address and key; workers first),
then the coordinator only hands the gateway each image (``ClassifyImage``) and receives the
class scores (``ImageClassified``). The gateway agent cuts each worker's strip with its halo and
pushes it to that worker's data socket; workers push their output columns back; the gateway
concatenates, goes on to the next tile and runs the FC head (``agents.techniques.spatial.session``). Strips
never pass through this process or the control channel, and the agents' emulated links
(``--link-mbit``) shape them. Each strip's times come back with the scores and become the
shared ``TimelineEvent``s (scatter = ``recv_wait``, ``compute``, gather = ``send``, on each
device's lane; agent clocks mapped through the link's offset estimates) so recording, replay
and the timeline take a real run like a simulated one; ``on_image`` gets them image by image
(the live timeline, with the image's class scores). ``on_agents`` names a plan's devices as the
connected agents, ``run_and_record`` runs and records a run like ``edgeshard spatial run`` (the
studio's *Run on agents*; the CLI records through ``record``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence

import msgspec

from agents.protocol import MAX_CONTROL_FRAME, ErrorReply, PeerSpec, StopRun, TimelineEvent, TokenEvent
from agents.techniques.spatial.messages import ClassifyImage, ImageClassified, SpatialNet, SpatialSetup, StripTimes
from core.devices.agent_link import holder_heard_between_polls, refusal
from core.errors import AgentBusy, RunFailed
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
                on_image: Callable[[list[TimelineEvent], TokenEvent, tuple[float, ...]], None] | None = None,
                ) -> SpatialRun:
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
    net = SpatialNet(network=ref.network, image=ref.image, width_div=ref.width_div, classes=ref.classes, seed=seed,
                     weights=ref.weights)
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
            _join(link, d, setup, fut, timeout_s, "joining the spatial run", reporter)
        _join(link, gw, setup, link.request_async(gw, setup), timeout_s, "joining the spatial run as gateway", reporter)
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
                           expect=ImageClassified, peers=workers)
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
                on_image(mine, token, reply.scores)
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


HOLDER_POLL_S = 0.2


def _join(link, device: str, setup: SpatialSetup, fut, timeout_s: float, what: str,
          reporter: Reporter | None) -> None:
    """``device``'s answer to ``setup``; refused because it serves another coordinator's work, the
    setup is sent again every ``HOLDER_POLL_S`` while that coordinator stays silent (its work ends by
    its lease, as ``Coordinator.load`` waits for it), with the wait on ``reporter``; ``AgentBusy`` at
    once when that coordinator is heard again (it is alive: not ours to wait out), or after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    polled = None
    first: AgentBusy | None = None
    while True:
        try:
            return _reply(link, device, fut, timeout_s, what, expect=None)
        except AgentBusy as busy:
            first = first or busy  # the work that refused us: what the operator must deal with, even if
            # it changed while we polled (a layers run that ended leaves its loaded stage)
            st = link.status_of([device], 5.0)[device]
            now = time.monotonic()
            if st.held_by != "another coordinator" or now > deadline \
                    or holder_heard_between_polls(st.holder_silent_s, None if polled is None else now - polled):
                raise first from None
            polled = now
            if reporter is not None:
                reporter.status(f"{device} serves {st.activity or 'the work'} of a coordinator silent for "
                                f"{st.holder_silent_s:.1f} s: waiting for its lease to run out")
            time.sleep(HOLDER_POLL_S)
            fut = link.request_async(device, setup)


def _reply(link, device: str, fut, timeout_s: float, what: str, *, expect, peers=()):
    reply = link.await_reply(device, fut, timeout_s, what, peers=peers)
    if isinstance(reply, ErrorReply):
        raise refusal(reply, f"{what}: refused", device)
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


def on_agents(problem: SpatialProblem, plan: SpatialPlan,
              agents: Sequence[str]) -> tuple[SpatialProblem, SpatialPlan]:
    """The problem and plan with the plan's devices named as ``agents`` (sorted; the gateway, the
    plan's first device, on the first agent), unchanged when the plan already names agents: a plan
    made on the scenario's devices runs on whatever agents are connected. Pure."""
    if set(plan.devices) <= set(agents):
        return problem, plan
    agents = sorted(agents)
    if len(agents) < len(plan.devices):
        raise SpatialInputError(f"the plan uses {len(plan.devices)} devices but {len(agents)} agent(s) are "
                                f"connected: connect more agents or plan for {len(agents)} nodes")
    names = dict(zip(plan.devices, agents))
    devices = tuple(msgspec.structs.replace(d, id=names[d.id]) for d in problem.devices if d.id in names)
    return (msgspec.structs.replace(problem, devices=devices, gateway=names[plan.devices[0]]),
            msgspec.structs.replace(plan, devices=tuple(names[d] for d in plan.devices)))


def record(workspace: str, session: str, problem: SpatialProblem, plan: SpatialPlan, measured: SpatialRun,
           *, status: str = "completed", seed: int = 0) -> tuple[int, int]:
    """Store ``measured`` and the simulator's prediction for as many images as two runs of a new
    session (Sessions replays and compares them), the measured one with its origin (its replay's
    ghosts); returns their run ids."""
    from core.sessions.origin import RecordedOrigin
    from core.sessions.recording import append_predicted
    from core.sessions.store import SessionStore
    from core.techniques.spatial.simulator import simulate

    spec = problem.model.spec()
    predicted = simulate(problem, plan, images=max(1, len(measured.tokens)))
    with SessionStore(workspace) as store:
        session_id = store.create_session(session)
        ids = []
        for kind, result, end in (("measured", measured, status), ("predicted", predicted, "completed")):
            run_id = store.create_run(session_id, model=spec.name, mode="sequential", kind=kind,
                                      settings={"technique": "spatial", "strategy": plan.strategy, "seed": seed,
                                                "plan": msgspec.to_builtins(plan)})
            append_predicted(store, run_id, result.events, result.tokens)
            store.finish_run(run_id, end, result.figures)
            ids.append(run_id)
        # what predicts the measured run's replay: the problem for the images it ran
        store.set_origin(ids[0], RecordedOrigin.of(
            "spatial", msgspec.structs.replace(problem, images=max(1, len(measured.tokens))), plan))
    return ids[0], ids[1]


class ImageResult(msgspec.Struct, frozen=True):
    """One image of a live run, as the studio lists it."""

    image: int
    latency_s: float
    """First strip scattered → the head's end, on the run's timeline."""
    top_class: int
    agrees: bool
    """The top class equals the single-device forward's."""
    max_abs_error: float
    """max |scores − single-device scores|."""


class RecordedRun(msgspec.Struct, frozen=True):
    run: SpatialRun
    status: str
    """completed, stopped or failed."""
    max_abs_error: float
    run_ids: tuple[int, ...]
    """(measured, predicted) when recorded."""


def run_and_record(link, problem: SpatialProblem, plan: SpatialPlan, images, *, seed: int = 0,
                   workspace: str = "", session: str = "spatial", reporter: Reporter | None = None,
                   on_image: Callable[[list[TimelineEvent], TokenEvent, ImageResult], None] | None = None,
                   ) -> RecordedRun:
    """``run_spatial`` with each image checked against the single-device forward as it arrives, and
    the run (completed, stopped by ``reporter``, or failed part way: what was measured) recorded in
    ``workspace`` when given. A failure is recorded, then raised."""
    import torch

    ref = problem.model.build(seed).forward(images)
    events: list[TimelineEvent] = []
    tokens: list[TokenEvent] = []
    scores: list[tuple[float, ...]] = []

    def seen(mine, token, image_scores):
        i = token.step
        err = float((torch.tensor(image_scores) - ref[i]).abs().max())
        latency = max(e.end_s for e in mine) - min(e.start_s for e in mine) if mine else 0.0
        result = ImageResult(image=i, latency_s=latency, top_class=token.token_ids[0],
                             agrees=token.token_ids[0] == int(ref[i].argmax()), max_abs_error=err)
        events.extend(mine)
        tokens.append(token)
        scores.append(tuple(image_scores))
        if on_image is not None:
            on_image(mine, token, result)

    def partial() -> SpatialRun:
        evs = sorted(events, key=lambda e: (e.start_s, e.device))
        return SpatialRun(scores=tuple(scores), events=tuple(evs), tokens=tuple(tokens),
                          figures=compute_figures(evs, tokens))

    def max_err(run: SpatialRun) -> float:
        return float((torch.tensor(run.scores) - ref[:len(run.scores)]).abs().max()) if run.scores else 0.0

    try:
        run = run_spatial(link, problem, plan, images, seed=seed, reporter=reporter, on_image=seen)
    except RunFailed as err:
        run = partial()
        ids = record(workspace, session, problem, plan, run, status="failed", seed=seed) if workspace else ()
        if not ids:
            raise
        again = AgentBusy if isinstance(err, AgentBusy) else RunFailed
        raise again(err.reason + f" (recorded as run {ids[0]}, failed)", err.device) from err
    stopped = reporter is not None and reporter.cancel_requested() and len(run.tokens) < images.shape[0]
    status = "stopped" if stopped else "completed"
    ids = record(workspace, session, problem, plan, run, status=status, seed=seed) if workspace else ()
    return RecordedRun(run=run, status=status, max_abs_error=max_err(run), run_ids=tuple(ids))
