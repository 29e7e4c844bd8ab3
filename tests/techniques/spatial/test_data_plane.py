"""The spatial map-reduce on the agents' data plane (agents.techniques.spatial.session): strips of any size
travel gateway -> worker -> gateway outside the control channel, emulated links shape them, a
silent worker fails its image by name, and setups that do not fit the network are refused."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch
from msgspec import structs

from agents.protocol import AgentState, PeerSpec, ProtocolError, decode_control, encode_control
from agents.techniques.spatial.messages import ClassifyImage, SpatialNet, SpatialSetup
from agents.techniques.spatial.network import build_network
from core.devices.agent_link import AgentLink
from core.devices.local_cluster import LocalCluster
from core.errors import RunFailed
from core.techniques.spatial.problem import CnnRef, SpatialPlan
from core.techniques.spatial.run import run_spatial
from core.techniques.spatial.strategies import run_strategy
from tests.techniques.spatial.conftest import make_problem

KEY = "x" * 40


def _two(network="vgg16", image=32, width_div=8):
    p = make_problem((2.0, 2.0), 100.0, network=network, image=image, width_div=width_div)
    return structs.replace(p, gateway="local-0", devices=tuple(
        structs.replace(d, id=f"local-{i}") for i, d in enumerate(p.devices)))


def _even(problem) -> SpatialPlan:
    return run_strategy(problem, "even").plan


def _setup(**changes) -> SpatialSetup:
    peers = tuple(PeerSpec(device=f"d{i}", stage=i, data_address=f"tcp://127.0.0.1:{5000 + i}", public_key=KEY)
                  for i in range(2))
    base = dict(run_id="r", net=SpatialNet(network="vgg16", image=32, width_div=8, classes=10), devices=peers,
                gateway="d0", groups=((0, 2), (2, 18)), widths=((16, 16), (1, 0)))
    return SpatialSetup(**{**base, **changes})


def test_strips_larger_than_a_control_frame_travel_on_the_data_plane_and_stay_exact(tmp_path):
    problem = structs.replace(_two(), model=CnnRef(network="vgg16", image=224, width_div=4, classes=10))
    plan = _even(problem)
    assert problem.model.spec().layers[0].out_bytes(112) > 1 << 20  # one strip alone exceeds a control frame
    images = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(3))
    with LocalCluster(tmp_path, 2) as lc, AgentLink(lc.endpoints, lc.keys, heartbeat_timeout_s=30.0) as link:
        link.wait_ready(timeout_s=30)
        run = run_spatial(link, problem, plan, images)
    ref = build_network(problem.model.spec(), seed=0).forward(images)
    torch.testing.assert_close(torch.tensor(run.scores), ref, rtol=1e-4, atol=1e-4)
    scatters = [e for e in run.events if e.kind == "recv_wait" and e.device == "local-1"]
    assert max(e.nbytes for e in run.events if e.kind == "send") > 1 << 20
    assert len(scatters) == len(plan.groups) and all(e.peer == "local-0" for e in scatters)


def test_an_emulated_link_delays_each_scatter_by_the_strip_bytes_over_its_bandwidth(tmp_path):
    problem = _two()
    plan = _even(problem)
    with LocalCluster(tmp_path, 2, link_mbit=4.0) as lc, \
            AgentLink(lc.endpoints, lc.keys, heartbeat_timeout_s=30.0) as link:
        link.wait_ready(timeout_s=30)
        link.sync_clocks()
        run = run_spatial(link, problem, plan, torch.randn(1, 3, 32, 32))
    for kind in ("recv_wait", "send"):  # gateway -> worker, then worker -> gateway, both links shaped
        moved = [e for e in run.events if e.kind == kind and e.device == "local-1" and e.nbytes > 4000]
        assert moved
        for e in moved:
            wire = e.nbytes * 8 / 4e6
            # each end is on another agent's clock, corrected by an estimate: the two corrections may
            # be off by both uncertainties (a loaded host's round trips make those milliseconds)
            skew = 2 * e.clock_uncertainty_s
            assert e.end_s - e.start_s >= 0.8 * wire - skew, (kind, e.nbytes, e.end_s - e.start_s, wire, skew)


def test_a_worker_that_stops_answering_fails_the_image_naming_it_and_every_agent_goes_idle(tmp_path):
    problem = _two()
    plan = _even(problem)
    with LocalCluster(tmp_path, 2) as lc, \
            AgentLink(lc.endpoints, lc.keys, heartbeat_timeout_s=60.0, request_timeout_s=30.0) as link:
        link.wait_ready(timeout_s=30)
        pid = lc.pid_of("local-1")

        def freeze(events, token, _scores):
            if token.step == 0:
                os.kill(pid, signal.SIGSTOP)
                threading.Timer(4.0, os.kill, (pid, signal.SIGCONT)).start()

        with pytest.raises(RunFailed, match=r"no strip of tile \d+ of image [12] from local-1 within 1 s"):
            run_spatial(link, problem, plan, torch.randn(3, 3, 32, 32), timeout_s=1.0, on_image=freeze)
        states = {d: s.state for d, s in link.status(timeout_s=10).items()}
        assert states == {"local-0": AgentState.IDLE, "local-1": AgentState.IDLE}
        run = run_spatial(link, problem, plan, torch.randn(1, 3, 32, 32))  # the cluster runs again
        assert len(run.scores) == 1


def test_a_setup_whose_widths_do_not_fit_the_network_is_refused_by_name_and_the_agent_stays_idle(tmp_path):
    with LocalCluster(tmp_path, 1) as lc, AgentLink(lc.endpoints, lc.keys) as link:
        link.wait_ready(timeout_s=30)
        st = link.status()["local-0"]
        peer = PeerSpec(device="local-0", stage=0, data_address=st.data_address, public_key=st.public_key)
        widths = tuple((32,) if i < 2 else (7,) for i in range(18))
        bad = SpatialSetup(run_id="r", net=SpatialNet(network="vgg16", image=32, width_div=8, classes=10),
                           devices=(peer,), gateway="local-0", groups=tuple((i, i + 1) for i in range(18)),
                           widths=widths)
        with pytest.raises(RunFailed, match=r"tile \[2, 3\) widths sum to 7, its map is 16 columns wide"):
            link.request("local-0", bad)
        with pytest.raises(RunFailed, match="not the gateway of spatial run"):
            link.request("local-0", ClassifyImage(run_id="r", image=0, shape=(1, 3, 32, 32), data=bytes(12288)))
        assert link.status()["local-0"].state is AgentState.IDLE


@pytest.mark.parametrize("changes, why", [
    (dict(gateway="elsewhere"), "gateway elsewhere is not one of the devices"),
    (dict(groups=((0, 2), (3, 18))), "consecutive non-empty layer ranges"),
    (dict(widths=((16, 16), (1,))), "every widths row must give each device"),
    (dict(lease_s=float("nan")), "lease_s must be in"),
])
def test_a_spatial_setup_out_of_range_is_refused_at_decode(changes, why):
    with pytest.raises(ProtocolError, match=why):
        decode_control(encode_control(_setup(**changes)))


def test_an_image_whose_bytes_do_not_match_its_shape_is_refused_at_decode():
    msg = ClassifyImage(run_id="r", image=0, shape=(1, 3, 32, 32), data=b"\0" * 12)
    with pytest.raises(ProtocolError, match="data holds 12 bytes"):
        decode_control(encode_control(msg))
