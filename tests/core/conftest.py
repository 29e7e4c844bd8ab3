"""Shared fixtures for the devices tests: a netns testbed brought up once per session.

The session testbed ``estb`` has 3 devices (10.79.0.1-3, host side 10.79.0.254) and one
shaped link estb1 → estb2 at 10 Mbit/s. Tests that break a device (changed host key,
stopped sshd) build their own small testbed instead. Only root can build testbeds:
without root the netns tests are skipped with that reason.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SESSION_TESTBED = "estb"
SESSION_SUBNET = "10.79.0.0/24"
SHAPED_LINK = ("estb1", "estb2", 10.0)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces (CI runs as root)")


@pytest.fixture(scope="session")
def testbed(tmp_path_factory):
    """3 emulated devices with sshd + mDNS; removed (and checked clean) at the end."""
    if os.geteuid() != 0:
        pytest.skip("needs root for network namespaces (CI runs as root)")
    from core import testbed as tb
    from core.testbed import LinkShape, LinksFile, leftovers

    root = tmp_path_factory.mktemp("testbed-state")
    links = LinksFile(links=(LinkShape(src=SHAPED_LINK[0], dst=SHAPED_LINK[1], bandwidth_mbit_s=SHAPED_LINK[2]),))
    state = tb.testbed_up(3, links=links, name=SESSION_TESTBED, subnet=SESSION_SUBNET, state_root=Path(root))
    yield state
    tb.testbed_down(SESSION_TESTBED, state_root=Path(root))
    assert leftovers(SESSION_TESTBED) == []


@pytest.fixture
def workspace(tmp_path):
    """A workspace directory (its own known_hosts lives here)."""
    ws = tmp_path / "workspace"
    ws.mkdir()
    return ws
