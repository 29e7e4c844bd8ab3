"""The model as a sequence of units, the granularity at which it is planned.

Unit 0 is the embedding, units 1..L the decoder blocks, unit L+1 the final norm and
LM head (whose output, after sampling on its stage, is the token id sent back to the
source). The table is derived from an HF ``config.json`` without loading weights, so a
70B model can be planned on a laptop. ``kind`` is open-ended on purpose: later unit
kinds (attention-only, MLP-only, one MoE expert, a CNN tile) become new values, not a
new table.
"""

from __future__ import annotations

from typing import Literal

import msgspec

DType = Literal["fp32", "fp16", "bf16", "int8", "int4"]

DTYPE_BYTES: dict[str, float] = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5}

UnitKind = Literal["embedding", "decoder_block", "head"]


class ModelUnit(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    index: int
    kind: UnitKind
    name: str
    """Human name, e.g. "embed", "block 12", "head"."""
    param_bytes: int
    """Bytes of this unit's weights at the table's dtype."""
    activation_bytes_per_token: int
    """Bytes this unit outputs per token: the hidden state, or the token id for the head."""
    kv_bytes_per_token: int = 0
    """KV-cache bytes this unit keeps per token of context (K and V, all KV heads)."""
    workspace_bytes_per_token: int = 0
    """Peak temporary bytes per token processed at once (largest intermediate of the unit)."""
    flops_per_token: float = 0.0
    """Forward FLOPs per token (2 × multiply-adds), excluding attention over the context."""
    params: int = 0
    """Parameter count (for reporting; param_bytes is what memory uses)."""


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    family: str
    """HF model_type: llama, mistral, qwen2, gpt2, mixtral."""
    dtype: DType
    units: tuple[ModelUnit, ...]
    hidden_size: int = 0
    num_layers: int = 0
    vocab_size: int = 0

    @property
    def num_units(self) -> int:
        return len(self.units)

    @property
    def num_parameters(self) -> int:
        return sum(u.params for u in self.units)

    @property
    def param_bytes(self) -> int:
        return sum(u.param_bytes for u in self.units)
