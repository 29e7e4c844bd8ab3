"""A paper-shaped scenario (EdgeMoE's setting: a Mixtral-like model on a phone-class device
reading experts from flash). Its sizes and times are assumptions, not measurements."""

from __future__ import annotations

from core.techniques.expert_offload.problem import FULL_PRECISION, BitOption, MoeModel, OffloadProblem

ASSUMED_BIT_OPTIONS = (
    FULL_PRECISION,
    BitOption(name="int8", avg_bits=8.0, accuracy_loss=0.002),
    BitOption(name="int4", avg_bits=4.0, accuracy_loss=0.03),
    BitOption(name="mixed-2/4", avg_bits=3.0, accuracy_loss=0.045),
    BitOption(name="int2", avg_bits=2.0, accuracy_loss=0.30),
)
"""Illustrative only: the real ones come from bit-width adaptation (not built yet)."""


def paper_shaped(budget_fraction: float = 0.5, bandwidth_bps: float = 200e6) -> OffloadProblem:
    model = MoeModel(name="mixtral-like 8 experts, 8 blocks", layers=8, experts=8, top_k=2,
                     expert_bytes=3 * 1024 * 2816 * 4, resident_bytes=200_000_000,
                     layer_compute_s=0.004, expert_compute_s=0.003, head_s=0.01)
    full = model.resident_bytes + model.layers * model.experts * model.expert_bytes
    return OffloadProblem(model=model, device="phone", memory_budget_bytes=int(budget_fraction * full),
                          bandwidth_bps=bandwidth_bps, predictor_recall=0.6, bit_options=ASSUMED_BIT_OPTIONS)
