"""The netns testbed: real namespaces, sshd, mDNS and tc shaping (root only)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from core.errors import FormatError
from core.devices import testbed as tb
from core.devices.testbed import LinkCap, LinksFile, leftovers, resolve_links

from tests.core.conftest import SESSION_TESTBED, SHAPED_LINK, needs_root

_TCP_PROBE = textwrap.dedent(
    """
    import socket, sys, time
    role, addr, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if role == "server":
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, 5901)); s.listen(); print("ready", flush=True)
        c, _ = s.accept(); n = 0
        while n < nbytes:
            b = c.recv(1 << 16)
            if not b: break
            n += len(b)
        c.sendall(b"k"); c.close()
    else:
        c = socket.create_connection((addr, 5901)); buf = bytes(1 << 16); t = time.perf_counter()
        for _ in range(nbytes // len(buf)): c.sendall(buf)
        c.recv(1); print(nbytes // len(buf) * len(buf) * 8 / (time.perf_counter() - t) / 1e6)
    """
)


def _tcp_mbit(src_ns: str, dst_ns: str, dst_addr: str, nbytes: int) -> float:
    server = subprocess.Popen(["ip", "netns", "exec", dst_ns, sys.executable, "-c", _TCP_PROBE, "server", dst_addr,
                               str(nbytes // (1 << 16) * (1 << 16))], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        out = subprocess.run(["ip", "netns", "exec", src_ns, sys.executable, "-c", _TCP_PROBE, "client", dst_addr,
                              str(nbytes)], capture_output=True, text=True, timeout=60, check=True)
        return float(out.stdout.strip())
    finally:
        server.wait(timeout=10)


@pytest.mark.netns
@needs_root
def test_each_device_has_its_own_address_sshd_and_host_key(testbed):
    keys = set()
    for d in testbed.devices:
        with socket.create_connection((d.address, d.ssh_port), timeout=2) as s:
            assert s.recv(64).startswith(b"SSH-2.0-OpenSSH")
        keys.add(Path(d.host_key_path + ".pub").read_text().split()[1])
    assert len(keys) == len(testbed.devices) == 3
    assert len({d.address for d in testbed.devices}) == 3
    assert tb.testbed_status(SESSION_TESTBED, Path(testbed.state_dir).parent) == testbed


@pytest.mark.netns
@needs_root
def test_shaped_link_carries_its_configured_rate_and_reverse_is_not_capped(testbed):
    src, dst, mbit = SHAPED_LINK
    a, b = testbed.device(src), testbed.device(dst)
    shaped = _tcp_mbit(a.namespace, b.namespace, b.address, 1_500_000)
    print(f"shaped {mbit} Mbit/s link measured at {shaped:.2f} Mbit/s (raw TCP)")
    assert abs(shaped - mbit) <= 0.1 * mbit
    reverse = _tcp_mbit(b.namespace, a.namespace, a.address, 20_000_000)
    assert reverse > 10 * mbit


@needs_root
@pytest.mark.netns
def test_down_removes_everything_and_is_idempotent(tmp_path):
    state = tb.testbed_up(2, bandwidth_mbit_s=50, name="esdn", subnet="10.80.0.0/24", state_root=tmp_path)
    pids = [p for d in state.devices for p in (d.sshd_pid, d.mdns_pid)]
    assert leftovers("esdn")
    assert tb.testbed_down("esdn", state_root=tmp_path) is True
    assert leftovers("esdn") == []
    assert not any(Path(f"/proc/{p}").exists() for p in pids)
    assert not Path(state.state_dir).exists()
    assert tb.testbed_down("esdn", state_root=tmp_path) is False


@needs_root
@pytest.mark.netns
def test_up_cleans_leftovers_of_a_crashed_testbed(tmp_path):
    first = tb.testbed_up(1, name="esst", subnet="10.81.0.0/24", state_root=tmp_path)
    # A crash: the state file is lost, namespace and daemons are still there.
    (Path(first.state_dir) / "testbed.json").unlink()
    try:
        second = tb.testbed_up(2, name="esst", subnet="10.81.0.0/24", state_root=tmp_path)
        assert not Path(f"/proc/{first.devices[0].sshd_pid}").exists()
        assert [d.name for d in second.devices] == ["esst1", "esst2"]
    finally:
        tb.testbed_down("esst", state_root=tmp_path)
    assert leftovers("esst") == []


def test_links_file_naming_an_unknown_device_is_rejected():
    links = LinksFile(links=(LinkCap(src="edge1", dst="edge9", bandwidth_mbit_s=5),))
    with pytest.raises(FormatError, match="edge9"):
        resolve_links(["edge1", "edge2"], None, links)


def test_bandwidth_applies_to_every_ordered_pair_and_links_file_overrides():
    caps = resolve_links(["e1", "e2", "e3"], None,
                         LinksFile(default_mbit_s=100, links=(LinkCap(src="e2", dst="e1", bandwidth_mbit_s=7),)))
    table = {(c.src, c.dst): c.bandwidth_mbit_s for c in caps}
    assert len(table) == 6 and table[("e2", "e1")] == 7 and table[("e1", "e2")] == 100


def test_without_root_the_error_points_to_cluster_local(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(tb.TestbedError, match="edgeshard cluster local"):
        tb.testbed_up(2, name="esnr")


def test_cli_without_root_exits_nonzero_with_the_hint():
    proc = subprocess.run(
        [sys.executable, "-c", "import os,sys; os.geteuid=lambda:1000; from core.cli import main;"
         " sys.exit(main(['testbed','up','--devices','2','--name','esnr']))"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "cluster local" in proc.stderr and "Traceback" not in proc.stderr
