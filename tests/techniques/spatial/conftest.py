from __future__ import annotations

import pytest

from core.techniques.spatial.problem import CnnRef, SpatialDevice, SpatialProblem, TimeModel


def make_problem(speeds_gflops=(4.0, 2.0, 1.0), bandwidth_mbps=100.0, *, network="vgg16", image=32,
                 width_div=8, b=1e-4) -> SpatialProblem:
    devices = tuple(SpatialDevice(id=f"d{i}", time=TimeModel(a=1 / (g * 1e9), b=b),
                                  bandwidth_Bps=bandwidth_mbps * 1e6 / 8, latency_s=1e-4)
                    for i, g in enumerate(speeds_gflops))
    return SpatialProblem(name="t", model=CnnRef(network=network, image=image, width_div=width_div, classes=10),
                          devices=devices, gateway="d0")


@pytest.fixture
def problem() -> SpatialProblem:
    return make_problem()
