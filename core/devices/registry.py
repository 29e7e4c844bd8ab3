"""The devices the operator knows, merged from every source that reports one: mDNS
discovery, the operator (hand-added), a local cluster, deploy results, remembered
deployments, a profile. The Devices screen is a view of a ``DeviceRegistry``; the merge
rules live here so a CLI or a test gets the same answer without Qt."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from core.devices.cluster import Cluster, Device

if TYPE_CHECKING:  # zeroconf is slow to import; the Devices screen loads it when discovery starts
    from core.devices.deployments import Deployment
    from core.devices.discovery import DiscoveredDevice
    from core.devices.profile import Profile

STATUSES = ("discovered", "hand-added", "agent deployed", "running", "profiled", "offline", "error")


@dataclass(frozen=True)
class DeviceRecord:
    id: str
    address: str = ""
    ssh_port: int = 22
    ssh_user: str = ""
    status: str = "discovered"
    arch: str = ""
    cores: int = 0
    memory_bytes: int = 0
    accelerator: str = ""
    origin: str = "mDNS"
    """Where the studio learned of it: mDNS, hand-added, local cluster."""
    detail: str = ""
    """The last error or note, in plain words."""
    ssh: bool = True
    """Whether the device is reached over SSH (deploy, logs) at ``ssh_port``; False for a local
    agent (a process on this machine, started by a local cluster or the demo: no SSH)."""
    control_address: str = ""
    """The agent's control endpoint (``host:port``) once the studio is connected to it."""
    pid: int = 0
    """The agent's process id, as it reported it."""
    emulated_budget_bytes: int = 0
    """The memory budget the agent emulates and enforces (a demo or ``cluster local`` agent
    started with one); 0: none, the device's real memory applies."""

    def to_device(self) -> Device:
        return Device(id=self.id, name=self.id, memory_bytes=self.emulated_budget_bytes or self.memory_bytes,
                      address=self.address,
                      ssh_port=self.ssh_port, ssh_user=self.ssh_user, arch=self.arch, cores=self.cores,
                      accelerator=self.accelerator)


def address_text(record: DeviceRecord) -> str:
    """What the Devices screen's Address column shows: how the studio reaches the device. A
    device reached over SSH: ``address:ssh_port``; a local agent (no SSH): its control endpoint
    and that it is local, with its pid (``127.0.0.1:5601 (local, pid 4242)``)."""
    if record.ssh:
        return f"{record.address}:{record.ssh_port}" if record.address else "—"
    endpoint = record.control_address or record.address
    local = "local" + (f", pid {record.pid}" if record.pid else "")
    return f"{endpoint} ({local})" if endpoint else local


def record_from_discovered(dev: DiscoveredDevice) -> DeviceRecord:
    """A discovered (or hand-added through discovery) device as a record."""
    a = dev.agent
    status = "offline" if not dev.online else "running" if a is not None else "hand-added" if dev.manual else "discovered"
    return DeviceRecord(
        id=dev.id, address=dev.address, ssh_port=dev.ssh_port or 22, ssh_user=dev.ssh_user, status=status,
        arch=a.arch if a else "", cores=a.cores if a else 0, memory_bytes=a.memory_bytes if a else 0,
        accelerator=a.accelerator if a else "", origin="hand-added" if dev.manual else "mDNS",
        detail="; ".join(dev.problems),
    )


def record_from_deployment(device: str, dep: Deployment) -> DeviceRecord:
    """An agent deployed in an earlier session, known only from the workspace's deployments."""
    return DeviceRecord(id=device, address=dep.address, ssh_port=dep.ssh_port, ssh_user=dep.ssh_user,
                        status="agent deployed", origin="deployed earlier",
                        detail=f"agent pid {dep.pid}, log {dep.log_path}")


def merge_record(old: DeviceRecord | None, new: DeviceRecord) -> DeviceRecord:
    """``new``, keeping the figures it does not know from ``old``; a more telling origin than
    mDNS (hand-added, local cluster, ...) is kept over a later mDNS sighting."""
    if old is None:
        return new
    return replace(
        new,
        address=new.address or old.address, ssh_user=new.ssh_user or old.ssh_user,
        arch=new.arch or old.arch, cores=new.cores or old.cores, memory_bytes=new.memory_bytes or old.memory_bytes,
        accelerator=new.accelerator or old.accelerator,
        origin=old.origin if old.origin != "mDNS" else new.origin,
        ssh=new.ssh and old.ssh,  # a local agent seen again by mDNS still has no SSH
        control_address=new.control_address or old.control_address, pid=new.pid or old.pid,
        emulated_budget_bytes=new.emulated_budget_bytes or old.emulated_budget_bytes,
    )


@dataclass
class DeviceRegistry:
    """The known devices by id (not thread-safe: one owner, e.g. the GUI thread)."""

    records: dict[str, DeviceRecord] = field(default_factory=dict)

    def upsert(self, record: DeviceRecord) -> DeviceRecord:
        """Add or update a device (``merge_record``); returns what is now recorded."""
        merged = merge_record(self.records.get(record.id), record)
        self.records[record.id] = merged
        return merged

    def set_status(self, device: str, status: str, detail: str = "") -> DeviceRecord | None:
        """A new status (and note) for a known device; an unknown one is left alone (None)."""
        if device not in self.records:
            return None
        return self.upsert(replace(self.records[device], status=status, detail=detail))

    def offline(self) -> tuple[str, ...]:
        """Devices known to be offline (mDNS silent, or an agent that stopped answering
        heartbeats): the status bar lists them, planning must not count on them."""
        return tuple(r.id for r in self.sorted() if r.status == "offline")

    def sorted(self) -> list[DeviceRecord]:
        return [self.records[d] for d in sorted(self.records)]

    def cluster(self) -> Cluster | None:
        """The devices as found (no links yet), for the planner's view before any profile."""
        devices = tuple(r.to_device() for r in self.sorted())
        return Cluster(devices=devices) if devices else None

    def mark_profiled(self, profile: Profile) -> list[DeviceRecord]:
        """Known devices the profile measured become "profiled" (memory from the profile when
        none was known); returns them."""
        done = []
        for d in profile.cluster.devices:
            rec = self.records.get(d.id)
            if rec is not None:
                done.append(self.upsert(replace(rec, status="profiled",
                                                memory_bytes=rec.memory_bytes or d.memory_bytes)))
        return done
