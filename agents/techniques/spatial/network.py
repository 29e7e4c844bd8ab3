"""CNN spatial partitioning (EdgeMI), the agent side: networks, strip geometry, strip compute.

A convolution layer's output is cut into vertical strips (column ranges), one per device.
A strip through a group of consecutive layers needs a wider input strip (the halo columns
its kernels reach); the gateway cuts that from the full map and the worker computes its
strip through the whole group, recomputing the halo's columns in the inner layers (a fused
tile) instead of exchanging them after every layer. Everything here is plain data and pure
torch so the agent ships it alone; core.techniques.spatial imports the geometry for its
cost model so the plan and the agent cannot disagree on a halo.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from agents.protocol import ConvSweepOptions, ConvTimings

LayerKind = Literal["conv", "pool", "res"]

BYTES_PER_VALUE = 4
"""Activations travel and are computed as float32."""


@dataclass(frozen=True)
class Layer:
    """One spatial layer: a k×k same-padded conv (+ReLU), a 2×2/2 max pool, or a basic
    residual block (two 3×3 convs, identity skip, same channels)."""

    kind: LayerKind
    c_in: int
    c_out: int
    h_in: int
    w_in: int
    k: int = 3

    @property
    def h_out(self) -> int:
        return self.h_in // 2 if self.kind == "pool" else self.h_in

    @property
    def w_out(self) -> int:
        return self.w_in // 2 if self.kind == "pool" else self.w_in

    def flops(self, out_cols: int | None = None) -> float:
        """FLOPs for ``out_cols`` output columns (all by default): 2·H·W·(C_in·K²+1)·C_out per conv."""
        w = self.w_out if out_cols is None else out_cols
        if self.kind == "conv":
            return 2.0 * self.h_out * w * (self.c_in * self.k * self.k + 1) * self.c_out
        if self.kind == "res":
            return 2 * 2.0 * self.h_out * w * (self.c_in * 9 + 1) * self.c_out + self.h_out * w * self.c_out
        return float(self.h_out * w * self.c_out * 4)

    def param_bytes(self) -> int:
        if self.kind == "conv":
            return (self.c_in * self.k * self.k + 1) * self.c_out * BYTES_PER_VALUE
        if self.kind == "res":
            return 2 * (self.c_in * 9 + 1) * self.c_out * BYTES_PER_VALUE
        return 0

    def out_bytes(self, cols: int | None = None) -> int:
        return self.c_out * self.h_out * (self.w_out if cols is None else cols) * BYTES_PER_VALUE

    def in_bytes(self, cols: int | None = None) -> int:
        return self.c_in * self.h_in * (self.w_in if cols is None else cols) * BYTES_PER_VALUE

    def needs(self, lo: int, hi: int) -> tuple[int, int]:
        """Input columns [lo', hi') that output columns [lo, hi) read, clipped to the map."""
        if hi <= lo:
            return (0, 0)
        if self.kind == "pool":
            return (2 * lo, 2 * hi)
        reach = 2 if self.kind == "res" else self.k // 2
        return (max(0, lo - reach), min(self.w_in, hi + reach))


@dataclass(frozen=True)
class CnnSpec:
    """A CNN as spatial layers then a head (global max pool to 1×1 or flatten, then FC layers)."""

    name: str
    image: int
    layers: tuple[Layer, ...]
    head_in: int
    """Features entering the head (flattened)."""
    fc: tuple[int, ...]
    """Widths of the fully connected layers (the last is the class count)."""
    flatten: bool
    """VGG flattens the last map; the ResNet-style net averages it to 1×1 first."""

    def head_flops(self) -> float:
        dims = (self.head_in, *self.fc)
        return float(sum(2 * a * b for a, b in zip(dims, dims[1:])))

    def head_param_bytes(self) -> int:
        dims = (self.head_in, *self.fc)
        return sum((a + 1) * b for a, b in zip(dims, dims[1:])) * BYTES_PER_VALUE


def vgg16(image: int = 224, width_div: int = 1, classes: int = 1000) -> CnnSpec:
    """VGG16 (13 convs, 5 pools, 3 FC); ``width_div`` divides every channel count (small test nets)."""
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
    layers, c, s = [], 3, image
    for v in cfg:
        if v == "M":
            layers.append(Layer("pool", c, c, s, s))
            s //= 2
        else:
            out = max(1, v // width_div)
            layers.append(Layer("conv", c, out, s, s))
            c = out
    hidden = max(1, 4096 // width_div)
    return CnnSpec(name=f"vgg16-{image}" + (f"-w{width_div}" if width_div > 1 else ""), image=image,
                   layers=tuple(layers), head_in=c * s * s, fc=(hidden, hidden, classes), flatten=True)


def resnet_style(image: int = 224, width_div: int = 1, classes: int = 1000) -> CnnSpec:
    """A ResNet-18-like net without strided convs: 7×7 stem conv, pools, two basic blocks per
    stage (the channel change is a 1×1 conv), global average pool, one FC layer."""
    c0 = max(1, 64 // width_div)
    layers = [Layer("conv", 3, c0, image, image, k=7), Layer("pool", c0, c0, image, image)]
    c, s = c0, image // 2
    for stage, width in enumerate((64, 128, 256, 512)):
        out = max(1, width // width_div)
        if stage:
            layers.append(Layer("pool", c, c, s, s))
            s //= 2
            layers.append(Layer("conv", c, out, s, s, k=1))
            c = out
        layers += [Layer("res", c, c, s, s), Layer("res", c, c, s, s)]
    return CnnSpec(name=f"resnet-style-{image}" + (f"-w{width_div}" if width_div > 1 else ""), image=image,
                   layers=tuple(layers), head_in=c, fc=(classes,), flatten=False)


NETWORKS = {"vgg16": vgg16, "resnet-style": resnet_style}


def group_input_ranges(layers: Sequence[Layer], lo: int, hi: int) -> list[tuple[int, int]]:
    """For output columns [lo, hi) of the group's last layer, the column range each layer of the
    group must produce, first layer's input first: ``[in0, out0, out1, ..., out_last]``."""
    ranges = [(lo, hi)]
    for layer in reversed(layers):
        ranges.append(layer.needs(*ranges[-1]))
    return ranges[::-1]


def strip_bounds(widths: Sequence[int]) -> list[tuple[int, int]]:
    """Column ranges [lo, hi) of consecutive strips of these widths, left to right."""
    out, lo = [], 0
    for w in widths:
        out.append((lo, lo + w))
        lo += w
    return out


# --- torch: the network with generated weights and strip compute ----------------------

def build_network(spec: CnnSpec, seed: int = 0):
    """The network's parameters, generated from ``seed`` (He-scaled so activations stay O(1))."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def conv(c_in, c_out, k):
        w = torch.randn(c_out, c_in, k, k, generator=g).mul_((2.0 / (c_in * k * k)) ** 0.5)  # in place: no 2nd copy
        return w, torch.randn(c_out, generator=g) * 0.01

    params = []
    for layer in spec.layers:
        if layer.kind == "conv":
            params.append([conv(layer.c_in, layer.c_out, layer.k)])
        elif layer.kind == "res":
            params.append([conv(layer.c_in, layer.c_out, 3), conv(layer.c_out, layer.c_out, 3)])
        else:
            params.append([])
    dims = (spec.head_in, *spec.fc)
    head = [(torch.randn(b, a, generator=g).mul_((2.0 / a) ** 0.5), torch.zeros(b)) for a, b in zip(dims, dims[1:])]
    return SpatialNet(spec, params, head)


def max_pool_2x2(x):
    """A 2×2, stride-2 max pool (an odd last row or column dropped, as ``F.max_pool2d``'s): the
    elementwise maximum of the four strided quarters, equal to ``F.max_pool2d(x, 2)`` bit for bit.
    torch 2.13's own CPU kernel took 9–14× as long on one thread (0.75 ms against 0.08 ms for
    32 channels × 96 × 48) and grew faster than the bytes it reads, so max pools cost 2–3× what
    the time model's per-byte rate predicted."""
    import torch

    h, w = x.shape[-2] // 2 * 2, x.shape[-1] // 2 * 2
    x = x[..., :h, :w]
    return torch.maximum(torch.maximum(x[..., 0::2, 0::2], x[..., 0::2, 1::2]),
                         torch.maximum(x[..., 1::2, 0::2], x[..., 1::2, 1::2]))


class SpatialNet:
    """A CNN whose spatial layers can run on a column strip (with halo) of their input."""

    def __init__(self, spec: CnnSpec, params, head):
        self.spec = spec
        self.params = params
        self.head_params = head

    @staticmethod
    def _conv_cols(x, w, b, lo: int, hi: int, width: int, x_lo: int):
        """Output columns [lo, hi) of a same-padded stride-1 conv whose input ``x`` holds columns
        [x_lo, x_lo + x.shape[-1]) of a map ``width`` wide: zeros only beyond the map's real edges."""
        import torch.nn.functional as F

        p = w.shape[-1] // 2
        a, z = lo - p, hi + p
        xs = x[..., max(0, a) - x_lo: min(width, z) - x_lo]
        xs = F.pad(xs, (max(0, -a), max(0, z - width), 0, 0))
        return F.conv2d(xs, w, b, padding=(p, 0))

    def layer_cols(self, i: int, x, x_lo: int, lo: int, hi: int):
        """Layer ``i``'s output columns [lo, hi) from its input columns starting at ``x_lo``."""
        import torch
        import torch.nn.functional as F

        layer = self.spec.layers[i]
        if layer.kind == "pool":
            return max_pool_2x2(x[..., 2 * lo - x_lo: 2 * hi - x_lo])
        if layer.kind == "conv":
            (w, b), = self.params[i]
            return torch.relu(self._conv_cols(x, w, b, lo, hi, layer.w_in, x_lo))
        (w1, b1), (w2, b2) = self.params[i]
        m_lo, m_hi = max(0, lo - 1), min(layer.w_in, hi + 1)
        mid = torch.relu(self._conv_cols(x, w1, b1, m_lo, m_hi, layer.w_in, x_lo))
        out = self._conv_cols(mid, w2, b2, lo, hi, layer.w_in, m_lo)
        return torch.relu(out + x[..., lo - x_lo: hi - x_lo])

    def strip(self, start: int, end: int, x, x_lo: int, lo: int, hi: int):
        """Layers [start, end) on an input strip starting at column ``x_lo``: output columns [lo, hi)
        of layer end-1 (the inner layers compute the halo columns the next ones read)."""
        ranges = group_input_ranges(self.spec.layers[start:end], lo, hi)
        for i, (a, b) in zip(range(start, end), ranges[1:]):
            x = self.layer_cols(i, x, x_lo, a, b)
            x_lo = a
        return x

    def head(self, x):
        import torch

        x = x.flatten(1) if self.spec.flatten else x.mean(dim=(2, 3))
        for j, (w, b) in enumerate(self.head_params):
            x = x @ w.T + b
            if j < len(self.head_params) - 1:
                x = torch.relu(x)
        return x

    def forward(self, x):
        """The whole network on one device with torch's own padded convs (not the strip code):
        the reference every partition must equal."""
        import torch
        import torch.nn.functional as F

        for layer, params in zip(self.spec.layers, self.params):
            if layer.kind == "pool":
                x = F.max_pool2d(x, 2)
            elif layer.kind == "conv":
                (w, b), = params
                x = torch.relu(F.conv2d(x, w, b, padding=layer.k // 2))
            else:
                (w1, b1), (w2, b2) = params
                x = torch.relu(F.conv2d(torch.relu(F.conv2d(x, w1, b1, padding=1)), w2, b2, padding=1) + x)
        return self.head(x)

    def tensors(self) -> list:
        """Every weight and bias, layers first then the head (``weight_names``' order)."""
        return [t for group in self.params for pair in group for t in pair] + \
            [t for pair in self.head_params for t in pair]

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def run_partitioned(net: SpatialNet, x, groups: Sequence[tuple[int, int]],
                    widths: Sequence[Sequence[int]]):
    """Scatter/compute/gather in one process: for each group, every strip is cut with its halo
    from the gathered map, computed alone, and the strips are concatenated. The same cuts the
    gateway makes over the wire; tests compare it with ``net.forward``."""
    import torch

    for (start, end), ws in zip(groups, widths):
        layers = net.spec.layers[start:end]
        strips = []
        for lo, hi in strip_bounds(ws):
            if hi <= lo:
                continue
            a, b = group_input_ranges(layers, lo, hi)[0]
            strips.append(net.strip(start, end, x[..., a:b], a, lo, hi))
        x = torch.cat(strips, dim=-1)
    return net.head(x)


def conv_timing_samples(sizes: Sequence[int] = (8, 16, 24, 32, 48, 64), channels: Sequence[int] = (16, 32),
                        repeats: int = 5, threads: int | None = None) -> list[tuple[float, float]]:
    """(FLOPs, seconds) of 3×3 conv layers over map sizes on this device, timed through the path
    a strip really takes (``compute_strip``: bytes → tensor, padded conv + ReLU, → bytes), so the
    fitted b holds the per-request work too. Each shape is warmed up first (oneDNN builds a
    kernel per shape) and timed over enough calls to last ~2 ms; the best of ``repeats`` is
    kept (the device's speed, not its neighbours' noise)."""
    items = [(Layer("conv", c, c, s, s), 0, s) for c in channels for s in sizes]
    return [(layer.flops(), t) for (layer, _, _), t in zip(items, _timing_samples(items, repeats, threads))]


STRIP_SHAPES: tuple[tuple[Layer, int, int], ...] = (
    (Layer("conv", 3, 32, 64, 64), 0, 64),
    (Layer("conv", 16, 16, 32, 32), 15, 16),
    (Layer("conv", 16, 16, 32, 32), 14, 18),
    (Layer("conv", 64, 64, 16, 16), 7, 8),
    (Layer("conv", 64, 64, 16, 16), 6, 10),
    (Layer("conv", 128, 128, 12, 12), 5, 7),
    (Layer("conv", 128, 128, 12, 12), 0, 12),
    (Layer("conv", 256, 256, 6, 6), 2, 4),
    (Layer("conv", 256, 256, 6, 6), 0, 6),
    (Layer("conv", 256, 256, 12, 12), 0, 12),
    (Layer("pool", 32, 32, 64, 64), 12, 20),
    (Layer("pool", 32, 32, 64, 64), 0, 32),
    (Layer("pool", 128, 128, 24, 24), 0, 12),
    (Layer("pool", 64, 64, 96, 96), 0, 48),
    (Layer("conv", 32, 32, 96, 96), 0, 96),
)
"""Layer strips (layer, output columns [lo, hi)) timed besides the swept convs so the per-layer
model's terms separate: narrow strips and small maps with many channels (a call's cost grows
with the layer's weights, not its FLOPs: 1 column of a 256-channel 6×6 conv costs ~8× its FLOPs
at the full map's rate), the first layer's 3 input channels, maps beyond the caches, and max
pools (bound by the bytes they read: ~100× what their FLOPs at conv speed say)."""


def layer_features(layer: Layer, in_cols: int, out_cols: int) -> tuple[float, float, float]:
    """What the per-layer time model counts for a strip: (FLOPs, weight bytes read per call,
    activation bytes read and written)."""
    return (layer.flops(out_cols), float(layer.param_bytes()),
            float(layer.in_bytes(in_cols) + layer.out_bytes(out_cols)))


def layer_timing_samples(sizes: Sequence[int] = (8, 16, 24, 32, 48, 64), channels: Sequence[int] = (16, 32),
                         repeats: int = 5, threads: int | None = None
                         ) -> list[tuple[float, float, float, float]]:
    """(FLOPs, weight bytes, activation bytes, seconds) of one-layer strips through the strip path
    (``compute_strip``): the swept 3×3 convs (whole maps) and ``STRIP_SHAPES``."""
    items = [(Layer("conv", c, c, s, s), 0, s) for c in channels for s in sizes] + list(STRIP_SHAPES)
    out = []
    for (layer, lo, hi), t in zip(items, _timing_samples(items, repeats, threads)):
        a, b = layer.needs(lo, hi)
        out.append((*layer_features(layer, b - a, hi - lo), t))
    return out


def fc_timing_samples(widths: Sequence[int] = (256, 512, 1024, 2048), repeats: int = 5,
                      threads: int | None = None) -> list[tuple[float, float]]:
    """(FLOPs, seconds) of square fully connected layers: the head is bound by reading its
    weights, not by FLOPs like a conv, so it gets its own y = a·x + b."""
    import time

    import torch

    if threads:
        torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(2)
    out = []
    with torch.inference_mode():
        for n in widths:
            w, x = torch.randn(n, n, generator=g), torch.randn(1, n, generator=g)
            best = float("inf")
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                x @ w.T
                best = min(best, time.perf_counter() - t0)
            out.append((2.0 * n * n, best))
    return out


def _timing_samples(items: Sequence[tuple[Layer, int, int]], repeats: int, threads: int | None) -> list[float]:
    """Seconds per call of each (layer, lo, hi): output columns [lo, hi) of one layer from exactly
    the input columns they need, through ``compute_strip``."""
    import time

    import torch

    if threads:
        torch.set_num_threads(threads)
    out = []
    for layer, lo, hi in items:
        spec = CnnSpec(name="timing", image=layer.h_in, layers=(layer,), head_in=1, fc=(1,), flatten=True)
        net = build_network(spec, seed=1)
        a, b = layer.needs(lo, hi)
        x = torch.randn(1, layer.c_in, layer.h_in, b - a, generator=torch.Generator().manual_seed(1))
        data, shape = x.numpy().tobytes(), tuple(x.shape)
        t0, calls = time.perf_counter(), 0
        while calls < 3 or time.perf_counter() - t0 < 2e-3:
            compute_strip(net, 0, 1, a, lo, hi, shape, data)
            calls += 1
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                compute_strip(net, 0, 1, a, lo, hi, shape, data)
            best = min(best, (time.perf_counter() - t0) / calls)
        out.append(best)
    return out


def network_for(network: str, image: int, width_div: int, classes: int, seed: int, weights: str = "") -> SpatialNet:
    """The network a ``ComputeStrip`` or ``SpatialSetup`` names (the coordinator builds the same one):
    generated from ``seed``, or read from the safetensors file ``weights`` (a trained one)."""
    if network not in NETWORKS:
        raise ValueError(f"unknown network {network!r}; this agent has: {', '.join(NETWORKS)}")
    spec = NETWORKS[network](image, width_div, classes)
    return load_network(spec, weights) if weights else build_network(spec, seed)


def weight_names(spec: CnnSpec) -> list[str]:
    """The tensor names of a network's weights file, in ``SpatialNet.tensors()`` order."""
    names = []
    for i, layer in enumerate(spec.layers):
        convs = 1 if layer.kind == "conv" else 2 if layer.kind == "res" else 0
        names += [f"layers.{i}.{j}.{part}" for j in range(convs) for part in ("weight", "bias")]
    dims = (spec.head_in, *spec.fc)
    names += [f"head.{j}.{part}" for j in range(len(dims) - 1) for part in ("weight", "bias")]
    return names


def load_network(spec: CnnSpec, path: str) -> SpatialNet:
    """``spec``'s network with the weights in the safetensors file ``path`` (any float dtype, computed
    in float32). A file that lacks a tensor or holds one of another shape is a ``ValueError`` naming it."""
    import torch
    from safetensors import safe_open

    net = build_network(spec, seed=0)
    with safe_open(path, framework="pt") as f:
        found = set(f.keys())
        for name, t in zip(weight_names(spec), net.tensors()):
            if name not in found:
                raise ValueError(f"{path}: no tensor {name!r} for {spec.name}")
            value = f.get_tensor(name)
            if tuple(value.shape) != tuple(t.shape):
                raise ValueError(f"{path}: {name} is {list(value.shape)}, {spec.name} needs {list(t.shape)}")
            t.copy_(value.to(torch.float32))
    return net


def compute_strip(net: SpatialNet, start: int, end: int, x_lo: int, lo: int, hi: int, shape: Sequence[int],
                  data: bytes, head: bool = False) -> tuple[tuple[int, ...], bytes]:
    """A ``ComputeStrip`` request: raw float32 bytes in, raw float32 bytes out. The strip must be
    exactly the columns its output needs (``group_input_ranges``), else ``ValueError`` says which."""
    import numpy as np
    import torch

    layers = net.spec.layers
    if end > len(layers):
        raise ValueError(f"layers [{start}, {end}) beyond the network's {len(layers)} spatial layers")
    x = torch.from_numpy(np.frombuffer(data, dtype="<f4").reshape(tuple(shape)).copy())
    n, c, h, w = x.shape
    if start < end:
        first = layers[start]
        if hi > layers[end - 1].w_out:
            raise ValueError(f"columns [{lo}, {hi}) beyond layer {end - 1}'s width {layers[end - 1].w_out}")
        need = group_input_ranges(layers[start:end], lo, hi)[0]
        if (c, h) != (first.c_in, first.h_in) or need != (x_lo, x_lo + w):
            raise ValueError(f"strip of {c}×{h}×{w} at column {x_lo} does not match layer {start}: it needs "
                             f"{first.c_in}×{first.h_in} columns [{need[0]}, {need[1]})")
        with torch.inference_mode():
            x = net.strip(start, end, x, x_lo, lo, hi)
    if head:
        last = layers[-1]
        if end != len(layers) or tuple(x.shape[1:]) != (last.c_out, last.h_out, last.w_out):
            raise ValueError("the head needs the whole last map (gather every strip first)")
        with torch.inference_mode():
            x = net.head(x)
    x = x.contiguous().float()
    return tuple(x.shape), x.numpy().astype("<f4", copy=False).tobytes()


def conv_sweep(options: ConvSweepOptions, slowdown: float = 1.0) -> ConvTimings:
    """Agent handler of a conv-sweep ``ProfileCompute`` (its options range-checked at decode,
    ``agents.protocol``): conv and FC timings; an emulated device's times are scaled by its
    slowdown, the same rule as its unit profile and its stage compute."""
    threads = options.threads or None
    layers = layer_timing_samples(options.sizes, options.channels, options.repeats, threads)
    n = len(options.sizes) * len(options.channels)  # the swept convs come first
    fc = fc_timing_samples(repeats=options.repeats, threads=threads)
    return ConvTimings(samples=tuple((flops, seconds * slowdown) for flops, _, _, seconds in layers[:n]),
                       fc_samples=tuple((flops, seconds * slowdown) for flops, seconds in fc),
                       layer_samples=tuple((f, w, m, seconds * slowdown) for f, w, m, seconds in layers))


STAGE_KIND = "spatial-strip"
