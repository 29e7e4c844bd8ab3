"""An agent's status stops naming its work before the work's reply goes out: a coordinator that reads the
status right after a profile or link measurement came back must see the agent idle, not still
"profiling compute" or "measuring a link" (as a load's status was cleared before its Ok)."""

from __future__ import annotations

import pytest

from agents.agent import Agent
from agents.protocol import ConvSweepOptions, PeerSpec, ProfileResult
from agents.transport import CurveKeys
from core.devices.profiling import measure_pair
from core.runs.coordinator import AgentEndpoint, Coordinator


@pytest.fixture(scope="module")
def noted():
    """Two in-process agents whose every ProfileResult is noted with the activity their status reports as
    it is posted; and a coordinator over them."""
    keys = CurveKeys.generate()
    agents = [Agent(d, keys.public).start() for d in ("dev-a", "dev-b")]
    seen: list[tuple[str, str]] = []
    for agent in agents:
        def noting(msg, *args, agent=agent, post=agent._post, **kw):
            if isinstance(msg, ProfileResult):
                seen.append((type(msg.result).__name__, agent._status(0).activity))
            post(msg, *args, **kw)

        agent._post = noting
    try:
        with Coordinator([AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents], keys) as co:
            yield co, agents, seen
    finally:
        for a in agents:
            a.close()


def test_a_compute_profiles_reply_goes_out_with_the_status_already_idle(noted):
    co, _, seen = noted
    seen.clear()  # a convolution sweep: the compute profile of a CNN, the quickest ProfileCompute
    co.profile_compute("dev-a", ConvSweepOptions(sizes=(4,), channels=(1,), repeats=1))
    assert seen == [("ConvTimings", "")]


def test_a_link_measurements_replies_go_out_with_both_statuses_already_idle(noted):
    co, agents, seen = noted
    a, b = (PeerSpec(device=x.device, stage=0, data_address=x.data_address, public_key=x.keys.public) for x in agents)
    seen.clear()
    measure_pair(co, a, b, 4096)
    assert seen == [("LinkResult", ""), ("LinkResult", "")]
