"""What a weight precision costs the model's quality and its decode time, measured once per model.

The planner may give each device its own weight precision (core.planning.precision) within an
operator's quality bound, the largest relative perplexity increase over fp allowed (as EdgeMoE
bounds its bit widths' accuracy loss). The perplexity of each precision is measured once, on
held-out text, with the whole model in one process at that precision (the agents' own stage code,
``agents.shard.StageExecutor``, so the numbers are of the weights a stage really holds), and stored
in the model's profile (``Profile.weight_quality``). So are the decode and prefill times of the
decoder blocks at that precision over fp on the machine that measured them: the planner scales a
device's block times by these ratios unless the device's own were profiled (``DevicePrecisionTimes``).
"""

from __future__ import annotations

import math
import time

import msgspec

from core.reporting import NullReporter, Reporter

MEASURED_PRECISIONS = ("fp", "int8", "int4")


class PrecisionQuality(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    weights: str
    """``fp`` (the profile's dtype), ``int8`` or ``int4`` (core.planning.plan.WEIGHT_PRECISIONS)."""
    perplexity: float
    """On the held-out text ``text`` names."""
    decode_time_ratio: float = 1.0
    """A decode step of the decoder blocks at this precision over at fp (> 1: slower)."""
    prefill_time_ratio: float = 1.0
    """The same for a prompt's prefill."""
    text: str = ""
    """What the perplexity was measured on (lines, tokens, where from)."""


class DevicePrecisionTimes(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One device's own decoder-block time at a weight precision over its time at fp, measured on that
    device by its agent's profiler (``edgeshard profile --weight-times``): int8 may be faster on one CPU and
    slower on another, so a device that has them is costed by them, not by ``PrecisionQuality``'s ratios
    (measured on the machine that ran ``measure-precision``)."""

    device: str
    weights: str
    """``int8`` or ``int4``."""
    decode_time_ratio: float
    prefill_time_ratio: float


def device_times_errors(entries, devices, path: str = "$.precision_times") -> list[str]:
    """Every inconsistency of a profile's per-device precision times (empty: none)."""
    out, seen = [], set()
    for i, t in enumerate(entries):
        if t.device not in devices:
            out.append(f"{path}[{i}].device: unknown device {t.device!r}")
        if t.weights not in MEASURED_PRECISIONS[1:]:
            out.append(f"{path}[{i}].weights: one of {', '.join(MEASURED_PRECISIONS[1:])}, not {t.weights!r}")
        if (t.device, t.weights) in seen:
            out.append(f"{path}[{i}]: {t.device} at {t.weights} is measured twice")
        seen.add((t.device, t.weights))
        for name in ("decode_time_ratio", "prefill_time_ratio"):
            v = getattr(t, name)
            if not (v > 0) or v == math.inf:
                out.append(f"{path}[{i}].{name}: must be finite and positive")
    return out


def quality_errors(entries, path: str = "$.weight_quality") -> list[str]:
    """Every inconsistency of a profile's weight-quality entries (empty: none)."""
    out = []
    seen = set()
    for i, q in enumerate(entries):
        if q.weights not in MEASURED_PRECISIONS:
            out.append(f"{path}[{i}].weights: one of {', '.join(MEASURED_PRECISIONS)}, not {q.weights!r}")
        if q.weights in seen:
            out.append(f"{path}[{i}].weights: {q.weights} is measured twice")
        seen.add(q.weights)
        for name in ("perplexity", "decode_time_ratio", "prefill_time_ratio"):
            v = getattr(q, name)
            if not (v > 0) or v == math.inf:
                out.append(f"{path}[{i}].{name}: must be finite and positive")
    if seen and "fp" not in seen:
        out.append(f"{path}: needs the fp entry the others are compared with")
    return out


def perplexity(executor, texts: list[list[int]]) -> float:
    """Perplexity of a whole-model stage on token sequences, teacher-forced one token at a time
    (prefill the first token, decode the rest: the path a run takes)."""
    import torch

    nll, count = 0.0, 0
    with torch.inference_mode():
        for ids in texts:
            if len(ids) < 2:
                continue
            x = torch.tensor([ids], dtype=torch.long)
            logits = executor.prefill(0, x[:, :1], torch.ones((1, 1), dtype=torch.long))
            for t in range(1, len(ids)):
                nll -= float(torch.log_softmax(logits.float(), dim=-1)[0, ids[t]])
                count += 1
                if t + 1 < len(ids):
                    logits = executor.decode(0, x[:, t:t + 1])
            executor.drop(0)
    if not count:
        raise ValueError("perplexity needs at least one text of 2 tokens or more")
    return math.exp(nll / count)


def _block_times(blocks, hidden, steps: int) -> tuple[float, float]:
    """(prefill s, decode s per step) of a stage of the decoder blocks alone, batch 1."""
    import torch

    with torch.inference_mode():
        t0 = time.perf_counter()
        blocks.prefill(0, hidden, torch.ones(hidden.shape[:2], dtype=torch.long))
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(steps):
            blocks.decode(0, hidden[:, i % hidden.shape[1]:][:, :1])
        decode = (time.perf_counter() - t0) / steps
        blocks.drop(0)
    return prefill, decode


def measure_weight_quality(model_dir: str, texts: list[list[int]], precisions=MEASURED_PRECISIONS, *,
                           dtype: str = "float32", timing_steps: int = 16, timing_prompt: int = 32, rounds: int = 3,
                           text_note: str = "", reporter: Reporter | None = None) -> tuple[PrecisionQuality, ...]:
    """Perplexity on ``texts`` (token ids) and time ratios over fp of each precision, the whole model
    in this process as one stage per precision. Times: the best of ``rounds`` rounds, the precisions
    interleaved in each (a busy host slows them alike)."""
    from agents.shard import StageExecutor

    reporter = reporter or NullReporter()
    if "fp" not in precisions:
        precisions = ("fp", *precisions)
    import json
    from pathlib import Path

    import torch

    layers = int(json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"])
    ppl, blocks = {}, {}
    for i, w in enumerate(precisions):
        reporter.status(f"perplexity at {w} weights")
        reporter.progress(i, len(precisions) + 1)
        ppl[w] = perplexity(StageExecutor(model_dir, 0, layers + 2, dtype=dtype, weights=w), texts)
        blocks[w] = StageExecutor(model_dir, 1, layers + 1, dtype=dtype, weights=w)
    reporter.status("decode and prefill times per precision")
    first = blocks["fp"]
    hidden = torch.randn((1, timing_prompt, first.hidden_size), generator=torch.Generator().manual_seed(0),
                         dtype=first.dtype)
    best = {w: (math.inf, math.inf) for w in precisions}
    for _ in range(rounds):
        for w in precisions:
            p, d = _block_times(blocks[w], hidden, timing_steps)
            best[w] = (min(best[w][0], p), min(best[w][1], d))
    reporter.progress(len(precisions) + 1, len(precisions) + 1)
    tokens = sum(len(t) for t in texts)
    note = text_note or f"{len(texts)} texts, {tokens} tokens"
    return tuple(PrecisionQuality(weights=w, perplexity=ppl[w], decode_time_ratio=best[w][1] / best["fp"][1],
                                  prefill_time_ratio=best[w][0] / best["fp"][0], text=note)
                 for w in precisions)
