"""The device registry merges what every source reports about a device, without Qt."""

from __future__ import annotations

from core.devices.deployments import Deployment
from core.devices.discovery import AgentAnnouncement, DiscoveredDevice
from core.devices.registry import DeviceRecord, DeviceRegistry, record_from_deployment, record_from_discovered
from core.planning.scenarios import random_problem


def announced(dev_id: str, *, online: bool = True, manual: bool = False, agent: bool = True) -> DiscoveredDevice:
    return DiscoveredDevice(
        id=dev_id, addresses=("10.0.0.7",), ssh_port=2222, online=online, manual=manual, problems=("slow mDNS",),
        agent=AgentAnnouncement(agent_version="0.1", protocol_version=1, arch="aarch64", cores=6,
                                memory_bytes=8 * 2**30, accelerator="cuda:Orin", control_port=7000) if agent else None,
    )


def test_a_discovered_device_becomes_a_record_with_its_status_and_figures():
    rec = record_from_discovered(announced("jetson"))
    assert (rec.status, rec.address, rec.ssh_port, rec.cores, rec.origin, rec.detail) == (
        "running", "10.0.0.7", 2222, 6, "mDNS", "slow mDNS")
    assert record_from_discovered(announced("jetson", online=False)).status == "offline"
    assert record_from_discovered(announced("pi", manual=True, agent=False)).status == "hand-added"
    assert record_from_discovered(announced("pi", agent=False)).status == "discovered"


def test_an_update_keeps_the_figures_it_does_not_know_and_the_telling_origin():
    reg = DeviceRegistry()
    reg.upsert(DeviceRecord(id="pi", address="10.0.0.9", ssh_user="edge", cores=4, memory_bytes=2**30,
                            origin="hand-added"))
    merged = reg.upsert(DeviceRecord(id="pi", status="running", origin="mDNS"))
    assert (merged.address, merged.ssh_user, merged.cores, merged.memory_bytes) == ("10.0.0.9", "edge", 4, 2**30)
    assert merged.status == "running" and merged.origin == "hand-added"


def test_a_status_change_for_an_unknown_device_is_ignored():
    reg = DeviceRegistry()
    assert reg.set_status("ghost", "error", "gone") is None
    assert reg.records == {}
    reg.upsert(DeviceRecord(id="pi"))
    assert reg.set_status("pi", "error", "ssh refused").detail == "ssh refused"


def test_the_registry_is_the_planners_cluster_before_any_profile():
    reg = DeviceRegistry()
    assert reg.cluster() is None
    reg.upsert(DeviceRecord(id="b", memory_bytes=3))
    reg.upsert(DeviceRecord(id="a", memory_bytes=5))
    cluster = reg.cluster()
    assert cluster.device_ids() == ("a", "b") and cluster.links == ()


def test_a_profile_marks_the_devices_it_measured_as_profiled():
    profile = random_problem(seed=3, devices=3).profile
    measured = [d.id for d in profile.cluster.devices]
    reg = DeviceRegistry()
    reg.upsert(DeviceRecord(id=measured[0], status="running"))
    reg.upsert(DeviceRecord(id="elsewhere", status="running"))
    done = reg.mark_profiled(profile)
    assert [r.id for r in done] == [measured[0]]
    assert reg.records[measured[0]].status == "profiled"
    assert reg.records[measured[0]].memory_bytes == profile.cluster.devices[0].memory_bytes
    assert reg.records["elsewhere"].status == "running"


def test_an_agent_deployed_earlier_is_known_from_its_deployment():
    rec = record_from_deployment("pi", Deployment(device="pi", address="10.0.0.9", ssh_port=2222, ssh_user="edge",
                                                  remote_dir="/home/edge/edgeshard", pid=4242, log_path="/tmp/a.log"))
    assert (rec.status, rec.origin, rec.address, rec.ssh_port) == ("agent deployed", "deployed earlier", "10.0.0.9", 2222)
    assert "4242" in rec.detail and "/tmp/a.log" in rec.detail


def test_offline_lists_only_the_devices_marked_offline():
    from core.devices.registry import DeviceRecord, DeviceRegistry

    reg = DeviceRegistry()
    for d in ("b", "a", "c"):
        reg.upsert(DeviceRecord(id=d, status="running"))
    reg.set_status("c", "offline", "stopped answering heartbeats")
    reg.set_status("a", "offline")
    assert reg.offline() == ("a", "c")


def test_a_local_agent_s_address_is_its_control_endpoint_and_pid_not_an_ssh_port():
    from core.devices.registry import address_text

    local = DeviceRecord(id="edge-a", address="127.0.0.1", ssh=False, control_address="127.0.0.1:5601", pid=4242)
    assert address_text(local) == "127.0.0.1:5601 (local, pid 4242)"
    assert address_text(DeviceRecord(id="edge-a", address="127.0.0.1", ssh=False)) == "127.0.0.1 (local)"
    assert address_text(DeviceRecord(id="pi", address="10.0.0.9", ssh_port=2222)) == "10.0.0.9:2222"
    reg = DeviceRegistry()
    reg.upsert(local)
    seen_again = reg.upsert(DeviceRecord(id="edge-a", address="127.0.0.1", status="running"))  # e.g. by mDNS
    assert address_text(seen_again) == "127.0.0.1:5601 (local, pid 4242)"
