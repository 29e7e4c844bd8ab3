"""Profiling ON the device: compute time per unit, the memory budget, and data links.

Compute: each unit (embedding, one decoder block, final norm + head) is built alone from
the model's HF config with random synthetic weights, timed, and freed before the next, so
a device needs no checkpoint and can profile a model far larger than its memory (the
EdgeShard paper's dynamic loading). Prefill is timed for the workload's prompt length,
decode for one new token per sequence over a KV cache of ``context_tokens``, at a few
batch sizes. Each figure is the median of ``repeats`` runs after a warm-up; the spread is
IQR / median.

A block is timed through the stage runtime's own calls (agents/step_inputs.py: ``run_block``,
``layer_inputs``, ``step_positions``; agents/shard.py runs a step with them): the causal mask,
positions and rotary embedding (its table) are computed once per stage and step, outside the
blocks, so they are built once here too, outside the timed forward (and the KV cache is reset to
the context length between repeats, untimed). That once-per-stage work is timed on its own — the
stage overhead — and reported beside the units, so the cost model charges it once per stage
instead of once per block: it is ``StageExecutor.decode`` (and ``prefill``) itself, on a stage of
the profiled block (``StageExecutor.of_blocks``), less the time of its block's call, so everything a
step does besides its blocks is timed, on the stage's own code path and as cold as a step leaves it.
A copy of those calls here once drifted from the stage's, and timing only the mask, positions and
rotary calls, hot, left ~30 µs a step out (docs/serving.md: A stage's own work around its forward).

A unit is timed with its weights out of the CPU's last-level cache, as a run finds them
when the model's weights exceed that cache: a decode step streams every unit of a stage
through it, so each unit's weights were evicted since its previous use. Timing one unit
over and over would keep a small unit's weights cached (a 12.8 MiB block in a 32 MiB L3
measured 0.7 ms/token where the same block took 1.6 ms inside an 8-block stage: the
miniature's 2.5x misprediction, docs/experiments.md). So when the entire model is larger
than the cache, several copies of the unit (distinct weights, together about twice the
cache) are built and timed in turn (``cold_copies``); a model that fits is timed warm, as
it runs on a device of its own. Not the embedding, whose step reads only its tokens' rows.
On a host whose cores and caches other agents share (``shared_host``: an agent started with
``--shared-host``, a local cluster's emulated devices and the netns testbed's edges), a unit the cache would hold is timed after the cache was overwritten
(``CacheEvictor``), and so is the stage overhead: between two of a stage's steps the other
stages computed there. The demo's 8× head stage computed 0.50 ms of CPU per step in runs, its
head 0.09–0.2 ms profiled back to back, 0.36–0.52 ms profiled cold. CPU only: an
accelerator's caches are not modelled. Copies and evictor take memory in proportion to the
cache: agents/cold_profiling.py bounds them by the memory the agent may use and, where the cache
cannot be overwritten within it, times the unit warm; the result's ``cache_timing`` says which.

Links: the sender pushes probe data messages through its data-plane socket (and through
its link emulation, when the agent emulates one), the receiver timestamps each arrival on
its own data socket. Bandwidth is read at the receiver (bytes after the first ones /
time between arrivals), so sender-side buffering cannot inflate it; one-way latency is
``arrival - send`` of small spaced probes on the agents' clocks (the coordinator corrects
for the clock offsets it estimated). Both sides are driven by the coordinator, one pair at
a time (core/devices/profiling.py).

This module ships with the agent: it must not import core/.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

from agents.accelerators import CUDA, CudaBackend, canonical
from agents.cold_profiling import (
    CacheEvictor,
    MemoryFigures,
    Timed,
    cache_timing,
    evicting,
    evictor_bytes,
    in_turn,
    last_level_cache_bytes,
    memory_budget,
    profiling_room,
    read_memory_figures,
    unit_cold,
)
from agents.protocol import (
    ComputeOptions,
    ComputeProfile,
    ConvSweepOptions,
    ConvTimings,
    LinkOptions,
    LinkResult,
    UnitTimes,
)
from agents.weight_precision import check_quantizable, held_bytes, quantize_block


def _model_bytes(hf_config, dtype) -> int:
    """Parameter bytes of the entire model (built on the meta device: nothing is allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(hf_config)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    element = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() for p in model.parameters()) * element


# ---------------------------------------------------------------------------- compute
def _stats(samples: list[float]) -> tuple[float, float]:
    """Median and relative spread (IQR / median)."""
    med = statistics.median(samples)
    if len(samples) >= 4:
        q = statistics.quantiles(samples, n=4, method="inclusive")
        iqr = q[2] - q[0]
    else:
        iqr = max(samples) - min(samples)
    return med, (iqr / med if med > 0 else 0.0)


def _time(fn: Callable[[], Any], repeats: int, warmup: int, sync: Callable[[], None] = lambda: None,
          reset: Callable[[], Any] | None = None, clock: Callable[[], float] = time.perf_counter,
          cold: Callable[[], Any] | None = None) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` after ``warmup`` calls; ``reset``
    (e.g. crop the KV cache back) runs before each call, ``cold`` (the evictor) then before timed ones."""
    for _ in range(warmup):
        if reset is not None:
            reset()
        fn()
    sync()
    out = []
    for _ in range(repeats):
        for prepare in filter(None, (reset, cold)):
            prepare()
            sync()
        t0 = clock()
        fn()
        sync()  # GPU kernels are asynchronous: the time ends when they are done
        out.append(clock() - t0)
    return out


class _UnitBench:
    """One unit built alone with random weights, and the calls to time it."""

    def __init__(self, hf_config, unit: int, dtype, seed: int, device="cpu", weights: str = "fp"):
        import torch
        from torch import nn
        from transformers import AutoModelForCausalLM

        self.torch = torch
        cfg = copy.deepcopy(hf_config)
        cfg._attn_implementation = "sdpa"
        self.num_layers = int(cfg.num_hidden_layers)
        self.kind = "embedding" if unit == 0 else ("head" if unit == self.num_layers + 1 else "block")
        layer_index = unit - 1
        if self.kind == "block":
            types = getattr(cfg, "layer_types", None)
            if types:
                cfg.layer_types = [types[layer_index]]
        cfg.num_hidden_layers = 1
        self.cfg = cfg
        self.dtype = dtype
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(cfg)
        base = getattr(skeleton, skeleton.base_model_prefix)
        gen = torch.Generator(device=device).manual_seed(seed + unit)
        self.vocab = int(cfg.vocab_size)
        self.hidden = int(getattr(cfg, "hidden_size", 0) or getattr(cfg, "n_embd"))
        self.modules: dict[str, nn.Module] = {}
        if self.kind == "embedding":
            self.modules["embed"] = skeleton.get_input_embeddings()
            if hasattr(base, "wpe"):
                self.modules["wpe"] = base.wpe
        elif self.kind == "head":
            self.modules["norm"] = getattr(base, "norm", None) or getattr(base, "ln_f")
            self.modules["head"] = skeleton.lm_head
        else:
            blocks = getattr(base, "layers", None) or getattr(base, "h")
            self.modules["layer"] = blocks[0]
        for m in self.modules.values():
            m.to_empty(device=device)
            m.to(dtype)
            for name, p in m.named_parameters():
                p.requires_grad_(False)
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02, generator=gen)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.fill_(1.0)  # norm scales
            for b in m.buffers():  # e.g. causal-mask buffers: values do not change the timing
                b.zero_()
            m.eval()
        from agents.step_inputs import DecodeMasks, RotaryTable

        self.rotary_table = self.rotary = None  # as StageExecutor builds them
        self._decode_masks = DecodeMasks()
        self.device = device
        if self.kind == "block" and hasattr(base, "rotary_emb"):
            self.rotary = type(base.rotary_emb)(config=cfg).to(device)
            self.rotary_table = RotaryTable(self.rotary)
        if self.kind == "block":  # its Linears as a stage at that precision holds them
            quantize_block(self.modules["layer"], weights)
        self.param_bytes = sum(held_bytes(p) for m in self.modules.values() for p in m.parameters())
        del skeleton, base

    def _hidden(self, b: int, t: int):
        return self.torch.randn(b, t, self.hidden, dtype=self.dtype)

    def _step_inputs(self, x, mask_2d, cache):
        """What the stage runtime computes once per stage and step before its blocks, by its own calls
        (agents/shard.py ``StageExecutor._run`` / ``_layer_inputs``): positions, the causal mask of the
        layer type, the rotary embedding."""
        from agents.step_inputs import layer_inputs, step_positions

        positions = step_positions(mask_2d, x.shape[1])
        kind = (getattr(self.cfg, "layer_types", None) or ["full_attention"])[0]
        masks, extra = layer_inputs(self.cfg, (kind,), x, mask_2d, positions, cache, self._decode_masks,
                                    self.rotary_table)
        return positions, masks[kind], extra

    def _forward(self, x, cache, inputs):
        from agents.step_inputs import run_block

        positions, mask, extra = inputs
        return run_block(self.modules["layer"], x, mask, positions, cache, extra)

    def _block(self, x, mask_2d, cache):
        return self._forward(x, cache, self._step_inputs(x, mask_2d, cache))

    def prefill_fn(self, b: int, t: int) -> Timed:
        torch = self.torch
        if self.kind == "embedding":
            ids = torch.randint(0, self.vocab, (b, t))
            pos = torch.arange(t).unsqueeze(0).expand(b, -1)
            wpe = self.modules.get("wpe")
            return Timed(lambda: self.modules["embed"](ids) + (wpe(pos) if wpe is not None else 0))
        if self.kind == "head":
            x = self._hidden(b, t)
            return Timed(lambda: self.modules["head"](self.modules["norm"](x[:, -1:, :])))
        from transformers import DynamicCache

        x = self._hidden(b, t)
        inputs = self._step_inputs(x, torch.ones(b, t, dtype=torch.long), DynamicCache(config=self.cfg))
        box = [None]

        def reset():  # each prefill starts a fresh cache, as the runtime's does
            box[0] = DynamicCache(config=self.cfg)

        return Timed(lambda: self._forward(x, box[0], inputs), reset)

    def decode_fn(self, b: int, context: int) -> Timed:
        """One new token per sequence over a ``context``-token cache (kept at that length)."""
        torch = self.torch
        if self.kind != "block":
            return self.prefill_fn(b, 1)
        cache = self._context_cache(b, context)
        x = self._hidden(b, 1)
        inputs = self._step_inputs(x, torch.ones(b, context + 1, dtype=torch.long), cache)

        def reset():  # drop the token a run added: every repeat sees `context` tokens
            extra = cache.get_seq_length() - context
            if extra > 0:
                cache.crop(-extra)

        return Timed(lambda: self._forward(x, cache, inputs), reset)

    def _context_cache(self, b: int, context: int):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.cfg)
        self._block(self._hidden(b, context), self.torch.ones(b, context, dtype=self.torch.long), cache)
        return cache

    def expert_fn(self) -> Timed | None:
        """One expert of a MoE block (Mixtral's ``mlp.experts``: gate/up, activation, down) on one
        token, the way a stage that keeps a block's experts on storage runs it; None for a unit without
        experts. A planner that places experts splits a block's decode time into this and the rest."""
        experts = getattr(getattr(self.modules.get("layer"), "mlp", None), "experts", None)
        if experts is None or not hasattr(experts, "gate_up_proj"):
            return None
        torch = self.torch
        x = self._hidden(1, 1)[0]
        gate_up_proj, down_proj = experts.gate_up_proj[0], experts.down_proj[0]

        def run():
            gate, up = torch.nn.functional.linear(x, gate_up_proj).chunk(2, dim=-1)
            return torch.nn.functional.linear(experts.act_fn(gate) * up, down_proj)

        return Timed(run)

    def _stage(self, b: int, context: int, clock: Callable[[], float], sync: Callable[[], None]):
        """A stage of this block on the stage runtime's own path (``StageExecutor.of_blocks``) with ``b`` rows
        prefilled to ``context`` tokens, and ``clock`` less its block's calls (``sync``ed): the stage's own work
        read in a real step, after the block's arithmetic went through the caches (hot, it is a third)."""
        from agents.shard import StageExecutor
        from agents.step_inputs import run_block

        stage = StageExecutor.of_blocks(self.cfg, [self.modules["layer"]], self.rotary, self.dtype, self.device)
        stage.prefill(0, self._hidden(b, context), self.torch.ones(b, context, dtype=self.torch.long))
        stage.decode(0, self._hidden(b, 1))  # a run's first step learns the mask's shortcut, checks the rotary table
        inside = [0.0]

        def timed_block(*args):
            sync()
            start = clock()
            out = run_block(*args)
            sync()
            inside[0] += clock() - start
            return out

        stage._run_layer = timed_block
        return stage, lambda: clock() - inside[0]

    def stage_decode_overhead_fn(self, b: int, context: int, clock: Callable[[], float] = time.perf_counter,
                                 sync: Callable[[], None] = lambda: None) -> tuple[Timed, Callable[[], float]]:
        """The runtime's once-per-stage work of a decode step: ``StageExecutor.decode`` itself (its checks,
        growing the mask, positions, causal mask, rotary embedding, the dispatch; block units only), and the
        clock to time it with: ``clock`` less its block's call (that is the unit's time). Consecutive steps,
        as a run takes them: the mask and KV cache grow by one column a call."""
        (stage, less_blocks), x = self._stage(b, context, clock, sync), self._hidden(b, 1)
        return Timed(lambda: stage.decode(0, x)), less_blocks

    def stage_prefill_overhead_fn(self, b: int, t: int, clock: Callable[[], float] = time.perf_counter,
                                  sync: Callable[[], None] = lambda: None) -> tuple[Timed, Callable[[], float]]:
        """The runtime's once-per-stage work of a prefill: ``StageExecutor.prefill`` itself, less its block's
        call (its checks, a fresh KV cache, the mask as long, positions, causal mask, rotary embedding)."""
        (stage, less_blocks), x = self._stage(b, t, clock, sync), self._hidden(b, t)
        seen = self.torch.ones(b, t, dtype=self.torch.int64)
        return Timed(lambda: stage.prefill(0, x, seen)), less_blocks


def _hf_config(config: dict[str, Any]):
    from transformers import AutoConfig

    cfg = dict(config)
    model_type = cfg.pop("model_type", None)
    if not model_type:
        raise ValueError("the model config has no model_type")
    for k in ("architectures", "_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        cfg.pop(k, None)
    return AutoConfig.for_model(model_type, **cfg)


def profile_units(opts: ComputeOptions, device: str = "", progress: Callable[[int, int], None] | None = None,
                  *, cache_bytes: int | None = None, clock: Callable[[], float] = time.perf_counter,
                  shared_host: bool = False, memory: MemoryFigures | None = None,
                  accelerators: CudaBackend = CUDA) -> ComputeProfile:
    """Time every requested unit; the core of ``profile_compute`` (usable without an agent).

    ``cache_bytes``: the last-level cache the units are timed cold against (None: this CPU's,
    0: time them warm); ``clock``: what the timings read (``time.thread_time`` for CPU time:
    bench/profile_cache.py); ``shared_host``: the agent shares its host's cores and caches with
    other agents (``DeviceEmulation.shares_host``), so a unit the cache would hold is timed
    after the cache was overwritten (``CacheEvictor``), as a run finds it (module docstring);
    ``memory``: what bounds the memory profiling may add for that (None: this process's, read
    now; agents/cold_profiling.py); ``accelerators``: the GPUs ``opts.device`` may name, where units
    are built, synchronised, timed (their clock) and whose free memory is the budget
    (agents.accelerators). The result's ``cache_timing`` says how the units were timed."""
    import torch

    t_start = time.perf_counter()
    if opts.threads > 0:
        torch.set_num_threads(opts.threads)
    dtype = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}.get(opts.dtype)
    if dtype is None:
        raise ValueError(f"unsupported dtype {opts.dtype!r}")
    if opts.prompt_tokens < 1 or opts.repeats < 1 or not opts.batch_sizes or min(opts.batch_sizes) < 1:
        raise ValueError("prompt_tokens, repeats and batch sizes must be >= 1")
    cfg = _hf_config(opts.config)
    num_units = int(cfg.num_hidden_layers) + 2
    units = opts.units or tuple(range(num_units))
    bad = [u for u in units if not 0 <= u < num_units]
    if bad:
        raise ValueError(f"units {bad} outside [0, {num_units})")
    context = opts.context_tokens or opts.prompt_tokens
    check_quantizable(str(getattr(cfg, "model_type", "")), opts.weights)  # before any unit is built
    if not (opts.device == "cpu" or opts.device.startswith("cuda")):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {opts.device!r}")
    on_gpu = opts.device != "cpu"
    if on_gpu and canonical(opts.device) not in {n for n, _, _ in accelerators.devices()}:
        raise ValueError(f"device {opts.device!r} requested but torch sees no CUDA device of that name")
    # not ``device``: that is the agent's name, reported below
    tdev = accelerators.place(opts.device) if on_gpu else torch.device("cpu")
    sync = (lambda: accelerators.sync(opts.device)) if on_gpu else (lambda: None)
    clock = accelerators.clock if on_gpu else clock
    decode_bs = tuple(sorted(set(opts.batch_sizes)))
    prefill_bs = tuple(sorted(set(opts.prefill_batch_sizes)))
    results = []
    overhead = {"decode": 0.0, "prefill": 0.0}
    if cache_bytes is None:
        cache_bytes = 0 if on_gpu else last_level_cache_bytes()
    model_bytes = _model_bytes(cfg, dtype) if cache_bytes else 0
    # what profiling adds to time units cold is bounded by the memory the agent may use (issue 25)
    room = profiling_room(read_memory_figures() if memory is None else memory, opts.headroom_bytes)
    evictor_size = evictor_bytes(cache_bytes, room, shared_host)
    evictor = CacheEvictor(evictor_size) if evictor_size else None
    warm_reasons: list[str] = []
    # Factory calls (inputs, caches) must land on an accelerator; on the CPU they do anyway, and
    # a device context would put every timed op through torch's function-mode dispatch (+0.2 ms
    # per block of the miniature's model, 15 %: bench/profile_cache.py), which runs never pay.
    placed = tdev if tdev.type != "cpu" else contextlib.nullcontext()
    with torch.inference_mode(), placed:
        for i, u in enumerate(units):
            bench = _UnitBench(cfg, u, dtype, opts.seed, tdev, opts.weights)
            # the unit's weights out of the cache at each timed call, as in a run (module docstring)
            # (not the embedding: a step reads only its tokens' rows, never the whole table)
            plan = unit_cold(bench.param_bytes, model_bytes, cache_bytes, room, evictor=evictor_size,
                             shared_host=shared_host, accelerator=on_gpu)
            if bench.kind == "embedding":
                plan = plan._replace(copies=1, evict=evictor is not None, warm="")
            else:
                warm_reasons.append(plan.warm)
            benches = [bench] + [_UnitBench(cfg, u, dtype, opts.seed, tdev, opts.weights)
                                 for _ in range(plan.copies - 1)]
            warmup = max(opts.warmup, len(benches))  # every copy's first call is a warm-up
            # copies already find their weights evicted; a unit timed alone on a shared host does once the cache is overwritten
            cold = evictor if plan.evict else None
            dec, dec_sp, pre, pre_sp = [], [], [], []
            for b in decode_bs:
                fn = evicting(in_turn([x.decode_fn(b, context) for x in benches]), cold)
                m, s = _stats(_time(fn.run, opts.repeats, warmup, sync, fn.reset, clock, fn.cold))
                dec.append(m)
                dec_sp.append(s)
            for b in prefill_bs:
                fn = evicting(in_turn([x.prefill_fn(b, opts.prompt_tokens) for x in benches]), cold)
                m, s = _stats(_time(fn.run, opts.repeats, warmup, sync, fn.reset, clock, fn.cold))
                pre.append(m)
                pre_sp.append(s)
            if bench.kind == "block" and not overhead["decode"]:  # once, with the first block's config
                # more repeats than a unit: these are tens of microseconds, noisier relative to themselves
                reps = max(opts.repeats, 20)
                fn, less_blocks = bench.stage_decode_overhead_fn(decode_bs[0], context, clock, sync)
                fn = evicting(fn, evictor)
                overhead["decode"] = _stats(_time(fn.run, reps, opts.warmup, sync, None, less_blocks, fn.cold))[0]
                fn, less_blocks = bench.stage_prefill_overhead_fn(prefill_bs[0], opts.prompt_tokens, clock, sync)
                fn = evicting(fn, evictor)
                overhead["prefill"] = _stats(_time(fn.run, reps, opts.warmup, sync, None, less_blocks, fn.cold))[0]
            expert = bench.expert_fn() if bench.kind == "block" else None
            expert_s = _stats(_time(expert.run, max(opts.repeats, 20), opts.warmup, sync, clock=clock))[0] if expert else 0.0
            results.append(UnitTimes(unit=u, decode_s=tuple(dec), decode_spread=tuple(dec_sp), prefill_s=tuple(pre),
                                     prefill_spread=tuple(pre_sp), param_bytes=bench.param_bytes,
                                     expert_decode_s=expert_s))
            bench = benches = fn = expert = None  # the timed closures hold the unit too: freed before the next is built
            gc.collect()
            if progress:
                progress(i + 1, len(units))
    evictor = None  # its buffer is not memory the device has in use
    gc.collect()
    if on_gpu:  # the stage's weights and KV cache live in the GPU's memory, not the host's
        avail, total = accelerators.memory(opts.device)
        budget = max(0, avail - opts.headroom_bytes)
    else:
        budget, total, avail = memory_budget(opts.headroom_bytes, "cpu")
    return ComputeProfile(
        device=device,
        decode_batch_sizes=decode_bs,
        prefill_token_counts=tuple(b * opts.prompt_tokens for b in prefill_bs),
        units=tuple(results),
        memory_budget_bytes=budget,
        memory_total_bytes=total,
        memory_available_bytes=avail,
        accelerator=next((f"cuda:{m}" for _, m, _ in accelerators.devices()), ""),
        threads=torch.get_num_threads(),
        seconds=time.perf_counter() - t_start,
        arch=platform.machine(),
        cores=os.cpu_count() or 0,
        stage_decode_overhead_s=overhead["decode"],
        stage_prefill_overhead_s=overhead["prefill"],
        cache_timing=cache_timing(warm_reasons),
    )


def profile_compute(agent, options: ComputeOptions | ConvSweepOptions) -> ComputeProfile | ConvTimings:
    """Agent handler of ``ProfileCompute``: unit timings, or the convolution timings a
    technique's registered profiler answers (agents.registry.run_profiler); an emulated device's
    figures carry its slowdown and budget."""
    emulation = getattr(agent, "emulation", None)
    if isinstance(options, ConvSweepOptions):
        from agents.registry import run_profiler as conv_sweep

        return conv_sweep(options, emulation.compute_slowdown if emulation is not None else 1.0)

    def progress(done: int, total: int) -> None:  # read by the coordinator through get_status
        if hasattr(agent, "_set_progress"):
            agent._activity = f"profiling compute: unit {done}/{total}"
            agent._set_progress(done / total)

    clock = emulation.profile_clock(options.device) if emulation is not None else time.perf_counter
    shared = emulation.shares_host(options.device) if emulation is not None else False
    result = profile_units(options, device=getattr(agent, "device", ""), progress=progress, clock=clock,
                           shared_host=shared, accelerators=getattr(agent, "accelerators", CUDA))
    # an emulated device is a slower CPU with less memory: its GPU (if it has one) is not emulated
    scaled = emulation is not None and emulation.active and options.device == "cpu"
    return emulation.scale_compute_profile(result) if scaled else result


# ------------------------------------------------------------------------------ links
def measure_link(agent, peer, options: LinkOptions) -> LinkResult:
    """Agent handler of ``MeasureLink``: send probes to ``peer`` or receive them from it."""
    return _receive(agent, peer, options) if options.role == "receive" else _send(agent, peer, options)


def _send(agent, peer, opts: LinkOptions) -> LinkResult:
    import numpy as np
    import zmq

    from agents.protocol import DataHeader, TensorSpec, encode_data_header
    from agents.transport import LinkSender, curve_client, harden

    sock = agent.context.socket(zmq.PUSH)
    harden(sock)
    sock.sndtimeo = int(opts.timeout_s * 1000)
    curve_client(sock, agent.keys, peer.public_key)
    sock.connect(peer.data_address)
    sender = LinkSender(sock, agent.default_link, clock=agent.clock, counts=agent.wire, link=peer.device)
    t0 = time.perf_counter()
    try:
        def header(kind_step: int, n: int) -> bytes:
            return encode_data_header(DataHeader(
                run_id=opts.probe_id, kind="probe", phase="decode", step=kind_step, micro_batch=0,
                sender=agent.device, tensors=(TensorSpec("uint8", (n,)),), t_sent=agent.clock()))

        tiny = np.zeros(8, dtype=np.uint8)
        for i in range(opts.latency_probes):  # step < 0: latency probes
            sender.send([header(-1 - i, 8), tiny], 8)
            time.sleep(opts.latency_gap_s)
        chunk = np.zeros(opts.chunk_bytes, dtype=np.uint8)
        sent = 0
        step = 0
        while sent < opts.nbytes:
            n = min(opts.chunk_bytes, opts.nbytes - sent)
            sender.send([header(step, n), chunk[:n]], n)
            sent += n
            step += 1
        sender.send([header(1 << 30, 8), tiny], 8)  # end marker
        _drain(sender, opts.timeout_s)
        return LinkResult(role="send", probe_id=opts.probe_id, seconds=time.perf_counter() - t0)
    finally:
        sender.close()
        sock.close(linger=int(opts.timeout_s * 1000))


def _drain(sender, timeout_s: float) -> None:
    """Wait until an emulated link has put every queued message on the socket
    (closing it earlier would drop them)."""
    queue = getattr(sender, "_queue", None)
    deadline = time.monotonic() + timeout_s
    while queue and time.monotonic() < deadline:
        time.sleep(0.005)


def _receive(agent, peer, opts: LinkOptions) -> LinkResult:
    from agents.protocol import ProtocolError, decode_data
    from agents.transport import DATA_DOMAIN

    loaded = getattr(agent, "_loaded", None)
    before = [p.public_key for p in loaded.msg.peers if p.device != agent.device] if loaded else []
    agent.gate.allow(DATA_DOMAIN, [*before, peer.public_key])
    data = agent._data
    one_way: list[float] = []
    arrivals: list[tuple[float, int]] = []
    t0 = time.perf_counter()
    deadline = time.monotonic() + opts.timeout_s
    error = ""
    try:
        while True:
            if time.monotonic() > deadline:
                error = f"timed out after {opts.timeout_s:.0f} s waiting for probes from {peer.device}"
                break
            if not data.poll(100):
                continue
            frames = data.recv_multipart(copy=False)
            got = agent.clock()
            try:
                header, bufs = decode_data(frames, 1 << 30)
            except ProtocolError:
                continue
            if header.kind != "probe" or header.run_id != opts.probe_id or header.sender != peer.device:
                continue
            if header.step < 0:
                one_way.append(got - header.t_sent)
            elif header.step == 1 << 30:
                break
            else:
                arrivals.append((got, bufs[0].nbytes))
    finally:
        agent.gate.allow(DATA_DOMAIN, before)
    total = sum(n for _, n in arrivals)
    bw = 0.0
    if len(arrivals) >= 2:
        # skip the warm-up bytes: count from the first arrival after them
        skip, k = 0, 0
        while k < len(arrivals) - 1 and skip < opts.warmup_fraction * total:
            skip += arrivals[k][1]
            k += 1
        k = max(k, 1) - 1
        span = arrivals[-1][0] - arrivals[k][0]
        counted = sum(n for _, n in arrivals[k + 1:])
        if span > 0:
            bw = counted * 8 / span / 1e6
    return LinkResult(role="receive", probe_id=opts.probe_id, bytes_received=total, bandwidth_mbit_s=bw,
                      one_way_s=tuple(one_way), seconds=time.perf_counter() - t0, error=error)
