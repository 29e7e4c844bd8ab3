"""What EdgeMoE plans for: one device's memory budget and storage bandwidth, a MoE model's sizes
and times, and the bit-width options the adaptation step measured (or a scenario assumed)."""

from __future__ import annotations

from typing import Literal

import msgspec

from core.errors import FormatError

POLICIES = ("edgemoe", "lru", "lfu")


class MoeModel(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    layers: int
    """MoE blocks."""
    experts: int
    """Experts per block."""
    top_k: int
    expert_bytes: int
    """One expert at full precision (fp32)."""
    resident_bytes: int
    """Everything but the experts (embedding, attention, norms, routers, head)."""
    layer_compute_s: float
    """Per token, one block without its experts."""
    expert_compute_s: float
    """Per token, one expert."""
    head_s: float = 0.0
    decode_batch_sizes: tuple[int, ...] = ()
    """Measured batch sizes of the curves below (empty: a scenario's model; the per-token times above
    are then scaled by the tokens a step carries)."""
    block_decode_s: tuple[float, ...] = ()
    """Per batch size, one decode step of one MoE block with its picked experts (profiled resident: the
    reads are priced apart), averaged over the blocks."""
    head_decode_s: tuple[float, ...] = ()
    """Per batch size, a decode step's work outside the blocks (embedding, head, the stage's overhead)."""
    prefill_token_counts: tuple[int, ...] = ()
    block_prefill_s: tuple[float, ...] = ()
    """Per prompt-token count (batch × prompt length), one block's prefill with its picked experts."""
    head_prefill_s: tuple[float, ...] = ()


class BitOption(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One expert-precision choice: average bits per expert weight and the accuracy it loses."""

    name: str
    avg_bits: float
    accuracy_loss: float
    """Relative (0.03 = 3 % perplexity increase over fp32)."""


FULL_PRECISION = BitOption(name="fp32", avg_bits=32.0, accuracy_loss=0.0)


class OffloadProblem(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    format: Literal["edgeshard.expert-offload-problem"] = "edgeshard.expert-offload-problem"
    version: int = 1
    model: MoeModel
    device: str = "device"
    memory_budget_bytes: int
    bandwidth_bps: float
    """Storage read bandwidth (bytes/s): the per-byte part of one expert's read."""
    read_fixed_s: float = 0.0
    """Seconds every expert read costs whatever its size (opening the file, its header, the slice):
    with experts of ~100 KiB it is most of a read (``storage_bandwidth`` measures both parts)."""
    prompt_tokens: int = 8
    """Prompt length a predicted run's prefill routes (the router's picks of every prompt token are read)."""
    accuracy_bound: float = 0.05
    predictor_recall: float = 0.0
    """Top-k recall of the activation predictor (its profile reports it)."""
    bit_options: tuple[BitOption, ...] = (FULL_PRECISION,)
    generated_tokens: int = 32

    def __post_init__(self) -> None:
        m = self.model
        where = "expert-offload problem"
        if min(m.layers, m.experts, m.top_k) < 1 or m.top_k > m.experts:
            raise FormatError(where, f"model needs layers, experts >= 1 and 1 <= top_k <= experts "
                                     f"(got {m.layers}, {m.experts}, {m.top_k})")
        if m.expert_bytes <= 0 or m.resident_bytes < 0:
            raise FormatError(where, "expert_bytes must be > 0 and resident_bytes >= 0")
        if not self.read_fixed_s >= 0 or self.prompt_tokens < 1:
            raise FormatError(where, f"read_fixed_s must be >= 0 s and prompt_tokens >= 1 (got {self.read_fixed_s}, "
                                     f"{self.prompt_tokens})")
        curves = ((m.decode_batch_sizes, m.block_decode_s, m.head_decode_s),
                  (m.prefill_token_counts, m.block_prefill_s, m.head_prefill_s))
        if any(len(xs) != len(a) or len(xs) != len(b) or any(x < 1 for x in xs) or list(xs) != sorted(set(xs))
               for xs, a, b in curves):
            raise FormatError(where, "the model's measured curves need one time per (ascending, >= 1) batch size "
                                     "or token count")
        if not self.bandwidth_bps > 0:
            raise FormatError(where, f"storage bandwidth must be > 0 bytes/s (got {self.bandwidth_bps})")
        if not 0.0 <= self.predictor_recall <= 1.0:
            raise FormatError(where, f"predictor recall must be in [0, 1] (got {self.predictor_recall})")
        if self.memory_budget_bytes <= 0:
            raise FormatError(where, "memory budget must be > 0 bytes")
        if any(not 1 <= b.avg_bits <= 32 for b in self.bit_options):
            raise FormatError(where, "bit options need 1 <= avg_bits <= 32")


class OffloadPlan(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    format: Literal["edgeshard.expert-offload-plan"] = "edgeshard.expert-offload-plan"
    version: int = 1
    device: str
    slots: int
    """Experts the buffer holds."""
    bits: BitOption = FULL_PRECISION
    policy: str = "edgemoe"
    preload: int = 0
    """Experts preloaded per layer (0: on demand only)."""
    whole_layers: bool = False
    """STI-like: load every expert of the next layer, pipelined with compute (no expert awareness)."""

    def __post_init__(self) -> None:
        # refused where the plan is read (moe configure), not when an agent loads it
        where = "expert-offload plan"
        if not self.device:
            raise FormatError(where, "names no device", "device")
        if self.slots < 1:
            raise FormatError(where, f"the expert buffer needs at least 1 slot, got {self.slots}", "slots")
        if self.preload < 0:
            raise FormatError(where, f"preload must be >= 0 experts per layer, got {self.preload}", "preload")
        if not 1 <= self.bits.avg_bits <= 32:
            raise FormatError(where, f"avg_bits must be in [1, 32], got {self.bits.avg_bits}", "bits.avg_bits")
