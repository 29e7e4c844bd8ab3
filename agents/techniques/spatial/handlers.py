"""How an agent serves spatial partitioning's messages: a strip on request (``ComputeStrip``), a run
on the data plane (``SpatialSetup``, then the gateway's ``ClassifyImage``s), the generated network
kept between them."""

from __future__ import annotations

from agents.emulation import emulated
from agents.registry import Handler
from agents.techniques.spatial.messages import ClassifyImage, ComputeStrip, SpatialSetup, StripComputed

ROOM = "spatial"
"""This technique's state on an agent (``Agent.room``): its kept ``network`` and running ``session``."""


def conv_sweep(options, slowdown: float = 1.0):
    """A conv-sweep ``ProfileCompute``: the CNN layers' timings its planner fits (``network.conv_sweep``)."""
    from agents.techniques.spatial import network

    return network.conv_sweep(options, slowdown)


def free_memory(agent) -> None:
    """A kept network's memory goes to the stage or hold that needs it."""
    agent.room(ROOM).pop("network", None)


def compute_strip(agent, msg: ComputeStrip, stop) -> StripComputed:
    """The network is generated from the request's seed once and kept; the strip's compute is slowed
    like any on an emulated device (``emulated``)."""
    from agents.techniques.spatial import network
    from agents.techniques.spatial.session import spatial_network

    net = spatial_network(agent, msg.net)
    t_start = agent.clock()
    with emulated(agent.emulation.compute_slowdown):
        out = network.compute_strip(net, msg.start, msg.end, msg.x_lo, msg.lo, msg.hi, msg.shape, msg.data,
                                    msg.head)
    shape, data = out
    return StripComputed(req=msg.req, shape=shape, data=data, t_start=t_start, t_end=agent.clock())


def admit_setup(agent, msg: SpatialSetup):
    if agent.device not in {p.device for p in msg.devices}:
        return "bad_message", f"device {agent.device} is not in this spatial plan"
    return None


def serve_setup(agent, msg: SpatialSetup, stop) -> None:
    """Serve a spatial run (``session.SpatialSession``) until it is stopped."""
    from agents.techniques.spatial.session import SpatialSession

    loaded = agent.loaded_stage
    if loaded is not None:  # its own coordinator's, or one silent for LOADER_SILENT_S (the lease rules)
        m = loaded.msg
        agent.log(f"unloading its {m.kind} stage (units [{m.start}, {m.end})) for spatial run {msg.run_id}")
    agent.unload()
    agent.set_event_meta(msg.run_id, 0)
    state = agent.room(ROOM)

    def open_session():
        state["session"] = SpatialSession(agent, msg, stop)
        return state["session"]

    agent.serve_held(msg, "spatial run", open_session, ready=f"spatial run {msg.run_id} ready", ended="stopped",
                     on_end=lambda: state.pop("session", None))


def describe_setup(agent, msg: SpatialSetup) -> str:
    role = "gateway" if msg.gateway == agent.device else "a worker"
    return f"spatial run {msg.run_id} of {msg.net.network} (as {role})"


def hand_image(agent, identity, msg: ClassifyImage):
    """To the running session's gateway, on the control thread (it serves images as they come)."""
    session = agent.room(ROOM).get("session")
    if session is None or not session.is_gateway or msg.run_id != agent.run_id:
        return "bad_state", f"device {agent.device} is not the gateway of spatial run {msg.run_id!r}"
    session.images.put(msg)
    return None


HANDLERS = (
    Handler(ComputeStrip, serve=compute_strip, exclusive=True, wanted="compute a strip"),
    Handler(SpatialSetup, serve=serve_setup, admit=admit_setup, takes_run=True, exclusive=True, replaces_stage=True,
            wanted="join a spatial run", describe=describe_setup),
    Handler(ClassifyImage, on_control=hand_image),
)
