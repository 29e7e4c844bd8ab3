"""The model as a sequence of units, the granularity at which it is planned.

Unit 0 is the embedding, units 1..L the decoder blocks, unit L+1 the final norm and
LM head (whose output, after sampling on its stage, is the token id sent back to the
source). The table is derived from an HF ``config.json`` without loading weights, so a
70B model can be planned on a laptop. ``kind`` is open-ended on purpose: later unit
kinds (attention-only, MLP-only, one MoE expert, a CNN tile) become new values, not a
new table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import msgspec

from core.errors import FormatError, UnsupportedModelError

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
    linear_params: int = 0
    """Of them, the weights of its ``nn.Linear`` layers, which weight-only int8/int4 stores instead
    (a dense decoder block's attention and MLP projections; 0 where a stage keeps every weight at
    its dtype: embeddings, the head, GPT-2's Conv1D, Mixtral's experts; and in tables saved before)."""
    linear_rows: int = 0
    """Their output rows (int8 keeps a scale and a zero point per row)."""


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


# --- building the table from an HF config.json --------------------------------------

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "gpt2", "mixtral")

ACTIVATION_BYTES: dict[str, float] = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 2.0, "int4": 2.0}
"""Bytes per activation / KV element. int8 and int4 are weight-only quantization (as in
GPTQ, AWQ, llama.cpp): activations and the KV cache stay in 16-bit."""

TOKEN_ID_BYTES = 8
"""The head's output after sampling: one token id per sequence, int64 as the agents send it
(agents/protocol data frames; the Cluster screen measured 8 B per token where 4 were predicted)."""

LOGIT_BYTES = 4
"""Logits are computed in fp32 before sampling (the head's workspace)."""


def _need(cfg: dict, *keys: str, family: str) -> int:
    """The first present key among ``keys`` (aliases), or a clear error naming it."""
    for k in keys:
        v = cfg.get(k)
        if v is not None:
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise UnsupportedModelError(f"{family} config: {k!r} must be a positive integer, got {v!r}")
            return v
    raise UnsupportedModelError(f"{family} config is missing {keys[0]!r}, needed to size the model")


def model_spec_from_config(config: dict, dtype: str = "fp16", name: str = "") -> ModelSpec:
    """The unit table of an HF causal LM from its ``config.json`` contents alone.

    Parameter counts follow the modules the HF implementation creates (biases where
    the family has them, tied heads counted once but stored on the head's stage too).
    Mixtral counts every expert toward memory; FLOPs count the routed ``top-k`` only.
    Raises ``UnsupportedModelError`` for an unknown family or a missing key.
    """
    if dtype not in DTYPE_BYTES:
        raise UnsupportedModelError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
    if not isinstance(config, dict):
        raise UnsupportedModelError("config must be a JSON object")
    family = config.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        what = f"model_type {family!r}" if family else "no 'model_type' key"
        raise UnsupportedModelError(
            f"unsupported model family ({what}); supported: {', '.join(SUPPORTED_FAMILIES)}"
        )
    wb = DTYPE_BYTES[dtype]
    ab = ACTIVATION_BYTES[dtype]
    if family == "gpt2":
        sizes = _gpt2_sizes(config)
    else:
        sizes = _llama_like_sizes(config, family)
    h, n_layers, vocab = sizes["hidden"], sizes["layers"], sizes["vocab"]

    def unit(index, kind, uname, params, stored, flops, kv, workspace_elems, act_bytes=None, linear=(0, 0)):
        return ModelUnit(
            linear_params=linear[0], linear_rows=linear[1],
            index=index, kind=kind, name=uname,
            param_bytes=int(round(stored * wb)),
            activation_bytes_per_token=int(act_bytes if act_bytes is not None else h * ab),
            kv_bytes_per_token=int(round(kv * ab)),
            workspace_bytes_per_token=int(round(workspace_elems)),
            flops_per_token=float(flops), params=int(params),
        )

    units = [unit(0, "embedding", "embed", sizes["embed"], sizes["embed"], 0.0, 0, h * ab)]
    for i in range(n_layers):
        units.append(
            unit(i + 1, "decoder_block", f"block {i}", sizes["block"], sizes["block"],
                 2.0 * sizes["block_active_matmul"], sizes["kv_elems"], sizes["block_workspace"] * ab,
                 linear=sizes.get("linear", (0, 0)))
        )
    units.append(
        unit(n_layers + 1, "head", "head", sizes["head"], sizes["head_stored"], 2.0 * vocab * h, 0,
             vocab * LOGIT_BYTES, act_bytes=TOKEN_ID_BYTES)
    )
    return ModelSpec(
        name=name or str(config.get("_name_or_path") or family), family=family, dtype=dtype,  # type: ignore[arg-type]
        units=tuple(units), hidden_size=h, num_layers=n_layers, vocab_size=vocab,
    )


def _llama_like_sizes(cfg: dict, family: str) -> dict[str, int]:
    h = _need(cfg, "hidden_size", family=family)
    n_layers = _need(cfg, "num_hidden_layers", family=family)
    heads = _need(cfg, "num_attention_heads", family=family)
    kv_heads = cfg.get("num_key_value_heads") or heads
    inter = _need(cfg, "intermediate_size", family=family)
    vocab = _need(cfg, "vocab_size", family=family)
    head_dim = cfg.get("head_dim") or h // heads
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    attn = h * q_out + 2 * h * kv_out + q_out * h
    # Qwen2 always has q/k/v biases; Llama/Mistral only with attention_bias.
    if family == "qwen2" or cfg.get("attention_bias"):
        attn += q_out + 2 * kv_out
    if cfg.get("attention_bias") and family != "qwen2":
        attn += h  # o_proj bias
    mlp_one = 3 * h * inter + (2 * inter + h if cfg.get("mlp_bias") else 0)
    if family == "mixtral":
        experts = _need(cfg, "num_local_experts", family=family)
        top_k = _need(cfg, "num_experts_per_tok", family=family)
        mlp, mlp_active = h * experts + experts * mlp_one, h * experts + top_k * mlp_one
    else:
        mlp = mlp_active = mlp_one
    block = attn + mlp + 2 * h  # two RMSNorm weights
    embed = vocab * h
    tied = bool(cfg.get("tie_word_embeddings", False))
    # q, k, v, o and gate, up, down: (weights, output rows); Mixtral's experts are not Linears
    linear = (0, 0) if family == "mixtral" else \
        (2 * h * q_out + 2 * h * kv_out + 3 * h * inter, q_out + 2 * kv_out + h + 2 * inter + h)
    return {
        "linear": linear,
        "hidden": h, "layers": n_layers, "vocab": vocab, "embed": embed,
        "block": block, "block_active_matmul": attn + mlp_active,
        "kv_elems": 2 * kv_out,
        # largest live intermediate per token: gate and up projections together, or q,k,v.
        "block_workspace": max(2 * inter, q_out + 2 * kv_out),
        "head": h + (0 if tied else embed), "head_stored": h + embed,
    }


def _gpt2_sizes(cfg: dict) -> dict[str, int]:
    f = "gpt2"
    h = _need(cfg, "n_embd", "hidden_size", family=f)
    n_layers = _need(cfg, "n_layer", "num_hidden_layers", family=f)
    _need(cfg, "n_head", "num_attention_heads", family=f)
    vocab = _need(cfg, "vocab_size", family=f)
    positions = _need(cfg, "n_positions", "max_position_embeddings", family=f)
    inner = cfg.get("n_inner") or 4 * h
    attn = h * 3 * h + 3 * h + h * h + h
    mlp = h * inner + inner + inner * h + h
    block = attn + mlp + 4 * h  # two LayerNorms (weight + bias)
    embed = vocab * h + positions * h
    return {
        "hidden": h, "layers": n_layers, "vocab": vocab, "embed": embed,
        "block": block, "block_active_matmul": h * 3 * h + h * h + 2 * h * inner,
        "kv_elems": 2 * h, "block_workspace": max(inner, 3 * h),
        # GPT-2 ties the head to wte: counted once, but the head's stage holds a copy.
        "head": 2 * h, "head_stored": 2 * h + vocab * h,
    }


def load_model_spec(path: str | Path, dtype: str = "fp16", name: str = "") -> ModelSpec:
    """The unit table from a ``config.json`` file or a directory holding one."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        config = json.loads(p.read_text())
    except OSError as err:
        raise FormatError(str(p), f"cannot read file ({err.strerror or err})") from None
    except ValueError as err:
        raise FormatError(str(p), f"not valid JSON ({err})") from None
    return model_spec_from_config(config, dtype, name or p.parent.name)


SHIPPED_MODELS_DIR = Path(__file__).resolve().parents[2] / "resources" / "models"


def shipped_model_names() -> tuple[str, ...]:
    """Names of the configs shipped in resources/models (e.g. "llama-2-70b")."""
    return tuple(sorted(p.parent.name for p in SHIPPED_MODELS_DIR.glob("*/config.json")))


def shipped_model(name: str, dtype: str = "fp16") -> ModelSpec:
    """The unit table of a shipped config, e.g. ``shipped_model("llama-2-7b")``."""
    path = SHIPPED_MODELS_DIR / name / "config.json"
    if not path.exists():
        raise UnsupportedModelError(f"no shipped model {name!r}; shipped: {', '.join(shipped_model_names())}")
    return load_model_spec(path, dtype, name)
