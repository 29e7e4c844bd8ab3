"""Problems to plan on: one shaped like EdgeMI's testbed, and a profiled local one."""

from __future__ import annotations

from core.techniques.spatial.problem import CnnRef, SpatialDevice, SpatialProblem, TimeModel

MBPS = 1e6 / 8


def paper_shaped(nodes: int = 4, bandwidth_mbps: float = 1000.0, *, network: str = "vgg16") -> SpatialProblem:
    """VGG16 at 224×224 on ``nodes`` Raspberry-Pi-class devices (≈2 GFLOP/s, 1 ms per layer call,
    the gateway among them) on a switched LAN of ``bandwidth_mbps`` with 0.2 ms latency.
    Assumed figures, not the paper's measurements: it reports speedups, not device constants."""
    devices = tuple(
        SpatialDevice(id=f"pi-{i}", time=TimeModel(a=1 / 2.0e9, b=1e-3), bandwidth_Bps=bandwidth_mbps * MBPS,
                      latency_s=2e-4, memory_bytes=1 << 30)
        for i in range(nodes))
    return SpatialProblem(name=f"paper-shaped-{nodes}x{bandwidth_mbps:g}mbps", model=CnnRef(network=network),
                          devices=devices, gateway="pi-0")
