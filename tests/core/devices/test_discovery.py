"""Discovery over real mDNS: testbed namespaces advertise, the host side browses on the
testbed bridge only (never on the machine's real interfaces)."""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from core.devices.discovery import (
    AGENT_SERVICE_TYPE,
    AgentAnnouncement,
    DeviceDiscovery,
    DiscoveryError,
    ServiceRecord,
    parse_agent_txt,
    select_interfaces,
)

from agents.protocol import PROTOCOL_VERSION
from tests.core.conftest import SESSION_DEVICES, SESSION_SUBNET, needs_root

D1, D2, D3 = SESSION_DEVICES

pytestmark = [pytest.mark.netns, needs_root]

_REGISTER = textwrap.dedent(
    """
    import json, socket, sys
    from zeroconf import IPVersion, ServiceInfo, Zeroconf
    addr, stype, inst, host, port, props = sys.argv[1:7]
    if stype == "agent":
        from agents.announce import announce_agent
        a = announce_agent(addr, int(port), name=inst)
        print("ready", flush=True); sys.stdin.read(); a.close(); sys.exit()
    zc = Zeroconf(interfaces=[addr], ip_version=IPVersion.V4Only)
    info = ServiceInfo(stype, f"{inst}.{stype}", addresses=[socket.inet_aton(addr)], port=int(port),
                       properties=json.loads(props), server=f"{host}.local.")
    zc.register_service(info)
    print("ready", flush=True); sys.stdin.read()
    zc.unregister_service(info); zc.close()
    """
)


class _Registration:
    """A service registered from inside a namespace; ``close()`` sends the goodbye."""

    def __init__(self, ns, addr, stype, inst, host="", port=22, props=None, *, wait=True):
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-c", _REGISTER, addr, stype, inst, host or inst,
             str(port), json.dumps(props or {})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if wait:
            self.wait_registered()

    def wait_registered(self) -> None:
        """Until the service is registered (``wait=False`` starts several, whose interpreters start together)."""
        assert self.proc.stdout.readline().strip() == "ready"

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _by_id(devs):
    return {d.id: d for d in devs}


def _as_advertised(testbed):
    """The devices as their ``_ssh._tcp`` records describe them (what the tests assert): a
    device may be listed earlier, from its agent's record alone, with no SSH port yet."""

    def check(ds) -> bool:
        devs = _by_id(ds)
        return all(d.name in devs and devs[d.name].addresses == (d.address,) and devs[d.name].ssh_port == 22
                   and devs[d.name].online for d in testbed.devices)

    return check


def test_testbed_devices_are_found_by_their_ssh_advertisements(testbed):
    # Agent records first (as in a full run, where the session's agents announce themselves):
    # the devices then appear before their SSH records are resolved.
    regs = [_Registration(d.namespace, d.address, "agent", d.name, port=47190, wait=False) for d in testbed.devices]
    try:
        for r in regs:
            r.wait_registered()
        with DeviceDiscovery(interfaces=[testbed.bridge]) as disc:
            assert disc.wait_for(_as_advertised(testbed), 8), disc.devices()
            assert _as_advertised(testbed)(disc.devices())
    finally:
        for r in regs:
            r.close()
    assert disc.bound_addresses == [testbed.host_address]


def _record(stype, name, host, address, port, txt=()):
    return ServiceRecord(type=stype, name=f"{name}.{stype}", host=host, addresses=(address,), port=port, txt=txt)


def test_ssh_port_survives_every_order_of_ssh_and_agent_records():
    """Merging is order-independent: the agent record (first or last, added or removed) never
    loses the SSH record's port, and the SSH record never loses the agent's figures."""
    agent = AgentAnnouncement(agent_version="0.1", protocol_version=1, arch="x86_64", cores=2,
                              memory_bytes=2**30, accelerator="", control_port=47000)
    txt = (("accel", ""), ("agent", "0.1"), ("arch", "x86_64"), ("cores", "2"), ("mem", str(2**30)),
           ("port", "47000"), ("proto", "1"))
    ssh = _record("_ssh._tcp.local.", "box", "box", "10.9.9.9", 2200)
    ag = _record(AGENT_SERVICE_TYPE, "box", "box", "10.9.9.9", 47000, txt)
    for order in ([ag, ssh], [ssh, ag], [ag, ssh, ag]):
        disc = DeviceDiscovery()
        for rec in order:
            disc._upsert(rec, agent if rec is ag else None)
        (dev,) = disc.devices()
        assert (dev.ssh_port, dev.agent, dev.online) == (2200, agent, True), order
    disc._remove(AGENT_SERVICE_TYPE, ag.name)
    (dev,) = disc.devices()
    assert dev.ssh_port == 2200 and dev.agent is None and dev.online


def test_agent_record_is_parsed_and_merged_with_the_ssh_record_of_its_host(testbed):
    dev = testbed.device(D3)
    with DeviceDiscovery(interfaces=[testbed.bridge]) as disc, \
            _Registration(dev.namespace, dev.address, "agent", D3, port=47100):
        assert disc.wait_for(lambda ds: any(d.id == D3 and d.agent and d.ssh_port for d in ds), 5)
        merged = _by_id(disc.devices())[D3]
    assert {s.type for s in merged.services} == {"_ssh._tcp.local.", "_edgeshard._tcp.local."}
    a = merged.agent
    assert a.control_port == 47100 and a.protocol_version >= 1 and a.cores >= 1 and a.memory_bytes > 0
    assert merged.to_cluster_device().memory_bytes == a.memory_bytes


def test_device_that_goes_away_is_marked_offline_not_deleted(testbed):
    dev = testbed.device(D2)
    changes = []
    with DeviceDiscovery(lambda d: changes.append(d), interfaces=[testbed.bridge]) as disc:
        with _Registration(dev.namespace, dev.address, "_workstation._tcp.local.", "ghost-box", host="ghost",
                           port=9):
            assert disc.wait_for(lambda ds: "ghost" in _by_id(ds) and _by_id(ds)["ghost"].online, 5)
        assert disc.wait_for(lambda ds: not _by_id(ds)["ghost"].online, 5)
        ghost = _by_id(disc.devices())["ghost"]
    assert ghost.services == () and ghost.addresses == (dev.address,)
    assert [c.online for c in changes if c.id == "ghost"][-1] is False


def test_agent_record_with_invalid_txt_is_reported_and_not_trusted(testbed):
    dev = testbed.device(D1)
    bad = {"agent": "0.1", "proto": "1", "arch": "x86_64", "cores": "4", "mem": "lots", "accel": "", "port": "5"}
    with DeviceDiscovery(interfaces=[testbed.bridge]) as disc, \
            _Registration(dev.namespace, dev.address, "_edgeshard._tcp.local.", "liar", host="liar", props=bad):
        assert disc.wait_for(lambda ds: "liar" in _by_id(ds), 5)
        liar = _by_id(disc.devices())["liar"]
    assert liar.agent is None
    assert "mem='lots'" in liar.problems[0]


def test_parse_agent_txt_names_missing_keys():
    with pytest.raises(ValueError, match="lacks .*port"):
        parse_agent_txt({"agent": "1", "proto": "1", "arch": "a", "cores": "1", "mem": "1", "accel": ""})


def test_hand_added_host_is_merged_with_its_mdns_records(testbed):
    dev = testbed.device(D2)
    with DeviceDiscovery(interfaces=[testbed.bridge]) as disc:
        manual = disc.add_manual(dev.address, 22, "root")
        assert manual.manual and manual.id == dev.address
        assert disc.wait_for(lambda ds: any(s.host == D2 for d in ds for s in d.services), 5)
        merged = [d for d in disc.devices() if dev.address in d.addresses]
    assert len(merged) == 1 and merged[0].manual and merged[0].ssh_user == "root"


def test_changes_arrive_on_a_zeroconf_thread_through_the_callback(testbed):
    threads = set()
    with DeviceDiscovery(lambda d: threads.add(threading.current_thread().name),
                         interfaces=[testbed.bridge]) as disc:
        assert disc.wait_for(lambda ds: len(ds) >= 3, 5)
    assert threads and threading.main_thread().name not in threads


def test_unknown_interface_is_a_clear_error():
    with pytest.raises(DiscoveryError, match="unknown interface 'nosuch0'"):
        select_interfaces(["nosuch0"])


_BROWSE_IN_NS = textwrap.dedent(
    """
    import sys, time
    from core.devices.discovery import DeviceDiscovery
    watched, exclude = sys.argv[1], sys.argv[2:]
    sent = lambda: int(open(f"/sys/class/net/{watched}/statistics/tx_packets").read())
    before = sent()
    with DeviceDiscovery(exclude_interfaces=exclude) as d:
        deadline = time.monotonic() + 10
        while sent() == before and time.monotonic() < deadline:  # until its queries went out
            time.sleep(0.02)
        time.sleep(0.5)  # the browser's first queries (20-120 ms after it starts) on every interface
    """
)


def _tx_packets(ns: str, dev: str) -> int:
    out = subprocess.run(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/tx_packets"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_nothing_is_sent_on_an_excluded_interface():
    """Two interfaces (veth pairs) in a private namespace: browsing with one excluded sends only on the other."""
    ns = f"es-dx{os.getpid():x}"  # unique per test run
    run = lambda *a: subprocess.run(["ip", "netns", "exec", ns, *a], check=True, capture_output=True)  # noqa: E731
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        run("sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1")
        for i, dev in enumerate(("dm0", "dm1")):
            run("ip", "link", "add", dev, "type", "veth", "peer", "name", dev + "p")
            run("ip", "addr", "add", f"10.98.{i}.1/24", "dev", dev)
            run("ip", "link", "set", dev + "p", "up")
            run("ip", "link", "set", dev, "up")
        before = {d: _tx_packets(ns, d) for d in ("dm0", "dm1")}
        run(sys.executable, "-c", _BROWSE_IN_NS, "dm0", "dm1")  # browses until dm0 sent, dm1 excluded
        mid = {d: _tx_packets(ns, d) for d in ("dm0", "dm1")}
        run(sys.executable, "-c", _BROWSE_IN_NS, "dm1")
        after = {d: _tx_packets(ns, d) for d in ("dm0", "dm1")}
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=True)
    assert mid["dm0"] > before["dm0"]
    assert mid["dm1"] == before["dm1"], "sent on an excluded interface"
    assert after["dm1"] > mid["dm1"], "the check could not fail: dm1 is used when not excluded"


def test_service_published_by_avahi_daemon_is_discovered(testbed, avahi_peer):
    with DeviceDiscovery(interfaces=[testbed.bridge]) as disc:
        assert disc.wait_for(lambda ds: avahi_peer.host in _by_id(ds), 8), [d.id for d in disc.devices()]
        dev = _by_id(disc.devices())[avahi_peer.host]
    assert dev.addresses == (avahi_peer.address,) and dev.ssh_port == 22
    assert dev.services[0].name.startswith(avahi_peer.service_name)


def test_agent_registration_is_visible_to_avahi_browse(testbed, avahi_peer):
    # A name of its own: the session's agents may already announce D3 (avahi would rename ours).
    dev, name = testbed.device(D3), f"{D3}-extra"
    with _Registration(dev.namespace, dev.address, "agent", name, port=47111):
        out = avahi_peer.browse("_edgeshard._tcp")
    resolved = [line.split(";") for line in out.splitlines() if line.startswith("=")]
    assert any(r[3] == name and r[7] == dev.address and r[8] == "47111" for r in resolved), out
    txt = next(r[9] for r in resolved if r[3] == name)
    assert '"port=47111"' in txt and f'"proto={PROTOCOL_VERSION}"' in txt


def test_cli_discover_lists_the_testbed_devices_as_json(testbed, capsys):
    from core.cli import main

    manual = SESSION_SUBNET.replace(".0/24", ".200")
    assert main(["discover", "--interface", testbed.bridge, "--timeout", "1.5", "--json",
                 "--add", f"root@{manual}:2222"]) == 0
    devs = {d["id"]: d for d in json.loads(capsys.readouterr().out)}
    assert set(SESSION_DEVICES) <= set(devs)
    assert devs[manual]["manual"] and devs[manual]["ssh_port"] == 2222



def test_a_device_that_dies_without_a_goodbye_is_offline_within_10_s_and_back_when_it_answers(testbed):
    """python-zeroconf would keep its records ~19 minutes; the re-query notices in seconds: with the
    defaults (a re-query every 2 s, offline after 2 unanswered) within 10 s; timed here with re-queries
    every second (the test's clock; the same two misses), as the defaults' bound is their arithmetic."""
    defaults = inspect.signature(DeviceDiscovery).parameters
    recheck_s, misses = defaults["recheck_s"].default, defaults["misses_to_offline"].default
    assert recheck_s * (misses + 1) < 10  # the last answered query, then `misses` unanswered windows
    dev = testbed.device(D2)
    with DeviceDiscovery(interfaces=[testbed.bridge], recheck_s=recheck_s / 2, misses_to_offline=misses) as disc, \
            _Registration(dev.namespace, dev.address, "_workstation._tcp.local.", "mute-box", host="mute",
                          port=9) as reg:
        assert disc.wait_for(lambda ds: "mute" in _by_id(ds) and _by_id(ds)["mute"].online, 5)
        reg.proc.send_signal(signal.SIGSTOP)  # silent, as a host that lost power: no goodbye
        try:
            t0 = time.monotonic()
            assert disc.wait_for(lambda ds: not _by_id(ds)["mute"].online, 10)
            gone_after_s = time.monotonic() - t0
        finally:
            reg.proc.send_signal(signal.SIGCONT)
        print(f"offline {gone_after_s:.1f} s after it went silent")
        assert gone_after_s < 10 / 2  # the bound, on the test's clock of half the default
        assert disc.wait_for(lambda ds: _by_id(ds)["mute"].online, 10)
