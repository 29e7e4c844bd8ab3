"""Attention offloading's problem and plan: devices with a price, the model's attention geometry.

Plain msgspec structs (a problem file is JSON); ``check_problem``/``check_plan`` name what is
wrong in operator terms (``PlanInvalid``) instead of letting a cost formula divide by zero.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from core.errors import PlanInvalid

Schedule = Literal["fixed", "rotational"]


def _invalid(violation: str) -> PlanInvalid:
    return PlanInvalid([violation])


class OffloadDevice(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    id: str
    flops: float
    """Sustained dense FLOP/s at the model's dtype."""
    memory_bandwidth: float
    """Bytes/s read from its memory (what attention in decode is bound by)."""
    memory_bytes: int
    link_bandwidth: float
    """Bytes/s of its network link."""
    link_latency_s: float = 0.0
    frame_s: float = 0.0
    """CPU seconds one data frame costs this device to send or to receive (header, encryption, the
    socket calls, the receive loop): per layer a compute device sends and receives one frame per
    memory device, a memory device one each way. Profiled on the agents (bench/attention_offload.py);
    0 for datasheet scenarios, where it vanishes beside the tensors."""
    step_overhead_s: float = 0.0
    """Per decode step of a batch on a compute device, beyond its layers and LM head: sampling and
    the step's turn-around in the agent (profiled, like layer sharding's ``stage_decode_overhead_s``;
    0 for datasheet scenarios)."""
    price: float = 0.0
    """Purchase price (USD, scenario defaults from public list prices): throughput per dollar."""


class OffloadModel(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    bytes_per_element: int = 2

    @property
    def dense_params_per_layer(self) -> int:
        """q, k, v, o projections and a gated MLP (llama/qwen2/mistral shape)."""
        attn = self.hidden * (self.q_heads + 2 * self.kv_heads) * self.head_dim + self.q_heads * self.head_dim * self.hidden
        return attn + 3 * self.hidden * self.intermediate

    @property
    def weight_bytes(self) -> int:
        return (self.layers * self.dense_params_per_layer + 2 * self.vocab * self.hidden) * self.bytes_per_element

    def kv_bytes_per_token(self) -> int:
        """K and V of one token over every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_element

    def prefill_attend_bytes(self, batch: int, prompt: int, kv_heads: int) -> int:
        """Transient bytes a memory side holding ``kv_heads`` needs for one layer's prefill attend of
        ``batch`` × ``prompt`` tokens, beside its KV cache: what is live at once inside SDPA. The
        frames as received (query, key, value as float, the mask one byte per context position; the
        tensors view them), the mask as bool (kept for the batch's later steps), key and value
        repeated to the query heads (no score matrix: CPU SDPA's flash kernel streams it) and the
        output. Measured 16.5 MiB of VmHWM over the KV share for batch 8 × 400 on one of two memory
        agents, this term 16.5 (bench/memory_fidelity.py; agents return freed blocks to the OS,
        agents.heap: before, the heap kept the receive path's copies and the peak was 44 MiB)."""
        q_heads = kv_heads * (self.q_heads // self.kv_heads)
        tokens, e = batch * prompt, self.bytes_per_element
        received = (q_heads + 2 * kv_heads) * self.head_dim * e + prompt
        mask = prompt
        repeated = 2 * q_heads * self.head_dim * e
        output = q_heads * self.head_dim * e
        return tokens * (received + mask + repeated + output)

    def wire_bytes_per_token_layer(self) -> int:
        """q and the attention output (h_q each), the new k and v (h_kv each): Lamina's traffic."""
        return (2 * self.q_heads + 2 * self.kv_heads) * self.head_dim * self.bytes_per_element


class OffloadWorkload(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    prompt_tokens: int
    generated_tokens: int
    max_batch: int = 512

    @property
    def context_tokens(self) -> int:
        """The longest context a sequence reaches (what the KV cache must hold)."""
        return self.prompt_tokens + self.generated_tokens

    @property
    def mean_context_tokens(self) -> float:
        """The mean context over decode (what attention reads per step on average)."""
        return self.prompt_tokens + self.generated_tokens / 2


class OffloadProblem(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    format: Literal["edgeshard.attention-offload-problem"] = "edgeshard.attention-offload-problem"
    version: int = 1
    name: str = ""
    devices: tuple[OffloadDevice, ...]
    model: OffloadModel
    workload: OffloadWorkload

    def device(self, device_id: str) -> OffloadDevice:
        for d in self.devices:
            if d.id == device_id:
                return d
        raise _invalid(f"device {device_id!r} is not in the problem (it has {', '.join(d.id for d in self.devices)})")


class OffloadPlan(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Compute devices each hold a replica of the dense part; memory devices split the KV heads."""

    format: Literal["edgeshard.attention-offload-plan"] = "edgeshard.attention-offload-plan"
    version: int = 1
    compute: tuple[str, ...]
    memory: tuple[str, ...]
    batch: int
    in_flight: int
    """n: batches in flight, sharing the memory devices."""
    schedule: Schedule = "rotational"

    def kv_heads_of(self, kv_heads: int) -> dict[str, range]:
        """Which key/value heads each memory device holds (balanced by heads, as agents split them)."""
        base, extra = divmod(kv_heads, len(self.memory))
        out, start = {}, 0
        for i, device in enumerate(self.memory):
            end = start + base + (1 if i < extra else 0)
            out[device] = range(start, end)
            start = end
        return out


def check_problem(problem: OffloadProblem) -> None:
    m = problem.model
    if min(m.layers, m.hidden, m.q_heads, m.kv_heads, m.head_dim, m.intermediate, m.vocab, m.bytes_per_element) < 1:
        raise _invalid(f"model {m.name!r}: every size must be >= 1")
    if m.q_heads % m.kv_heads:
        raise _invalid(f"model {m.name!r}: {m.q_heads} query heads are not a multiple of {m.kv_heads} key/value heads")
    if not problem.devices:
        raise _invalid("the problem has no devices")
    for d in problem.devices:
        values = (d.flops, d.memory_bandwidth, d.link_bandwidth)
        if not all(math.isfinite(v) and v > 0 for v in values) or d.memory_bytes < 1 \
                or not all(math.isfinite(v) and v >= 0 for v in (d.price, d.link_latency_s, d.frame_s, d.step_overhead_s)):
            raise _invalid(f"device {d.id!r}: FLOP/s, bandwidths and memory must be > 0, price, latency and "
                           "frame cost >= 0")
    w = problem.workload
    if w.prompt_tokens < 1 or w.generated_tokens < 1 or w.max_batch < 1:
        raise _invalid("workload: prompt and generated tokens and max batch must be >= 1")


def check_plan(problem: OffloadProblem, plan: OffloadPlan) -> None:
    """Every device known and used once; n >= 1; no more memory devices than key/value heads."""
    used = list(plan.compute) + list(plan.memory)
    for device in used:
        problem.device(device)
    if len(set(used)) != len(used):
        raise _invalid("a device appears twice in the plan (a device is either compute or memory, once)")
    if not plan.compute or not plan.memory:
        raise _invalid("a plan needs at least one compute device and one memory device")
    if len(plan.memory) > problem.model.kv_heads:
        raise _invalid(f"{len(plan.memory)} memory devices for {problem.model.kv_heads} key/value heads: "
                          f"use at most {problem.model.kv_heads}")
    if plan.batch < 1 or plan.in_flight < 1:
        raise _invalid("batch and batches in flight must be >= 1")
