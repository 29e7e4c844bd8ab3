"""Attention offloading over the agents' data plane: the dense agent's router and stage executor,
and the memory agent's service.

A dense agent (stage kind ``attention-offload-dense``) and its memory agents (``HoldHeads``)
exchange each layer's q, k, v and the attention output as raw tensor frames on the agents'
CurveZMQ data sockets (``DataHeader(kind="attend"/"attended")``, an ``AttendSpec`` in their
options), never through the coordinator. The mask is sent only when the memory side cannot
derive it (mask_mode).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agents.checkpoint_reader import CheckpointError
from agents.emulation import compute_began, emulated, end_emulated
from agents.envelope import options_of, options_slot
from agents.stage_input import ReservationExceeded, StageInputError
from agents.techniques.attention_offload.heads import AttentionStore, DenseExecutor, HeadRouter, HeadShape, reserved_kv_bytes
from agents.techniques.attention_offload.messages import AttendSpec

ATTEND_TIMEOUT_S = 60.0
"""How long a dense agent waits for a memory agent's answer before the run fails naming it."""

PEER_DOWN_S = 3.0
"""How long a memory agent's data connection may stay down while its answer is awaited: a killed
agent's socket closes at once (a dead host's after the ZMTP heartbeat timeout), so the run fails
in seconds naming it instead of after ``ATTEND_TIMEOUT_S``; a blip shorter than this reconnects."""


class MemorySideSilent(RuntimeError):
    """A memory agent did not answer a layer in time, or its data connection went down while its
    answer was awaited. The message starts ``memory agent <names>`` (the core names the lost
    agents from it: ``core.techniques.attention_offload.run``)."""


def lost_connection(devices, what: str) -> MemorySideSilent:
    """The error of a run whose memory agents ``devices`` dropped their data connection mid-run."""
    return MemorySideSilent(f"memory agent {', '.join(devices)} dropped its data connection during {what} and did "
                            f"not come back within {PEER_DOWN_S:g} s (the agent stopped, or its host or link did)")


def next_mask(last: torch.Tensor) -> torch.Tensor:
    """The mask of the next decode step: ``last``'s last row with one more visible column."""
    row = last[..., -1:, :]
    return torch.cat([row, torch.ones(*row.shape[:-1], 1, dtype=row.dtype)], dim=-1)


def mask_mode(last: torch.Tensor | None, mask: torch.Tensor | None) -> str:
    """How ``mask`` reaches a memory side that holds ``last`` for this micro-batch: ``none``,
    ``same`` (the next layer of a step), ``next`` (the next decode step) or ``full`` (sent)."""
    if mask is None:
        return "none"
    if last is not None:
        if last.shape == mask.shape and torch.equal(last, mask):
            return "same"
        if mask.shape[-2] == 1:
            derived = next_mask(last)
            if derived.shape == mask.shape and torch.equal(derived, mask):
                return "next"
    return "full"


def resolve_mask(last: torch.Tensor | None, mode: str, sent: torch.Tensor | None) -> torch.Tensor | None:
    """The memory side's mirror of ``mask_mode``: the mask a frame means (``StageInputError`` when
    it refers to a mask this side does not hold)."""
    if mode == "none":
        return None
    if mode == "full":
        if sent is None:
            raise StageInputError("a full mask was announced but not sent")
        return sent
    if last is None:
        raise StageInputError(f"mask {mode!r} refers to an earlier mask this memory side never got")
    return last if mode == "same" else next_mask(last)


def side_frames(side, group: int, query, key, value, mask, mode: str):
    """The tensor specs and buffers of one memory side's ``attend`` frame: q of its query heads, the
    new k and v of its key/value heads (float32), and the mask when ``mode`` is ``full``."""
    from agents.transport import tensor_frame

    tensors = [query[:, side.start * group:side.stop * group], key[:, side.start:side.stop],
               value[:, side.start:side.stop]]
    tensors = [t.detach().to(torch.float32).contiguous() for t in tensors]
    if mode == "full":
        tensors.append(mask.to(torch.uint8).contiguous())
    return zip(*(tensor_frame(t) for t in tensors))


def _clock_event(agent, kind: str, step: int, group: int, start: float, end: float, nbytes: int = 0,
                 peer: str = "") -> None:
    agent.event(kind, "prefill" if step == 0 else "decode", step, group, start, end, nbytes, peer)


class DataPlaneRouter:
    """The dense agent's attention sides over the data plane: per layer, q/k/v of each side's
    heads go to every memory agent at once, the outputs are awaited together. Records the
    timeline: a ``compute`` span per dense segment, a ``send`` per frame (its bytes on the link,
    header included; the memory agent).
    ``wire_bytes``: tensor bytes out and back; ``header_bytes``: the frames' headers."""

    def __init__(self, agent, shape: HeadShape, services, timeout_s: float = ATTEND_TIMEOUT_S):
        ranges = [range(s.start, s.stop) for s in services]
        HeadRouter(shape, [_Covers(r) for r in ranges])  # the same coverage rule, same message
        self.agent, self.shape, self.timeout_s = agent, shape, timeout_s
        self.sides = sorted(services, key=lambda s: s.start)
        from agents.transport import PeerSenders

        self._senders = PeerSenders(agent.context, agent.keys, 200, clock=agent.clock, monitor_connections=True,
                                    counts=agent.wire)
        self._last_mask: dict[int, torch.Tensor] = {}
        self.wire_bytes = 0
        self.header_bytes = 0
        self.calls = 0
        self.step = 0
        self.group = 0
        self._segment_start = 0.0
        self._segment_began = (0.0, 0.0)

    def _open_segment(self) -> None:
        self._segment_start = self.agent.clock()
        self._segment_began = compute_began()

    def _close_segment(self) -> None:
        """End the running dense segment (its ``compute`` span). On an emulated slower device it
        ends ``compute_slowdown`` × its CPU time after it began (``agents.emulation.end_emulated``):
        the segments are the computation, the waits for the memory agents between them are not
        (as staggered slices and memory agents are slowed)."""
        emulation = getattr(self.agent, "emulation", None)
        end_emulated(emulation.compute_slowdown if emulation is not None else 1.0, self._segment_began)
        _clock_event(self.agent, "compute", self.step, self.group, self._segment_start, self.agent.clock())

    def _sender(self, side):
        return self._senders.to(side.device, side, self.agent.default_link)

    def close(self) -> None:
        self._senders.close()

    def begin(self, group: int, step: int) -> None:
        """A prefill (step 0) or decode step of ``group`` starts: its dense segment opens."""
        self.group, self.step = group, step
        self._open_segment()

    def finish(self) -> None:
        """The step's last dense segment (after the last layer's attention) ends."""
        self._close_segment()

    def attend(self, group: int, layer: int, query, key, value, mask, scaling: float) -> torch.Tensor:
        from agents.protocol import DataHeader, encode_data_header
        from agents.transport import data_message

        agent, step = self.agent, self.step
        self._close_segment()
        mode = mask_mode(self._last_mask.get(group), mask)
        if mask is not None:
            self._last_mask[group] = mask
        g = self.shape.group
        stop = agent.run_stop
        for side in self.sides:
            specs, bufs = side_frames(side, g, query, key, value, mask, mode)
            header = DataHeader(run_id=agent.run_id, kind="attend", phase="prefill" if step == 0 else "decode",
                                step=step, micro_batch=group, sender=agent.device, tensors=tuple(specs),
                                t_sent=agent.clock(),
                                options=options_slot(AttendSpec(layer=layer, kv_start=side.start, kv_stop=side.stop,
                                                  scaling=float(scaling), mask=mode)))
            nbytes = sum(s.nbytes() for s in specs)
            frames = data_message(header, list(bufs))
            self.wire_bytes += nbytes
            self.header_bytes += len(frames[0])
            peer = side.device

            def on_sent(start, end, n, peer=peer):
                _clock_event(agent, "send", step, group, start, end, n, peer)

            self._sender(side).send(frames, nbytes + len(frames[0]), on_sent, stop)  # what the link carries
        outs = self._await_outputs(group, layer, query.shape[0], query.shape[2])
        self.calls += 1
        self._open_segment()
        return torch.cat([outs[s.device] for s in self.sides], dim=2)

    def _await_outputs(self, group: int, layer: int, batch: int, q_len: int) -> dict[str, torch.Tensor]:
        import zmq

        from agents.protocol import ProtocolError, decode_data
        from agents.transport import RunAborted, tensor_from_frame

        agent, g, d = self.agent, self.shape.group, self.shape.head_dim
        pending = {s.device: s for s in self.sides}
        outs: dict[str, torch.Tensor] = {}
        deadline = time.monotonic() + self.timeout_s
        while pending:
            if agent.run_stop.is_set():
                raise RunAborted()
            if time.monotonic() > deadline:
                raise MemorySideSilent(f"memory agent {', '.join(sorted(pending))} did not answer layer {layer} "
                                       f"of micro-batch {group} within {self.timeout_s:g} s (is it up, its link working?)")
            # not Agent.receive_data: the header frame's own bytes are counted below (wire_bytes)
            try:
                frames = agent.data_socket.recv_multipart(copy=False)
            except zmq.Again:
                down = [d for d in self._senders.silent(PEER_DOWN_S) if d in pending]
                if down:
                    raise lost_connection(down, f"layer {layer} of micro-batch {group}") from None
                continue
            try:
                header, bufs = decode_data(frames, 1 << 30)
            except ProtocolError as err:
                agent.log(f"dropped data message: {err.code}: {err}")
                continue
            side = pending.get(header.sender)
            a = options_of(header.options)
            if header.kind != "attended" or side is None or header.run_id != agent.run_id \
                    or header.micro_batch != group or header.step != self.step or a.layer != layer:
                agent.log(f"dropped {header.kind} frame from {header.sender!r} (not the answer awaited)")
                continue
            want = (batch, q_len, (side.stop - side.start) * g, d)
            if len(header.tensors) != 1 or header.tensors[0].dtype != "float32" \
                    or tuple(header.tensors[0].shape) != want:
                agent.log(f"dropped attention output from {header.sender!r}: expected float32 {list(want)}")
                continue
            self.wire_bytes += header.tensors[0].nbytes()
            self.header_bytes += len(frames[0].bytes if hasattr(frames[0], "bytes") else frames[0])
            outs[header.sender] = tensor_from_frame(header.tensors[0], bufs[0])
            del pending[header.sender]
        return outs

    def drop(self, group: int, layers: Sequence[int] | None = None) -> None:
        """The memory agents drop a micro-batch's cache when its next prefill arrives (and all of
        it when their hold ends); here only the mask mirror forgets it."""
        self._last_mask.pop(group, None)


@dataclass(frozen=True)
class _Covers:
    kv_heads: range


class DenseAgentExecutor(DenseExecutor):
    """The dense side as an agent's stage (kind ``attention-offload-dense``): its attention sides
    are memory agents reached over the data plane (``LoadShard.services``). It records its own
    timeline spans (dense segments and transfers), so the stage loop records no whole-step box."""

    records_own_spans = True
    slows_itself = True
    """An emulated slowdown stretches its dense segments only (``DataPlaneRouter``: each ends F × its
    CPU time after it began), not its waits for the memory agents: the agent does not wrap it in
    ``SlowedStage``, whose one computation would span the whole step, waits included."""

    def __init__(self, model_dir: str, start: int, end: int, *, agent, services, dtype: str = "float32",
                 threads: int | None = None, progress=None):
        if not services:
            raise CheckpointError("an attention-offload dense stage needs its memory agents "
                                  "(LoadShard.services): load it through the attention-offload run")
        shape = HeadShape.of(model_dir)
        self._steps: dict[int, int] = {}
        router = DataPlaneRouter(agent, shape, services)
        super().__init__(model_dir, start, end, sides=[_Covers(range(s.start, s.stop)) for s in services],
                         dtype=dtype, threads=threads, progress=progress)
        self.router = router

    def prefill(self, group: int, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self._steps[group] = 0
        self.router.begin(group, 0)
        out = super().prefill(group, x, attention_mask)
        self.router.finish()
        return out

    def decode(self, group: int, x: torch.Tensor) -> torch.Tensor:
        step = self._steps.get(group, 0) + 1
        self._steps[group] = step
        self.router.begin(group, step)
        out = super().decode(group, x)
        self.router.finish()
        return out

    def drop(self, group: int) -> None:
        super().drop(group)
        self._steps.pop(group, None)

    def close(self) -> None:
        self.router.close()


def check_kv_budget(agent, shape: HeadShape, msg) -> None:
    """Refuse a hold whose KV share (``HoldHeads.kv``, float32) exceeds the agent's emulated budget."""
    kv = msg.kv
    needed = reserved_kv_bytes(shape, range(msg.kv_start, msg.kv_stop), kv)
    budget = agent.emulation.memory_budget_bytes
    if kv.groups and budget and needed > budget:
        from agents.emulation import ShardOverBudget

        mib = 1 << 20
        raise ShardOverBudget(f"key/value heads [{msg.kv_start}, {msg.kv_stop}) of {kv.groups} micro-batch(es) of "
                              f"{kv.sequences} sequences up to {kv.context_tokens} tokens need {needed / mib:.1f} MiB "
                              f"of KV cache but device {agent.device} has a {budget / mib:.1f} MiB memory budget: "
                              "use more memory agents, a smaller batch or a shorter context")


class HeadsService:
    """A memory agent's part of a run (``HoldHeads``): serves ``attend`` frames from its dense
    agents with one ``AttentionStore`` and pushes each output back to the sender's data socket.
    Records an attention ``compute`` span per frame and a ``send`` per output on its timeline.
    A frame that does not fit (sender, heads, sizes, a mask it cannot resolve) is dropped with a
    log line; the dense agent then fails the run naming this agent after its timeout."""

    def __init__(self, agent, msg, stop):
        self.agent, self.msg, self.stop = agent, msg, stop
        self.shape = HeadShape.of(msg.model_dir)
        check_kv_budget(agent, self.shape, msg)  # before the reservation is allocated
        self.store = AttentionStore(self.shape, range(msg.kv_start, msg.kv_stop), reservation=msg.kv,
                                    budget_bytes=agent.emulation.memory_budget_bytes)
        self.dense = {p.device: p for p in msg.dense}
        self._masks: dict[int, torch.Tensor] = {}
        from agents.transport import PeerSenders

        self._senders = PeerSenders(agent.context, agent.keys, 200, clock=agent.clock, counts=agent.wire)
        agent.gate_data([p.public_key for p in msg.dense])

    def _sender(self, device: str):
        shape = self.msg.link if self.msg.link.bandwidth_mbit_s or self.msg.link.latency_ms \
            else self.agent.default_link
        return self._senders.to(device, self.dense[device], shape)

    def close(self) -> None:
        self._senders.close()

    def serve(self) -> None:
        from agents.transport import RunAborted

        agent = self.agent
        while not self.stop.is_set():
            got = agent.receive_data(1 << 30)
            if got is None:
                continue
            header, bufs, received = got
            try:
                self._answer(header, bufs, received)
            except ReservationExceeded:  # the run is too large for this hold: it fails, naming both
                raise
            except StageInputError as err:
                agent.log(f"dropped attend frame from {header.sender!r}: {err}")
        raise RunAborted()

    def _answer(self, header, bufs, received: float) -> None:
        from agents.protocol import DataHeader
        from agents.transport import data_message, tensor_frame, tensor_from_frame

        a = options_of(header.options)
        if header.kind != "attend" or header.sender not in self.dense:
            raise StageInputError(f"{header.kind} frames are served for dense agents {sorted(self.dense)} only")
        if (a.kv_start, a.kv_stop) != (self.msg.kv_start, self.msg.kv_stop) or a.layer >= self.shape.layers:
            raise StageInputError(f"heads [{a.kv_start}, {a.kv_stop}) layer {a.layer}: this agent holds heads "
                                  f"[{self.msg.kv_start}, {self.msg.kv_stop}) of {self.shape.layers} layers")
        want = 4 if a.mask == "full" else 3
        if len(header.tensors) != want or any(s.dtype != "float32" for s in header.tensors[:3]) \
                or (want == 4 and header.tensors[3].dtype != "uint8"):
            raise StageInputError(f"an attend frame with mask {a.mask!r} holds float32 q, k, v"
                                  f"{' and a uint8 mask' if want == 4 else ''}")
        q, k, v = (tensor_from_frame(s, b) for s, b in zip(header.tensors[:3], bufs[:3]))
        if self.agent.event_run_id != header.run_id:  # the run the dense agent's frames belong to
            self.agent.set_event_meta(header.run_id, 0)
        key = header.micro_batch  # a batch's masks are one sequence, whichever replica sends its slices
        sent = tensor_from_frame(header.tensors[3], bufs[3]).bool() if want == 4 else None
        mask = resolve_mask(self._masks.get(key), a.mask, sent)
        if mask is not None:
            self._masks[key] = mask
        if header.step == 0 and q.shape[2] > 0:
            self.store.drop(header.micro_batch, [a.layer])  # a prefill starts the micro-batch afresh
        t0 = self.agent.clock()
        with emulated(self.agent.emulation.compute_slowdown):
            out = self.store.attend(header.micro_batch, a.layer, q, k, v, mask, a.scaling).contiguous()
        t1 = self.agent.clock()
        step, group, agent = header.step, header.micro_batch, self.agent
        _clock_event(agent, "compute", step, group, t0, t1)
        spec, buf = tensor_frame(out)
        reply = DataHeader(run_id=header.run_id, kind="attended", phase=header.phase, step=step, micro_batch=group,
                           sender=agent.device, tensors=(spec,), t_sent=t1,
                           options=options_slot(AttendSpec(layer=a.layer, kv_start=a.kv_start, kv_stop=a.kv_stop,
                                             scaling=a.scaling, t_start=t0, t_end=t1)))
        peer = a.reply_to or header.sender
        if peer not in self.dense:
            raise StageInputError(f"attention output asked to go to {peer!r}, not one of {sorted(self.dense)}")

        def on_sent(start, end, n):
            _clock_event(agent, "send", step, group, start, end, n, peer)

        frames = data_message(reply, [buf])
        self._sender(peer).send(frames, spec.nbytes() + len(frames[0]), on_sent, self.stop)
