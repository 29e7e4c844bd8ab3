"""What the planner knows of the devices and the links between them.

A ``Device`` here is the planning view (identity, where to reach it, memory budget);
discovery and deployment keep their own live records and produce these.
Links are directed: bandwidth from A to B may differ from B to A.
"""

from __future__ import annotations

from typing import NewType

import msgspec

DeviceId = NewType("DeviceId", str)


class Device(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    id: str
    """Stable identifier, unique in a cluster (e.g. hostname)."""
    memory_bytes: int
    """Memory budget the planner may fill: available RAM/accelerator memory minus headroom."""
    name: str = ""
    address: str = ""
    ssh_port: int = 22
    ssh_user: str = ""
    arch: str = ""
    cores: int = 0
    accelerator: str = ""
    """Empty for CPU-only devices, else e.g. "cuda:NVIDIA RTX 3090"."""


class Link(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    src: str
    dst: str
    bandwidth_mbit_s: float
    """Usable bandwidth from src to dst in megabits (1e6 bits) per second."""
    latency_ms: float = 0.0
    """One-way latency from src to dst in milliseconds (half the measured round trip)."""

    def transfer_s(self, nbytes: float) -> float:
        """Time to move ``nbytes`` over this link: size / bandwidth + latency."""
        return nbytes * 8.0 / (self.bandwidth_mbit_s * 1e6) + self.latency_ms / 1e3


class Cluster(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    devices: tuple[Device, ...]
    links: tuple[Link, ...] = ()

    def device(self, device_id: str) -> Device:
        for d in self.devices:
            if d.id == device_id:
                return d
        raise KeyError(device_id)

    def device_ids(self) -> tuple[str, ...]:
        return tuple(d.id for d in self.devices)

    def link_index(self) -> dict[tuple[str, str], Link]:
        """Directed links by (src, dst); build once per computation, not per lookup."""
        return {(l.src, l.dst): l for l in self.links}
