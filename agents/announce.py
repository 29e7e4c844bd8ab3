"""The agent's own mDNS registration: ``_edgeshard._tcp`` with TXT records that let the
studio list a device (arch, cores, memory, accelerator) and reach its control socket
before any connection is made.

The TXT keys are defined here once; core/devices/discovery.py parses and validates them.
``hostname`` matters on emulated devices: namespaces share the machine's hostname, so the
agent is given its device name and announces ``NAME.local.``, the same host the device's
``_ssh._tcp`` record points at, which lets discovery merge both into one device.
"""

from __future__ import annotations

import os
import platform
import socket

import ifaddr
from zeroconf import InterfaceChoice, IPVersion, ServiceInfo, Zeroconf

from agents import AGENT_VERSION
from agents.protocol import PROTOCOL_VERSION

SERVICE_TYPE = "_edgeshard._tcp.local."
TXT_AGENT_VERSION = "agent"
TXT_PROTOCOL_VERSION = "proto"
TXT_ARCH = "arch"
TXT_CORES = "cores"
TXT_MEMORY = "mem"
TXT_ACCELERATOR = "accel"
TXT_CONTROL_PORT = "port"
TXT_KEYS = (TXT_AGENT_VERSION, TXT_PROTOCOL_VERSION, TXT_ARCH, TXT_CORES, TXT_MEMORY,
            TXT_ACCELERATOR, TXT_CONTROL_PORT)


def total_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def _ipv4_addresses() -> list[str]:
    """Non-loopback IPv4 addresses of this machine (for an agent bound to all interfaces)."""
    out = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str) and not ip.ip.startswith("127."):
                out.append(ip.ip)
    return sorted(set(out)) or ["127.0.0.1"]


class Announcement:
    """A live registration; ``close()`` sends the mDNS goodbye and stops the responder."""

    def __init__(self, zc: Zeroconf, info: ServiceInfo):
        self._zc, self.info = zc, info

    def close(self) -> None:
        try:
            self._zc.unregister_service(self.info)
        finally:
            self._zc.close()


def announce_agent(
    address: str,
    control_port: int,
    *,
    name: str | None = None,
    accelerator: str = "",
    memory_bytes: int | None = None,
) -> Announcement:
    """Register this agent on ``address`` (the interface it serves on) and return the handle.

    Binding zeroconf to that one address keeps the announcement off other interfaces;
    ``0.0.0.0`` announces on all of them.
    """
    name = name or socket.gethostname().split(".")[0]
    props = {
        TXT_AGENT_VERSION: AGENT_VERSION,
        TXT_PROTOCOL_VERSION: str(PROTOCOL_VERSION),
        TXT_ARCH: platform.machine(),
        TXT_CORES: str(os.cpu_count() or 0),
        TXT_MEMORY: str(total_memory_bytes() if memory_bytes is None else memory_bytes),
        TXT_ACCELERATOR: accelerator,
        TXT_CONTROL_PORT: str(control_port),
    }
    if address in ("", "0.0.0.0", "*"):
        addrs = _ipv4_addresses()
        zc = Zeroconf(interfaces=InterfaceChoice.All, ip_version=IPVersion.V4Only)
    else:
        addrs = [address]
        zc = Zeroconf(interfaces=[address], ip_version=IPVersion.V4Only)
    info = ServiceInfo(
        SERVICE_TYPE,
        f"{name}.{SERVICE_TYPE}",
        addresses=[socket.inet_aton(a) for a in addrs],
        port=control_port,
        properties=props,
        server=f"{name}.local.",
    )
    try:
        zc.register_service(info, allow_name_change=True)
    except BaseException:
        zc.close()
        raise
    return Announcement(zc, info)
