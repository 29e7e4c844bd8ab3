"""Attention offloading's one cost model (planner, simulator and Compare use it).

Per layer and decode step of one batch of B sequences:
- dense time on a compute device: the larger of its FLOPs (2·params·B over FLOP/s) and its
  weight read (params bytes over memory bandwidth): compute-bound at large B;
- attention time on the memory devices: the KV bytes the batch reads (B·context·2·h_kv·D·bytes),
  split by heads over the memory devices (they run in parallel; the slowest share bounds);
- per-frame costs (``OffloadDevice.frame_s``, profiled on agents): a compute device sends and
  receives one frame per memory device and layer, a memory device one each way — CPU time on
  each (a remote attention call is not free even when its tensors are tiny);
- link time: B·(2·h_q + 2·h_kv)·D·bytes, plus a frame header each way per memory device
  (``FRAME_HEADER_BYTES``), over the narrower side's link, plus a latency each way.
Once per step the batch's head (final norm, LM head, sampling) runs on a compute device.
Throughput with c compute replicas, one memory pool and n batches in flight is bounded by the
compute devices, the pool, and the batches' own cycle: the smallest of the three (``decode_step_s``).
"""

from __future__ import annotations

import msgspec

from core.techniques.attention_offload.problem import (
    OffloadDevice, OffloadModel, OffloadPlan, OffloadProblem, check_plan,
)


class LayerTimes(msgspec.Struct, frozen=True, kw_only=True):
    dense_s: float
    """One batch's dense part of one layer on the slowest compute device."""
    attention_s: float
    """One batch's attention of one layer on the memory pool."""
    link_s: float
    """Both directions of one layer's traffic (bytes over bandwidth + two latencies)."""


class OffloadCost(msgspec.Struct, frozen=True, kw_only=True):
    layer: LayerTimes
    step_s: float
    """Time between tokens of one batch in steady state."""
    tokens_per_s: float
    price: float
    tokens_per_s_per_dollar: float
    compute_bytes: int
    """Per compute device: the dense weights (no KV)."""
    memory_bytes: int
    """Per memory device: its share of the KV of every batch in flight and one prefill attend's
    transient (``OffloadModel.prefill_attend_bytes``)."""
    fits: bool
    bottleneck: str
    """compute | memory | cycle (too few batches in flight)"""

    @property
    def latency_s(self) -> float:
        return self.step_s


FRAME_HEADER_BYTES = 240
"""Bytes of one ``attend``/``attended`` data frame's header (msgpack: run id, sender, tensor specs,
layer, heads; measured 224–250 on the agents). Per layer every memory device gets one frame and
answers one: on a small batch of a small model they are a third of the traffic (the 1.32× that
the tensor-only model under-predicted over agents), on the paper's model they vanish."""


def layer_wire_bytes(model: OffloadModel, batch: int, memory_devices: int) -> int:
    """Bytes one decode step of one layer of one batch puts on the links, both ways: tensors + frame headers."""
    return batch * model.wire_bytes_per_token_layer() + 2 * memory_devices * FRAME_HEADER_BYTES


def dense_seconds(problem: OffloadProblem, device: OffloadDevice, tokens: int, memory_devices: int = 0) -> float:
    """One layer's dense part for ``tokens`` rows, plus the frames it sends to and gets back from
    ``memory_devices`` memory devices (its CPU is busy with them: ``frame_s`` each)."""
    m = problem.model
    params = m.dense_params_per_layer
    return max(2 * params * tokens / device.flops, params * m.bytes_per_element / device.memory_bandwidth) \
        + 2 * memory_devices * device.frame_s


def head_seconds(problem: OffloadProblem, device: OffloadDevice, batch: int) -> float:
    """Final norm, LM head and sampling of one decode step of the batch (once per step, not per layer),
    with the device's profiled per-step overhead."""
    m = problem.model
    params = m.vocab * m.hidden
    return max(2 * params * batch / device.flops, params * m.bytes_per_element / device.memory_bandwidth) \
        + device.step_overhead_s


def residual_seconds(problem: OffloadProblem, source: OffloadDevice, target: OffloadDevice, rows: int) -> float:
    """A batch's residual stream handed from one compute replica to the next (rotational staggering)."""
    nbytes = rows * problem.model.hidden * problem.model.bytes_per_element + FRAME_HEADER_BYTES
    return nbytes / min(source.link_bandwidth, target.link_bandwidth) + source.link_latency_s + target.link_latency_s


def attention_seconds_by_device(problem: OffloadProblem, memory: list[OffloadDevice], batch: int,
                                context: float) -> list[float]:
    """Per memory device (heads split evenly, as agents split them): its share of one layer's KV read
    for the batch, and the frame it receives and the one it answers (``frame_s`` each)."""
    m = problem.model
    per_head = batch * context * 2 * m.head_dim * m.bytes_per_element
    base, extra = divmod(m.kv_heads, len(memory))
    return [(base + (1 if i < extra else 0)) * per_head / d.memory_bandwidth + 2 * d.frame_s
            for i, d in enumerate(memory)]


def attention_seconds(problem: OffloadProblem, memory: list[OffloadDevice], batch: int, context: float) -> float:
    """KV read of one layer for the batch, heads split evenly: the slowest device's share bounds."""
    return max(attention_seconds_by_device(problem, memory, batch, context))


def link_seconds(problem: OffloadProblem, compute: OffloadDevice, memory: list[OffloadDevice], batch: int) -> float:
    nbytes = layer_wire_bytes(problem.model, batch, len(memory))
    bandwidth = min(compute.link_bandwidth, sum(d.link_bandwidth for d in memory))
    latency = compute.link_latency_s + max(d.link_latency_s for d in memory)
    return nbytes / bandwidth + 2 * latency


def layer_times(problem: OffloadProblem, plan: OffloadPlan) -> LayerTimes:
    compute = [problem.device(d) for d in plan.compute]
    memory = [problem.device(d) for d in plan.memory]
    ctx = problem.workload.mean_context_tokens
    return LayerTimes(dense_s=max(dense_seconds(problem, d, plan.batch, len(memory)) for d in compute),
                      attention_s=attention_seconds(problem, memory, plan.batch, ctx),
                      link_s=max(link_seconds(problem, d, memory, plan.batch) for d in compute))


def evaluate(problem: OffloadProblem, plan: OffloadPlan) -> OffloadCost:
    """The plan's steady-state decode throughput, price and memory (``PlanInvalid`` for a bad plan)."""
    check_plan(problem, plan)
    lt = layer_times(problem, plan)
    layers, c, n = problem.model.layers, len(plan.compute), plan.in_flight
    # Per layer, n batch-layers must pass: c compute devices, one pool, each batch's own chain.
    # A fixed stagger binds batch b to replica b mod c (the busiest holds ceil(n/c)); a rotational
    # one hands each next slice to the replica free first, so the replicas share n evenly.
    per_replica = -(-n // c) if plan.schedule == "fixed" else n / c
    head = max(head_seconds(problem, problem.device(d), plan.batch) for d in plan.compute)
    bounds = {"compute": per_replica * (layers * lt.dense_s + head), "memory": n * layers * lt.attention_s,
              "cycle": layers * (lt.dense_s + lt.link_s + lt.attention_s) + head}
    bottleneck = max(bounds, key=bounds.get)
    step = bounds[bottleneck]
    tps = n * plan.batch / step
    price = sum(problem.device(d).price for d in plan.compute + plan.memory)
    kv_total = n * plan.batch * problem.workload.context_tokens * problem.model.kv_bytes_per_token()
    heads = plan.kv_heads_of(problem.model.kv_heads)
    # its KV share of every batch in flight, and the transient of one batch's prefill attend
    memory_bytes = {d: kv_total * len(h) // problem.model.kv_heads
                    + problem.model.prefill_attend_bytes(plan.batch, problem.workload.prompt_tokens, len(h))
                    for d, h in heads.items()}
    fits = all(problem.model.weight_bytes <= problem.device(d).memory_bytes for d in plan.compute) and all(
        b <= problem.device(d).memory_bytes for d, b in memory_bytes.items())
    return OffloadCost(layer=lt, step_s=step, tokens_per_s=tps, price=price,
                       tokens_per_s_per_dollar=tps / price if price > 0 else float("inf"),
                       compute_bytes=problem.model.weight_bytes, memory_bytes=max(memory_bytes.values()),
                       fits=fits, bottleneck=bottleneck)
