"""A spatial (EdgeMI) run on the data plane: the gateway scatters strips, workers compute, the gateway gathers.

EdgeMI's map-reduce as the agents run it after a ``SpatialSetup``: the coordinator only sends
the gateway each image (``ClassifyImage``) and gets the class scores back with every strip's
times (``ImageClassified``). Per tile the gateway cuts each worker's input strip with its halo
from the map it holds (``group_input_ranges``) and pushes it to that worker's data socket, then
computes its own strip; each worker computes its strip through the tile's layers and pushes it
back; the gateway concatenates them, and after the last tile runs the FC head. Strips travel
as ``DataHeader(kind="strip")`` tensor frames over CurveZMQ — raw float32, checked against the
shape the plan gives before any compute — through each sender's ``LinkSender``, so an emulated
link (``--link-mbit``) shapes them like any stage's activations. Emulated compute slowdowns
sleep after a strip's compute, as a stage's do.

A frame that does not fit the plan (wrong sender, tile, image or shape) is dropped with a log
line; the gateway then waits ``strip_timeout_s`` at most and fails that image naming the
worker (an ``ErrorReply``), and the run goes on.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from agents.emulation import emulated
from agents.envelope import options_of, options_slot
from agents.protocol import DataHeader, ErrorReply
from agents.techniques.spatial.messages import ClassifyImage, ImageClassified, SpatialSetup, StripRelay, StripTimes
from agents.techniques.spatial.network import group_input_ranges, strip_bounds
from agents.transport import (
    LinkSender,
    PeerSenders,
    RunAborted,
    data_message,
    tensor_frame,
    tensor_from_frame,
)

MAX_STRIP_BYTES = 1 << 30
SEND_TIMEOUT_MS = 200


class StripMissing(Exception):
    """A worker's strip did not arrive in time (names the worker and the tile)."""


def plan_problem(net, msg: SpatialSetup) -> str:
    """Whether the setup's tiles fit the network ("" when they do): groups cover every spatial
    layer, each tile's widths sum to its last layer's width."""
    layers = net.spec.layers
    if msg.groups[-1][1] != len(layers):
        return f"tiles cover layers [0, {msg.groups[-1][1]}) but {net.spec.name} has {len(layers)} spatial layers"
    for (start, end), row in zip(msg.groups, msg.widths):
        if sum(row) != layers[end - 1].w_out:
            return f"tile [{start}, {end}) widths sum to {sum(row)}, its map is {layers[end - 1].w_out} columns wide"
    return ""


class SpatialSession:
    """One device's part of a spatial run (the agent's worker thread runs ``serve``)."""

    def __init__(self, agent, msg: SpatialSetup, stop: threading.Event) -> None:
        self.agent = agent
        self.msg = msg
        self.stop = stop
        self.clock = agent.clock
        self.net = spatial_network(agent, msg.net)
        problem = plan_problem(self.net, msg)
        if problem:
            raise ValueError(problem)
        self.peers = {p.device: p for p in msg.devices}
        self.order = [p.device for p in sorted(msg.devices, key=lambda p: p.stage)]
        self.bounds = [dict(zip(self.order, strip_bounds(row))) for row in msg.widths]
        self.is_gateway = agent.device == msg.gateway
        self.images: queue.Queue[ClassifyImage] = queue.Queue()
        self._senders = PeerSenders(agent.context, agent.keys, SEND_TIMEOUT_MS, clock=self.clock, counts=agent.wire)
        agent.gate_data([p.public_key for p in msg.devices if p.device != agent.device] if self.is_gateway
                        else [self.peers[msg.gateway].public_key])

    # ------------------------------------------------------------------ plumbing
    def _sender(self, device: str) -> LinkSender:
        """The PUSH to ``device``'s data socket, connected at first use: by then the coordinator
        has had every device's setup answered, so the peer allows our key."""
        return self._senders.to(device, self.peers[device], self.agent.default_link)

    def close(self) -> None:
        self._senders.close()

    def _send(self, device: str, image: int, group: int, x: torch.Tensor, times: tuple[float, ...] = ()) -> int:
        spec, buf = tensor_frame(x)
        header = DataHeader(run_id=self.msg.run_id, kind="strip", phase="prefill", step=image, micro_batch=group,
                            sender=self.agent.device, tensors=(spec,), t_sent=self.clock(),
                            options=options_slot(StripRelay(times=times)) if times else options_slot(None))
        nbytes = spec.nbytes()
        self._sender(device).send(data_message(header, [buf]), nbytes, None, self.stop)
        return nbytes

    def _receive(self, deadline: float):
        """The next strip frame of this run (header, tensor, arrival time), or None at ``deadline``."""
        while True:
            if self.stop.is_set():
                raise RunAborted()
            if time.monotonic() > deadline:
                return None
            received = self.agent.receive_data(MAX_STRIP_BYTES)
            if received is None:
                continue
            header, bufs, got = received
            if header.run_id != self.msg.run_id or header.kind != "strip" or len(header.tensors) != 1 \
                    or header.tensors[0].dtype != "float32":
                continue  # a straggler of an earlier run or not a strip
            return header, tensor_from_frame(header.tensors[0], bufs[0]), got

    def _compute(self, fn, *args):
        """``fn(*args)`` in inference mode, slowed on an emulated device like any computation
        (``agents.emulation.emulated``: it ends the slowdown × its CPU time after it began)."""
        with emulated(self.agent.emulation.compute_slowdown), torch.inference_mode():
            return fn(*args)

    def _strip_input(self, group: int, device: str) -> tuple[int, int, int, int] | None:
        """(x_lo, x_hi, lo, hi) of ``device``'s strip of tile ``group``, None when it has none."""
        lo, hi = self.bounds[group][device]
        if hi <= lo:
            return None
        start, end = self.msg.groups[group]
        a, b = group_input_ranges(self.net.spec.layers[start:end], lo, hi)[0]
        return a, b, lo, hi

    # -------------------------------------------------------------------- serving
    def serve(self) -> None:
        if self.is_gateway:
            self._serve_gateway()
        else:
            self._serve_worker()

    def _serve_worker(self) -> None:
        me, gateway = self.agent.device, self.msg.gateway
        while True:
            header, x, received = self._receive(float("inf"))
            problem = self._worker_frame_problem(header, x)
            if problem:
                self.agent.log(f"dropped strip from {header.sender!r}: {problem}")
                continue
            # Connected (at the first strip) before computing it: the Curve handshake to the gateway
            # runs beside the compute instead of delaying the first image's gather (~30 ms measured).
            self._sender(gateway)
            g = header.micro_batch
            a, _, lo, hi = self._strip_input(g, me)
            start, end = self.msg.groups[g]
            t_start = self.clock()
            y = self._compute(self.net.strip, start, end, x, a, lo, hi)
            t_end = self.clock()
            self._send(gateway, header.step, g, y, (received, t_start, t_end))

    def _worker_frame_problem(self, header: DataHeader, x: torch.Tensor) -> str:
        if header.sender != self.msg.gateway:
            return "strips come from the gateway only"
        g = header.micro_batch
        if not 0 <= g < len(self.msg.groups):
            return f"tile {g} is not in the plan ({len(self.msg.groups)} tiles)"
        cut = self._strip_input(g, self.agent.device)
        if cut is None:
            return f"this device has no strip in tile {g}"
        a, b, _, _ = cut
        first = self.net.spec.layers[self.msg.groups[g][0]]
        want = (1, first.c_in, first.h_in, b - a)
        if tuple(x.shape) != want:
            return f"tile {g} needs a strip of shape {list(want)} (columns [{a}, {b}) with halo), got {list(x.shape)}"
        return ""

    def _serve_gateway(self) -> None:
        for device in self.order:  # every worker allows our key by now (its setup came first): connect
            if device != self.agent.device:  # before the first image, not during its first scatter
                self._sender(device)
        while not self.stop.is_set():
            try:
                req = self.images.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                reply = self._classify(req)
            except StripMissing as err:
                reply = ErrorReply(req=req.req, code="failed", message=str(err))
            except ValueError as err:
                reply = ErrorReply(req=req.req, code="bad_message", message=str(err))
            self.agent.post(reply)
        raise RunAborted()

    def _classify(self, req: ClassifyImage) -> ImageClassified:
        import numpy as np

        spec = self.net.spec
        if tuple(req.shape) != (1, 3, spec.image, spec.image):
            raise ValueError(f"{spec.name} takes 1×3×{spec.image}×{spec.image} images, got {list(req.shape)}")
        h = torch.from_numpy(np.frombuffer(req.data, dtype="<f4").reshape(req.shape).copy())
        strips: list[StripTimes] = []
        me, image = self.agent.device, req.image
        for g, (start, end) in enumerate(self.msg.groups):
            pending: dict[str, tuple[float, int]] = {}
            for device in self.order:
                cut = self._strip_input(g, device)
                if cut is None or device == me:
                    continue
                a, b, _, _ = cut
                t = self.clock()
                pending[device] = (t, self._send(device, image, g, h[..., a:b].contiguous()))
            parts: dict[str, torch.Tensor] = {}
            own = self._strip_input(g, me)
            if own is not None:
                a, b, lo, hi = own
                t0 = self.clock()
                parts[me] = self._compute(self.net.strip, start, end, h[..., a:b], a, lo, hi)
                t1 = self.clock()
                strips.append(StripTimes(device=me, group=g, scattered=t0, received=t0, start=t0, end=t1,
                                         gathered=t1))
            deadline = time.monotonic() + self.msg.strip_timeout_s
            while pending:
                got = self._receive(deadline)
                if got is None:
                    raise StripMissing(f"no strip of tile {g} of image {image} from {', '.join(sorted(pending))} "
                                       f"within {self.msg.strip_timeout_s:g} s (is the device up and its link working?)")
                header, y, arrived = got
                problem = self._gateway_frame_problem(header, y, image, g, pending)
                if problem:
                    self.agent.log(f"dropped strip from {header.sender!r}: {problem}")
                    continue
                scattered, in_bytes = pending.pop(header.sender)
                parts[header.sender] = y.clone()
                received, t_start, t_end = _relayed(header)
                strips.append(StripTimes(device=header.sender, group=g, scattered=scattered, received=received,
                                         start=t_start, end=t_end, gathered=arrived, in_bytes=in_bytes,
                                         out_bytes=y.numel() * 4))
            h = torch.cat([parts[d] for d in self.order if d in parts], dim=-1)
        t0 = self.clock()
        scores = self._compute(self.net.head, h)[0]
        t1 = self.clock()
        strips.append(StripTimes(device=me, group=len(self.msg.groups), scattered=t0, received=t0, start=t0, end=t1,
                                 gathered=t1))
        return ImageClassified(req=req.req, image=image, scores=tuple(float(v) for v in scores),
                               strips=tuple(strips))

    def _gateway_frame_problem(self, header: DataHeader, y: torch.Tensor, image: int, g: int, pending) -> str:
        if header.sender not in pending:
            return "not a worker this tile waits for"
        if header.step != image or header.micro_batch != g:
            return f"image {header.step} tile {header.micro_batch}, expected image {image} tile {g}"
        if len(_relayed(header)) != 3:
            return "a strip's result carries (received, compute start, compute end)"
        lo, hi = self.bounds[g][header.sender]
        last = self.net.spec.layers[self.msg.groups[g][1] - 1]
        want = (1, last.c_out, last.h_out, hi - lo)
        if tuple(y.shape) != want:
            return f"tile {g} returns shape {list(want)}, got {list(y.shape)}"
        return ""


def _relayed(header: DataHeader) -> tuple[float, ...]:
    """The times a strip's result relays (``StripRelay``); none for a strip sent to a worker."""
    relay = options_of(header.options)
    return relay.times if relay is not None else ()


def spatial_network(agent, net):
    """The generated network a spatial request names (``SpatialNet``), kept on the agent while requests
    name it (one at a time: a new one replaces it): a spatial run after another of the same network
    neither regenerates its weights nor pays fresh weights' first calls (a new VGG16 96²/2's first
    strip took 1.5–2× the next ones, ×3 on a 3× emulated device)."""
    import msgspec

    from agents.techniques.spatial import network

    state = agent.room("spatial")
    key = msgspec.structs.astuple(net)
    kept = state.get("network")
    if kept is None or kept[0] != key:
        kept = (key, network.network_for(net.network, net.image, net.width_div, net.classes, net.seed,
                                               net.weights))
        state["network"] = kept  # one network at a time: the memory of the last one goes
    return kept[1]
