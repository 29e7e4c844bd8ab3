"""EdgeMoE on an agent: a Mixtral stage whose experts stay on storage (stage kind ``expert-offload``).

Everything but the experts (embedding, attention, norms, routers, head) is resident, as in
layer sharding (agents.shard). Each expert's weights are read from the checkpoint with a
safetensors partial read when the router picks it, into an ``ExpertBuffer`` of ``slots``
experts: a full buffer evicts (EdgeMoE's frequency + position score, LRU or LFU), and an
I/O thread preloads the experts the next MoE layer will most likely pick (from the
transitions between consecutive layers' picks) while the current layer computes. Storage
can be throttled (``bandwidth_bps``) so a fast disk emulates an SD card or eMMC.

The expert math is transformers' own ``MixtralExperts.forward`` with the weights looked up
in the buffer, so at full precision the tokens equal HF generate's of the whole model.
An agent builds the stage from its ``LoadShard.options`` (``options.OffloadOptions``: settings and
the hashes of the files it reads); used in-process, options come as keyword arguments or from
``expert-offload.json`` in the model directory.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import Counter, deque
from pathlib import Path

import torch
from torch import nn

from agents.checkpoint_reader import CheckpointError, CheckpointReader
from agents.techniques.expert_offload.activity import expert_activity
from agents.techniques.expert_offload.options import (
    BIT_WIDTHS, POLICIES, PROFILE_FILE, QUANTIZED_FILE, OffloadOptions, check_files,
)
from agents.shard import StageExecutor
from agents.techniques.expert_offload.perplexity import perplexity  # noqa: F401  (its accuracy metric, public here too)

STAGE_KIND = "expert-offload"
OPTIONS_FILE = "expert-offload.json"


class ExpertStore:
    """Reads one expert's (gate_up [2I, H], down [H, I]) from the checkpoint, at most at ``bandwidth_bps``.

    Both Mixtral layouts: old per-expert ``block_sparse_moe.experts.{e}.w1/w2/w3`` tensors and
    transformers 5's fused ``mlp.experts.gate_up_proj``/``down_proj`` (one row sliced out)."""

    def __init__(self, model_dir: str, key_prefix: str, dtype: torch.dtype, bandwidth_bps: float | None = None,
                 expert_bits: dict[tuple[int, int], int] | None = None, shapes=None):
        self.reader = CheckpointReader(model_dir)
        self.expert_bits = dict(expert_bits or {})
        """(block, expert) -> 2/4/8: read from ``QUANTIZED_FILE``; others at full precision."""
        self.shapes = shapes
        """((2I, H), (H, I)): the shapes a quantised expert is restored to."""
        if self.expert_bits and not (Path(model_dir) / QUANTIZED_FILE).is_file():
            raise CheckpointError(f"{model_dir}: expert bit widths are set but {QUANTIZED_FILE} is missing; "
                                  "write it with write_quantized_experts")
        self.prefix, self.dtype = key_prefix, dtype
        if bandwidth_bps is not None and not bandwidth_bps > 0:
            raise CheckpointError(f"storage bandwidth must be > 0 bytes/s (got {bandwidth_bps})")
        self.bandwidth_bps = bandwidth_bps
        self.bytes_read = 0
        self.read_s = 0.0
        self.reads = 0
        self.layers_read: set[int] = set()
        self._lock = threading.Lock()

    def _names(self, layer: int, expert: int) -> tuple[str, ...]:
        old = f"{self.prefix}{layer}.block_sparse_moe.experts.{expert}."
        if f"{old}w1.weight" in self.reader:
            return tuple(f"{old}{w}.weight" for w in ("w1", "w3", "w2"))
        fused = f"{self.prefix}{layer}.mlp.experts."
        if f"{fused}gate_up_proj" in self.reader:
            return (f"{fused}gate_up_proj", f"{fused}down_proj")
        raise CheckpointError(f"{self.reader.model_dir}: no weights of expert {expert} in block {layer}")

    def read(self, layer: int, expert: int) -> tuple[torch.Tensor, ...]:
        """(gate_up, down), or a quantised expert's (codes, scales, codes, scales): see ``weights``."""
        from safetensors import safe_open

        started = time.perf_counter()
        bits = self.expert_bits.get((layer, expert), 32)
        if bits < 32:
            return self._read_quantized(layer, expert, bits, started)
        names = self._names(layer, expert)
        file = self.reader._file_of[names[0]]
        with safe_open(str(file), framework="pt") as f:
            if len(names) == 3:
                w1, w3, w2 = (f.get_tensor(n) for n in names)
                gate_up, down = torch.cat([w1, w3], dim=0), w2.clone()
            else:
                gate_up, down = f.get_slice(names[0])[expert], f.get_slice(names[1])[expert]
        gate_up, down = gate_up.to(self.dtype).contiguous(), down.to(self.dtype).contiguous()
        nbytes = gate_up.numel() * gate_up.element_size() + down.numel() * down.element_size()
        self._account(layer, nbytes, started)
        return gate_up, down

    def _read_quantized(self, layer: int, expert: int, bits: int, started: float):
        """The packed codes and scales stored by ``write_quantized_experts`` (fewer bytes read), dequantised."""
        from safetensors import safe_open

        out, nbytes = [], 0
        with safe_open(str(Path(self.reader.model_dir) / QUANTIZED_FILE), framework="pt") as f:
            for name in ("gate_up", "down"):
                packed, scale = f.get_tensor(f"{layer}.{expert}.{name}.codes"), f.get_tensor(f"{layer}.{expert}.{name}.scale")
                nbytes += packed.numel() + scale.numel() * 4
                out += [packed, scale]
        self._account(layer, nbytes, started)
        return tuple(out)

    def weights(self, layer: int, expert: int, held: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """The (gate_up, down) matrices of what the buffer holds: as read, or dequantised now (the buffer
        keeps quantised experts packed, so they take their packed size in it)."""
        if len(held) == 2:
            return held
        bits = self.expert_bits[(layer, expert)]
        return (dequantize_per_channel(held[0], held[1], bits, self.shapes[0]).to(self.dtype),
                dequantize_per_channel(held[2], held[3], bits, self.shapes[1]).to(self.dtype))

    def _account(self, layer: int, nbytes: int, started: float) -> None:
        if self.bandwidth_bps:  # emulate slower storage: a read takes at least bytes / bandwidth
            wait = nbytes / self.bandwidth_bps - (time.perf_counter() - started)
            if wait > 0:
                time.sleep(wait)
        with self._lock:
            self.bytes_read += nbytes
            self.read_s += time.perf_counter() - started
            self.reads += 1
            self.layers_read.add(layer)


class ExpertBuffer:
    """At most ``slots`` experts in memory (loaded + being loaded). Thread-safe: the compute thread
    ``acquire``s (a miss reads on the spot), the I/O thread ``preload``s; an expert in use is
    pinned and never evicted."""

    def __init__(self, slots: int, read, num_layers: int, policy: str = "edgemoe"):
        if slots < 1:
            raise CheckpointError(f"the expert buffer needs at least 1 slot (got {slots})")
        if policy not in POLICIES:
            raise CheckpointError(f"unknown eviction policy {policy!r}; use one of {', '.join(POLICIES)}")
        self.slots, self._read, self.num_layers, self.policy = slots, read, num_layers, policy
        self._cond = threading.Condition()
        self._held: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._loading: set[tuple[int, int]] = set()
        self._pinned: Counter = Counter()
        self._unused_preloads: set[tuple[int, int]] = set()
        self.frequency: Counter = Counter()
        self._last_use: dict[tuple[int, int], int] = {}
        self._clock = 0
        self.current_layer = 0
        self.hits = self.misses = self.preloads = self.preload_hits = self.evictions = 0
        self.peak_slots = 0
        self.peak_bytes = 0
        self._bytes: dict[tuple[int, int], int] = {}
        self.activity: deque[tuple[str, tuple[int, int], float, float, int]] = deque(maxlen=1 << 16)
        """(outcome, key, start, end, bytes) per hit, demand load, preload and eviction, in
        ``time.perf_counter()`` seconds, until the executor takes them (``take_events``; bounded,
        so an executor used without an agent does not grow)."""

    # ----- eviction (pure choice over the held experts) -------------------------------
    def _score(self, key: tuple[int, int]) -> float:
        layer, _ = key
        if self.policy == "lru":
            return self._last_use.get(key, -1)
        if self.policy == "lfu":
            return self.frequency[key] + self._last_use.get(key, -1) / (self._clock + 1) * 0.5
        # EdgeMoE: frequency within its layer plus position (layers about to run score high)
        distance = (layer - self.current_layer) % self.num_layers
        peak = max((c for (l, _), c in self.frequency.items() if l == layer), default=0)
        return self.frequency[key] / (peak + 1) + (1.0 - distance / self.num_layers)

    def _victim(self) -> tuple[int, int] | None:
        free = [k for k in self._held if not self._pinned[k]]
        return min(free, key=self._score) if free else None

    def _reserve(self, key, wait: bool) -> bool:
        """Make room for one more expert (caller holds the lock)."""
        while len(self._held) + len(self._loading) >= self.slots:
            victim = self._victim()
            if victim is None:
                if not wait:
                    return False
                self._cond.wait()
                if key in self._held or key in self._loading:
                    return False
                continue
            del self._held[victim]
            now = time.perf_counter()
            self.activity.append(("evict", victim, now, now, 0))
            self._bytes.pop(victim, None)
            self._unused_preloads.discard(victim)
            self.evictions += 1
        self._loading.add(key)
        self.peak_slots = max(self.peak_slots, len(self._held) + len(self._loading))
        return True

    def _load(self, key, outcome: str) -> None:
        started = time.perf_counter()
        try:
            tensors = self._read(*key)
        except BaseException:
            with self._cond:
                self._loading.discard(key)
                self._cond.notify_all()
            raise
        with self._cond:
            self._loading.discard(key)
            self._held[key] = tensors
            self._bytes[key] = sum(t.numel() * t.element_size() for t in tensors)
            self.activity.append((outcome, key, started, time.perf_counter(), self._bytes[key]))
            self.peak_bytes = max(self.peak_bytes, sum(self._bytes.values()))
            self._cond.notify_all()

    # ----- the API ----------------------------------------------------------------------
    def acquire(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        with self._cond:
            self.current_layer = key[0]
            self._clock += 1
            self.frequency[key] += 1
            self._last_use[key] = self._clock
            if key in self._held or key in self._loading:
                self.hits += 1
                now = time.perf_counter()
                self.activity.append(("hit", key, now, now, 0))
                if key in self._unused_preloads:
                    self.preload_hits += 1
                    self._unused_preloads.discard(key)
                while key not in self._held:
                    if key not in self._loading:  # its preload failed: read it ourselves
                        break
                    self._cond.wait()
            else:
                self.misses += 1
            if key not in self._held:
                owns = self._reserve(key, wait=True)
                if owns:
                    self._cond.release()
                    try:
                        self._load(key, "load")
                    finally:
                        self._cond.acquire()
                while key not in self._held:
                    self._cond.wait()
            self._pinned[key] += 1
            return self._held[key]

    def release(self, key: tuple[int, int]) -> None:
        with self._cond:
            self._pinned[key] -= 1
            if self._pinned[key] <= 0:
                del self._pinned[key]
            self._cond.notify_all()

    def preload(self, key: tuple[int, int]) -> bool:
        """Load ``key`` unless held, loading, or no slot can be freed without waiting."""
        with self._cond:
            if key in self._held or key in self._loading or not self._reserve(key, wait=False):
                return False
            self.preloads += 1
            self._unused_preloads.add(key)
        self._load(key, "preload")
        return True

    def held(self) -> list[tuple[int, int]]:
        with self._cond:
            return sorted(self._held)

    def take_activity(self) -> list[tuple[str, tuple[int, int], float, float, int]]:
        with self._cond:
            out = list(self.activity)
            self.activity.clear()
        return out

    def held_bytes(self) -> int:
        with self._cond:
            return sum(self._bytes.values())


class ExpertPredictor:
    """Which experts the next MoE layer will pick, from the transitions seen between consecutive
    layers' picks (learned online, or started from an offline profile)."""

    def __init__(self, num_layers: int, num_experts: int, profile: torch.Tensor | None = None, learn: bool = True):
        shape = (max(num_layers - 1, 0), num_experts, num_experts)
        if profile is not None and tuple(profile.shape) != shape:
            raise CheckpointError(f"expert activation profile has shape {tuple(profile.shape)}, expected {shape}")
        self.transitions = profile.clone().float() if profile is not None else torch.zeros(shape)
        self.frequency = torch.zeros(num_layers, num_experts)
        self.learn = learn
        """False: the transitions stay the profile's (to measure its recall on held-out text)."""

    def observe(self, layer: int, picked: torch.Tensor, previous: torch.Tensor | None) -> None:
        """``picked``/``previous``: [tokens, k] expert indices of this layer and the one before."""
        counts = torch.bincount(picked.flatten(), minlength=self.frequency.shape[1]).float()
        self.frequency[layer] += counts
        if self.learn and previous is not None and layer >= 1 and previous.shape[0] == picked.shape[0]:
            for k in range(previous.shape[1]):
                for j in range(picked.shape[1]):
                    self.transitions[layer - 1].index_put_((previous[:, k], picked[:, j]),
                                                            torch.ones(picked.shape[0]), accumulate=True)

    def predict(self, layer: int, picked: torch.Tensor, count: int) -> list[int]:
        """The ``count`` likeliest experts of ``layer + 1`` given this layer's picks."""
        if count <= 0 or layer + 1 >= self.frequency.shape[0]:
            return []
        nxt = self.frequency[layer + 1] / (self.frequency[layer + 1].sum() + 1) * 1e-3
        rows = self.transitions[layer][picked.flatten()]
        score = rows.sum(0) / (rows.sum() + 1) + nxt
        if not bool(score.gt(0).any()):
            return []
        return [int(e) for e in torch.topk(score, min(count, score.numel())).indices if score[e] > 0]


class OffloadedExperts(nn.Module):
    """``MixtralExperts`` with its weights looked up in the buffer (no parameters of its own)."""

    def __init__(self, executor: "ExpertOffloadExecutor", layer: int, num_experts: int, act_fn):
        super().__init__()
        self.executor, self.layer, self.num_experts, self.act_fn = executor, layer, num_experts, act_fn

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        self.executor._before_layer(self.layer, top_k_index)
        buffer = self.executor.buffer
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
            expert_mask = expert_mask.permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_idx = int(expert_idx[0])
            if expert_idx == self.num_experts:
                continue
            key = (self.layer, expert_idx)
            held = buffer.acquire(key)
            try:
                gate_up_proj, down_proj = self.executor.store.weights(
                    self.executor.layer_indices[self.layer], expert_idx, held)
                top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
                current_state = hidden_states[token_idx]
                gate, up = nn.functional.linear(current_state, gate_up_proj).chunk(2, dim=-1)
                current_hidden_states = self.act_fn(gate) * up
                current_hidden_states = nn.functional.linear(current_hidden_states, down_proj)
                current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
                final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
            finally:
                buffer.release(key)
        return final_hidden_states


class ExpertOffloadExecutor(StageExecutor):
    """A Mixtral stage (units [start, end)) with resident non-expert weights and experts on storage."""

    def __init__(self, model_dir: str, start: int, end: int, *, dtype: str = "float32", threads: int | None = None,
                 progress=None, kv=None, slots: int | None = None, policy: str | None = None,
                 preload: int | None = None, bandwidth_bps: float | None = None, whole_layers: bool = False,
                 learn: bool = True, options: OffloadOptions | None = None, budget=None):
        self._profile_file = options is None or PROFILE_FILE in dict(options.files)
        if options is not None:  # an agent's load message: everything the stage reads, hashes checked
            check_files(model_dir, options.files)
        options = options.settings() if options is not None else _options_file(model_dir)
        self.slots = int(slots if slots is not None else options.get("slots", 4))
        self.policy = str(policy if policy is not None else options.get("policy", "edgemoe"))
        self.preload_count = int(preload if preload is not None else options.get("preload", 1))
        bandwidth = bandwidth_bps if bandwidth_bps is not None else options.get("bandwidth_bps")
        self.whole_layers = bool(whole_layers or options.get("whole_layers", False))
        self._expert_bits = _expert_bits(options.get("expert_bits", {}), model_dir)
        self._learn = learn
        if self.preload_count < 0:
            raise CheckpointError(f"preload must be >= 0 experts per layer (got {self.preload_count})")
        self._offloaded: list[OffloadedExperts] = []
        self._bandwidth = bandwidth
        self._previous_pick: torch.Tensor | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._io_errors: list[BaseException] = []
        self._predicted: dict[int, set[int]] = {}
        self.recall_hits = self.recall_total = 0
        super().__init__(model_dir, start, end, dtype=dtype, threads=threads, progress=progress, kv=kv, budget=budget)
        if not self._offloaded:
            raise CheckpointError(f"units [{start}, {end}) hold no MoE block: load them as kind 'layers'")
        # the thread holds the queue and buffer, not the executor: dropping the executor ends it (__del__)
        self._io = threading.Thread(target=_preload_loop, args=(self._queue, self.buffer, self._io_errors),
                                    name="expert-preload", daemon=True)
        self._io.start()

    # ----- loading: everything but the experts -------------------------------------------
    def _block_state(self, layer, reader, key_prefix, global_index):
        if self.family != "mixtral":
            raise CheckpointError(f"{self.model_dir}: expert offloading needs a Mixtral (MoE) model, "
                                  f"not {self.family}")
        if not self._offloaded:
            self.num_experts = int(self._config.num_local_experts)
            block_prefix = key_prefix[: -len(f"{global_index}.")]
            c = self._config
            shapes = ((2 * int(c.intermediate_size), int(c.hidden_size)), (int(c.hidden_size), int(c.intermediate_size)))
            self.store = ExpertStore(self.model_dir, block_prefix, self.dtype, self._bandwidth, self._expert_bits, shapes)
            store, indices = self.store, list(self.layer_indices)
            self.buffer = ExpertBuffer(self.slots, lambda local, expert: store.read(indices[local], expert),
                                       len(self.layer_indices), self.policy)
            self.predictor = ExpertPredictor(len(self.layer_indices), self.num_experts,
                                             _profile(self.model_dir, self.layer_indices) if self._profile_file
                                             else None, learn=self._learn)
        local = len(self._offloaded)
        layer.mlp.experts = OffloadedExperts(self, local, self.num_experts, layer.mlp.experts.act_fn)
        self._offloaded.append(layer.mlp.experts)
        names = [n for n in reader.with_prefix(key_prefix) if ".experts." not in n]
        raw = reader.read(names, self.dtype)
        return {n[len(key_prefix):].replace("block_sparse_moe.", "mlp.", 1): t for n, t in raw.items()}

    # ----- preloading ----------------------------------------------------------------------
    def _before_layer(self, local_layer: int, picked: torch.Tensor) -> None:
        """The router of ``local_layer`` has picked: learn from it and queue the next layer's likeliest."""
        if self._io_errors:
            raise CheckpointError(f"reading experts failed: {self._io_errors[0]}")
        self.predictor.observe(local_layer, picked, self._previous_pick if local_layer > 0 else None)
        self._previous_pick = picked
        predicted = self._predicted.pop(local_layer, None)
        if predicted is not None:  # recall: of the experts this layer picked, how many were predicted
            actual = set(picked.flatten().tolist())
            self.recall_hits += len(actual & predicted)
            self.recall_total += len(actual)
        if self.whole_layers:  # STI-like: stream the next layer's every expert, no expert awareness
            experts = list(range(self.num_experts)) if local_layer + 1 < len(self._offloaded) else []
        else:
            experts = self.predictor.predict(local_layer, picked, self.preload_count)
        if experts:
            self._predicted[local_layer + 1] = set(experts)
        for expert in experts:
            self._queue.put((local_layer + 1, expert))

    def close(self) -> None:
        self._queue.put(None)

    def __del__(self):
        try:
            self._queue.put(None)
        except Exception:
            pass

    # ----- what the agent reports --------------------------------------------------------
    def take_events(self) -> list[tuple[str, float, float, int, str]]:
        """The buffer's activity since the last call as the agent's ``io`` events: (kind, start, end,
        bytes, peer) with the checkpoint's block index in ``peer`` (agents.protocol.expert_activity)."""
        return [("io", start, end, nbytes, expert_activity(self.layer_indices[layer], expert, outcome))
                for outcome, (layer, expert), start, end, nbytes in self.buffer.take_activity()]

    def expert_bytes(self) -> int:
        """Bytes of one expert as held in the buffer."""
        c = self._config
        return 3 * int(c.hidden_size) * int(c.intermediate_size) * self.dtype.itemsize

    def _resident_names(self, block_names: list[str]) -> list[str]:
        return [n for n in block_names if ".experts." not in n]

    def _planned_buffer_bytes(self) -> int:
        return self.slots * self.expert_bytes()

    def resident_bytes(self) -> int:
        return super().memory_bytes()

    def memory_bytes(self) -> int:
        """Resident weights plus the full expert buffer: what the stage may hold at most."""
        return self.resident_bytes() + self.slots * self.expert_bytes()

    def stats(self) -> dict:
        b = self.buffer
        lookups = b.hits + b.misses
        return {
            "slots": self.slots, "policy": self.policy, "hits": b.hits, "misses": b.misses,
            "hit_rate": b.hits / lookups if lookups else 0.0, "preloads": b.preloads,
            "preload_hits": b.preload_hits, "evictions": b.evictions, "bytes_read": self.store.bytes_read,
            "read_s": self.store.read_s,
            "predictor_recall": self.recall_hits / self.recall_total if self.recall_total else None, "peak_slots": b.peak_slots, "peak_expert_bytes": b.peak_bytes,
        }


def _preload_loop(keys: queue.SimpleQueue, buffer: ExpertBuffer, errors: list) -> None:
    """The I/O thread: load queued experts into free (or freeable) slots until a None arrives."""
    while True:
        key = keys.get()
        if key is None:
            return
        try:
            buffer.preload(key)
        except Exception as err:  # surfaced on the next layer's compute
            errors.append(err)


def _options_file(model_dir: str) -> dict:
    path = Path(model_dir) / OPTIONS_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as err:
        raise CheckpointError(f"{path}: not valid JSON ({err}); rewrite it with edgeshard's expert-offload plan") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object of options")
    return data


def _expert_bits(raw, model_dir: str) -> dict[tuple[int, int], int]:
    """``{"block.expert": bits}`` from the options file, checked."""
    out = {}
    try:
        for key, bits in dict(raw).items():
            layer, expert = (int(x) for x in str(key).split("."))
            if bits not in BIT_WIDTHS:
                raise ValueError(f"bits {bits!r}")
            out[(layer, expert)] = int(bits)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{model_dir}/{OPTIONS_FILE}: expert_bits must map 'block.expert' to one of "
                              f"{BIT_WIDTHS} ({err})") from None
    return out


def _profile(model_dir: str, layer_indices: list[int]) -> torch.Tensor | None:
    """The offline activation profile (``expert-profile.safetensors``: transitions [L-1, E, E]) sliced
    to this stage's blocks, or None to learn transitions online."""
    path = Path(model_dir) / PROFILE_FILE
    if not path.is_file() or not layer_indices:
        return None
    from safetensors.torch import load_file

    full = load_file(str(path))["transitions"]
    return full[layer_indices[0]: layer_indices[-1]]




# ----- per-expert bit widths (EdgeMoE's expert-wise bit-width adaptation) ----------------------


def quantize_per_channel(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric linear quantisation per output channel (scale from the row's max |w|): codes packed
    ``8 // bits`` to a byte (uint8) and the fp32 scales."""
    if bits not in BIT_WIDTHS:
        raise CheckpointError(f"expert bit width {bits} is not one of {BIT_WIDTHS}")
    qmax = 2 ** (bits - 1) - 1 if bits > 2 else 1
    scale = weight.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12) / qmax
    codes = torch.round(weight.float() / scale).clamp(-qmax, qmax).to(torch.int16) + qmax  # 0..2·qmax
    codes = codes.to(torch.uint8).flatten()
    per = 8 // bits
    pad = (-codes.numel()) % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    codes = codes.view(-1, per)
    packed = torch.zeros(codes.shape[0], dtype=torch.uint8)
    for i in range(per):
        packed |= codes[:, i] << (i * bits)
    return packed, scale.squeeze(1)


def dequantize_per_channel(packed: torch.Tensor, scale: torch.Tensor, bits: int, shape: tuple[int, int]) -> torch.Tensor:
    qmax = 2 ** (bits - 1) - 1 if bits > 2 else 1
    per = 8 // bits
    mask = (1 << bits) - 1
    codes = torch.stack([(packed >> (i * bits)) & mask for i in range(per)], dim=1).flatten()[: shape[0] * shape[1]]
    return (codes.to(torch.float32) - qmax).view(shape) * scale[:, None]


def write_quantized_experts(model_dir: str, bits_of: dict[tuple[int, int], int]) -> Path:
    """Store the experts named in ``bits_of`` ((block, expert) -> 2/4/8) quantised beside the checkpoint,
    and their bit widths in ``expert-offload.json`` (others stay full precision)."""
    from safetensors.torch import save_file

    store = ExpertStore(model_dir, "model.layers.", torch.float32)
    tensors: dict[str, torch.Tensor] = {}
    for (layer, expert), bits in sorted(bits_of.items()):
        for name, weight in zip(("gate_up", "down"), store.read(layer, expert)):
            packed, scale = quantize_per_channel(weight, bits)
            tensors[f"{layer}.{expert}.{name}.codes"] = packed
            tensors[f"{layer}.{expert}.{name}.scale"] = scale.contiguous()
    path = Path(model_dir) / QUANTIZED_FILE
    save_file(tensors, str(path))
    options = _options_file(model_dir)
    options["expert_bits"] = {f"{layer}.{expert}": bits for (layer, expert), bits in sorted(bits_of.items())}
    (Path(model_dir) / OPTIONS_FILE).write_text(json.dumps(options, indent=1))
    return path
