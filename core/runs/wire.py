"""What agents' sockets sent during a piece of work, from their own counters.

Each agent counts the bytes it hands to ZeroMQ, per link and per kind (``agents.transport.WireCounts``,
reported cumulatively in ``AgentStatus.wire_sent``); a run's traffic is the difference of a snapshot
taken before it and one after. Figures built on this are measured on the wire (headers, framing and
every frame a technique sends included), not re-derived from the tensors with the prediction's formula.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from agents.protocol import DTYPE_SIZES, AgentStatus, DataHeader, TensorSpec, encode_data_header, options_slot


class WireTraffic(msgspec.Struct, frozen=True):
    """Messages and bytes sent, keyed by (sender device, link, kind)."""

    sent: dict[tuple[str, str, str], tuple[int, int]] = {}

    def nbytes(self, *, kinds: Iterable[str] | None = None, senders: Iterable[str] | None = None,
               links: Iterable[str] | None = None) -> int:
        """Bytes sent, optionally only of these kinds / by these senders / on links to these peers."""
        kinds, senders, links = (None if x is None else set(x) for x in (kinds, senders, links))
        return sum(n for (sender, link, kind), (_, n) in self.sent.items()
                   if (kinds is None or kind in kinds) and (senders is None or sender in senders)
                   and (links is None or link in links))

    def per_link_and_kind(self) -> dict[str, int]:
        """``sender->link kind`` → bytes, for a JSON report."""
        return {f"{s}->{link} {kind}": n for (s, link, kind), (_, n) in sorted(self.sent.items())}


def snapshot(statuses: Mapping[str, AgentStatus]) -> WireTraffic:
    """The agents' cumulative counters as one ``WireTraffic``."""
    return WireTraffic({(device, c.link, c.kind): (c.messages, c.nbytes)
                        for device, status in statuses.items() for c in status.wire_sent})


def sent_between(before: WireTraffic, after: WireTraffic) -> WireTraffic:
    """What was sent after ``before`` and up to ``after`` (an agent restarted in between counts from 0)."""
    out = {}
    for key, (m, n) in after.sent.items():
        m0, n0 = before.sent.get(key, (0, 0))
        if m < m0:  # counter restarted with its agent
            m0 = n0 = 0
        if m - m0:
            out[key] = (m - m0, n - n0)
    return WireTraffic(out)


COORDINATOR_LINK = "coordinator"
"""The link an agent's control replies and streamed events go on (``WireCount.link``)."""


class WireMeter:
    """What the agents ``devices`` sent while the ``with`` block ran (``traffic``, None when a status
    could not be read: an agent lost mid-run; ``after``: their counters at its end). ``link`` is anything
    with ``status_of(devices)`` (a ``Coordinator`` or an ``AgentLink``): one status round trip each side,
    milliseconds."""

    def __init__(self, link, devices) -> None:
        self.link, self.devices = link, list(dict.fromkeys(devices))
        self.traffic: WireTraffic | None = None
        self.after: WireTraffic | None = None
        self._before: WireTraffic | None = None

    def __enter__(self) -> "WireMeter":
        self._before = counters_of(self.link, self.devices)
        return self

    def __exit__(self, *exc) -> None:
        self.after = counters_of(self.link, self.devices) if exc[0] is None else None
        if self._before is not None and self.after is not None:
            self.traffic = sent_between(self._before, self.after)


def counters_of(link, devices) -> WireTraffic | None:
    """The agents' ``devices`` counters now (None when none answered). One that does not answer (lost
    in a run that recovered) is left out: its bytes since an earlier snapshot are unknown, the
    survivors' still count."""
    from core.errors import EdgeShardError

    statuses = {}
    for device in devices:
        try:
            statuses.update(link.status_of([device], timeout_s=3.0))
        except EdgeShardError:
            continue
    return snapshot(statuses) if statuses else None


def wire_figures(traffic: WireTraffic | None, devices, predicted: Mapping[tuple[str, str], int] | None,
                 kinds: Iterable[str] | None = None, predicted_total: int | None = None) -> dict:
    """A run's wire figures for its JSON output and its recorded figures (``figures["wire"]``).

    ``measured_bytes``: what the agents' sockets sent to each other (of ``kinds`` when given: the
    traffic the prediction models), headers included; ``control_bytes``: their replies and streamed
    events to the coordinator; ``per_link``: ``src->dst`` → measured and predicted bytes;
    ``per_link_and_kind``: every counter; ``predicted_bytes``: the technique's cost model (tensors,
    no headers unless it models them) and ``measured_over_predicted``; ``predicted_total``: a prediction
    not split per link. None measured: ``measured_bytes`` is null."""
    devices = list(devices)
    predicted = dict(predicted or {})
    want = sum(predicted.values()) if predicted else predicted_total
    if traffic is None:
        return {"measured_bytes": None, "predicted_bytes": want,
                "measured_over_predicted": None, "per_link": {}, "per_link_and_kind": {}, "control_bytes": None}
    kinds = None if kinds is None else set(kinds)
    measured: dict[tuple[str, str], int] = {}
    for (sender, link, kind), (_, n) in traffic.sent.items():
        if link in devices and link != sender and (kinds is None or kind in kinds):
            measured[(sender, link)] = measured.get((sender, link), 0) + n
    total = sum(measured.values())
    return {"measured_bytes": total, "predicted_bytes": want,
            "measured_over_predicted": round(total / want, 4) if want else None,
            "per_link": {f"{s}->{d}": {"measured": measured.get((s, d), 0), "predicted": predicted.get((s, d))}
                         for s, d in sorted(set(measured) | set(predicted))},
            "per_link_and_kind": traffic.per_link_and_kind(),
            "control_bytes": traffic.nbytes(links=[COORDINATOR_LINK])}


def predicted_from_events(events, sender=lambda lane: lane) -> dict[tuple[str, str], int]:
    """(src, dst) → bytes of a simulated run's ``send`` events between two devices: what a technique's
    simulated schedule (its cost model timed) says the links carry. ``sender``: the device of an event's
    lane (a technique that draws sends on a lane of their own, e.g. EPD's ``DEVICE:link``)."""
    out: dict[tuple[str, str], int] = {}
    for ev in events:
        src = sender(ev.device)
        if ev.kind == "send" and ev.peer and ev.peer != src:
            out[(src, ev.peer)] = out.get((src, ev.peer), 0) + ev.nbytes
    return out


def micro_batch_steps(token_events) -> dict[int, tuple[int, int]]:
    """Micro-batch → (its sequences, the generation steps it ran: the prefill and each decode step), from
    a run's token events: what a prediction of the run's traffic counts (EOS can end a run early)."""
    steps: dict[int, set[int]] = {}
    rows: dict[int, int] = {}
    for t in token_events:
        steps.setdefault(t.micro_batch, set()).add(t.step)
        rows[t.micro_batch] = max(rows.get(t.micro_batch, 0), len(t.sequence_ids))
    return {mb: (rows[mb], len(k)) for mb, k in steps.items()}


def frame_header_bytes(*, kind: str, phase: str, step: int, micro_batch: int, sender: str,
                       tensors: Iterable[tuple[str, tuple[int, ...]]], run_id: str, options=None) -> int:
    """Bytes of one data frame's header as an agent encodes it (``agents.data_frames.encode_data_header`` of
    the ``DataHeader`` it sends: field names, run id, sender, each tensor's dtype and shape, the send time,
    the kind's ``options`` if any). Encoded here, not typed in: a change to the wire format changes the
    prediction with it."""
    header = DataHeader(run_id=run_id, kind=kind, phase=phase, step=step, micro_batch=micro_batch, sender=sender,
                        tensors=tuple(TensorSpec(dtype, tuple(shape)) for dtype, shape in tensors), t_sent=1.0,
                        options=options_slot(options))
    return len(encode_data_header(header))


_MASK_DTYPE = "int64"
"""A prefill's attention mask travels beside the activation as int64 (``agents.stage_run``)."""


def predicted_stage_bytes(spec, plan, prompt_width: int, token_events, run_id: str, dtype: str = "float32",
                          ran: dict[int, tuple[int, int]] | None = None) -> dict[tuple[str, str], int]:
    """(src, dst) → bytes a layer-sharded run of ``plan`` sends, by the cost model's per-token terms
    (``core.planning.cost.stage_output_bytes``: the stage's last unit's ``activation_bytes_per_token``,
    a token id from the head) plus what the wire format adds to each frame: its header
    (``frame_header_bytes``) and, on a prefill's activation frames, the attention mask (int64 per position).
    Per micro-batch of n sequences that produced k steps: the prefill's n × ``prompt_width`` positions and
    k - 1 decode steps of n, each stage to the next; the last stage's token back to the first, k times.
    Counted on the run's own steps (EOS ends a run early). ``run_id``: the run's (its frames carry it; a
    resumed segment's id is as long). ``dtype``: the activations' wire dtype. ``ran``: micro-batch →
    (sequences, steps) as the frames number them, when not the token events' (a resumed segment's)."""
    ran = micro_batch_steps(token_events) if ran is None else ran
    size = DTYPE_SIZES[dtype]
    out: dict[tuple[str, str], int] = {}
    stages = plan.stages
    for j, st in enumerate(stages):
        last = j == len(stages) - 1
        dst = stages[0].device if last else stages[j + 1].device
        if dst == st.device:
            continue
        per_token = spec.units[st.end - 1].activation_bytes_per_token
        n = 0
        for mb, (rows, steps) in ran.items():
            for step in range(steps):
                positions = 1 if last else (prompt_width if step == 0 else 1)
                if last:
                    tensors = [("int64", (rows,))]
                else:
                    tensors = [(dtype, (rows, positions, per_token // size))]
                    if step == 0:
                        tensors.append((_MASK_DTYPE, (rows, prompt_width)))
                n += per_token * rows * positions + frame_header_bytes(
                    kind="tokens" if last else "hidden", phase="prefill" if step == 0 else "decode", step=step,
                    micro_batch=mb, sender=st.device, tensors=tensors, run_id=run_id)
                if not last and step == 0:
                    n += DTYPE_SIZES[_MASK_DTYPE] * rows * prompt_width
        out[(st.device, dst)] = out.get((st.device, dst), 0) + n
    return out


def segments_stage_bytes(spec, plan, prompt_width: int, token_events, run_id: str, recoveries,
                         dtype: str = "float32") -> list[dict[tuple[str, str], int]]:
    """Per segment of a run that re-planned (the first on ``plan``, then one per ``RecoveryRecord`` on its
    re-planned plan), (src, dst) → the bytes ``predicted_stage_bytes`` gives for the steps that segment
    produced: a resumed segment prefills its micro-batches' prompts and tokens so far
    (``RecoveryRecord.resumed_width``) and numbers its micro-batches and steps from 0."""
    inf = 1 << 62
    bounds = [{mb: (mb, 0, inf) for mb in micro_batch_steps(token_events)}]
    for r in recoveries:
        for key, first in zip(r.keys, r.first_steps):  # the previous segment ends where this one resumes
            if key in bounds[-1]:
                i, lo, _ = bounds[-1][key]
                bounds[-1][key] = (i, lo, first)
        bounds.append({key: (i, first, inf) for i, (key, first) in enumerate(zip(r.keys, r.first_steps))})
    plans = [(plan, prompt_width), *((r.plan, r.resumed_width) for r in recoveries)]
    return [predicted_stage_bytes(spec, p, width, token_events, run_id, dtype, ran=_steps_within(token_events, b))
            for (p, width), b in zip(plans, bounds)]


def _steps_within(token_events, bounds: dict[int, tuple[int, int, int]]) -> dict[int, tuple[int, int]]:
    """Segment micro-batch → (sequences, steps): the whole run's token events of each micro-batch
    ``key`` in ``bounds`` (key → its index in the segment, first step, end step) within its steps."""
    steps: dict[int, set[int]] = {}
    rows: dict[int, int] = {}
    for t in token_events:
        if t.micro_batch in bounds:
            i, lo, hi = bounds[t.micro_batch]
            if lo <= t.step < hi:
                steps.setdefault(i, set()).add(t.step)
                rows[i] = max(rows.get(i, 0), len(t.sequence_ids))
    return {i: (rows[i], len(k)) for i, k in steps.items()}


def layer_sharding_wire(model_dir: str, dtype: str, prompts, result, meter: WireMeter, plan,
                        speculative: bool = False) -> dict:
    """A layer-sharded run's wire figures (``edgeshard run``, the Run screen, ``serve`` per request): the
    agents' socket counts (``meter``) beside ``predicted_stage_bytes`` for ``plan`` (the plan the run
    started on) and the steps ``result`` (its ``RunResult``) took. After a re-plan: each segment on its own
    plan (the lost agent's own sends are unread, so not predicted either), and ``after_replan``: what the
    last re-planned stages sent against their plan's prediction. Speculative: measured only, for now
    (its trips follow another schedule)."""
    from core.models.units import load_model_spec
    from core.runs.run_tokenizer import encode_left_padded, load_run_tokenizer

    traffic = meter.traffic
    if result.plan is None or speculative:
        return wire_figures(traffic, result.plan.devices() if result.plan is not None else (), None)
    spec = load_model_spec(model_dir, {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(dtype, dtype))
    width = len(encode_left_padded(load_run_tokenizer(model_dir), list(prompts)).input_ids[0])  # as the run encoded
    segments = segments_stage_bytes(spec, plan, width, result.token_events, result.run_id, result.recoveries, dtype)
    lost = {d for r in result.recoveries for d in (r.failed, *r.also_lost)}
    predicted: dict[tuple[str, str], int] = {}
    for segment in segments:
        for (src, dst), n in segment.items():
            if src not in lost:
                predicted[(src, dst)] = predicted.get((src, dst), 0) + n
    wire = wire_figures(traffic, list(dict.fromkeys([*plan.devices(), *result.plan.devices()])), predicted)
    if result.recoveries:
        last = result.recoveries[-1]
        after = None if last.wire_at_resume is None or meter.after is None else \
            sent_between(last.wire_at_resume, meter.after)
        wire["after_replan"] = wire_figures(after, result.plan.devices(), segments[-1])
    return wire
