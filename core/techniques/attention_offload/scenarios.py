"""Two scenarios with public figures: the paper's datacenter pairing and an edge lab.

Prices are approximate public list prices (USD, 2024) and speeds are datasheet peaks
derated to sustained (×0.6 FLOP/s, ×0.8 bandwidth); they set ratios, not absolute claims.
"""

from __future__ import annotations

from core.techniques.attention_offload.problem import OffloadDevice, OffloadModel, OffloadProblem, OffloadWorkload

GB = 10**9
GIB = 2**30

LLAMA3_70B = OffloadModel(name="llama-3-70b", layers=80, hidden=8192, q_heads=64, kv_heads=8, head_dim=128,
                          intermediate=28672, vocab=128256, bytes_per_element=2)
LLAMA3_8B = OffloadModel(name="llama-3-8b", layers=32, hidden=4096, q_heads=32, kv_heads=8, head_dim=128,
                         intermediate=14336, vocab=128256, bytes_per_element=2)


def _h100_pair(i: int) -> OffloadDevice:
    """A node of 2 H100 SXM (the 70B model's weights need both): 2×989 TFLOP/s bf16, 2×3.35 TB/s, 2×80 GB."""
    return OffloadDevice(id=f"h100x2-{i}", flops=2 * 989e12 * 0.6, memory_bandwidth=2 * 3.35e12 * 0.8,
                         memory_bytes=160 * GB, link_bandwidth=50 * GB, link_latency_s=5e-6, price=2 * 30_000)


def _h20(i: int) -> OffloadDevice:
    """H20: 148 TFLOP/s bf16, 4.0 TB/s, 96 GB: the paper's memory-optimised device."""
    return OffloadDevice(id=f"h20-{i}", flops=148e12 * 0.6, memory_bandwidth=4.0e12 * 0.8, memory_bytes=96 * GB,
                         link_bandwidth=50 * GB, link_latency_s=5e-6, price=13_000)


def paper(accelerators: int = 2, memory_devices: int = 4) -> OffloadProblem:
    """Lamina's pairing: H100 nodes for the dense part, H20s for attention; LLaMA-3-70B, long contexts."""
    return OffloadProblem(name="paper (H100 + H20, LLaMA-3-70B)",
                          devices=tuple(_h100_pair(i) for i in range(accelerators))
                          + tuple(_h20(i) for i in range(memory_devices)),
                          model=LLAMA3_70B, workload=OffloadWorkload(prompt_tokens=2048, generated_tokens=512,
                                                                     max_batch=1024))


def _orin(i: int) -> OffloadDevice:
    """Jetson AGX Orin 64 GB: ~42 TFLOP/s fp16 dense (GPU), 204.8 GB/s, $1999; 10 GbE."""
    return OffloadDevice(id=f"orin-{i}", flops=42e12 * 0.6, memory_bandwidth=204.8 * GB * 0.8, memory_bytes=64 * GB,
                         link_bandwidth=1.25 * GB, link_latency_s=50e-6, price=1999)


def _mini_pc(i: int) -> OffloadDevice:
    """A mini-PC with 64 GB dual-channel DDR5-5600 (89.6 GB/s), ~1 TFLOP/s CPU, $700; 2.5 GbE."""
    return OffloadDevice(id=f"minipc-{i}", flops=1e12 * 0.6, memory_bandwidth=89.6 * GB * 0.8, memory_bytes=64 * GB,
                         link_bandwidth=0.3125 * GB, link_latency_s=100e-6, price=700)


def edge(accelerators: int = 1, mini_pcs: int = 4) -> OffloadProblem:
    """An Orin-class accelerator and memory-rich mini-PCs; LLaMA-3-8B, 8k-token contexts."""
    return OffloadProblem(name="edge (Orin + mini-PCs, LLaMA-3-8B)",
                          devices=tuple(_orin(i) for i in range(accelerators))
                          + tuple(_mini_pc(i) for i in range(mini_pcs)),
                          model=LLAMA3_8B, workload=OffloadWorkload(prompt_tokens=8192, generated_tokens=512,
                                                                    max_batch=256))


SCENARIOS = {"paper": paper, "edge": edge}
