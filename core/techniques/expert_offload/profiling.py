"""EdgeMoE's offline steps, measured on a real checkpoint (``edgeshard moe profile-...``).

- ``activation_profile``: the transitions between consecutive MoE blocks' expert picks over
  calibration text (teacher-forced through the agent's own executor), saved beside the
  checkpoint as ``expert-profile.safetensors`` (what agents' predictors start from), and the
  profile's top-k recall on held-out text (the predictor frozen to the profile).
- ``storage_bandwidth``: how fast this storage reads experts: every expert of the checkpoint
  read through the agent's ``ExpertStore``, the files' cached pages dropped first
  (``posix_fadvise DONTNEED``, per file) so the reads come from the device, then once more
  from the page cache; each split into a fixed cost per read and a bandwidth for its bytes.
- ``bit_options``: EdgeMoE's bit-width adaptation: perplexity at full precision, each expert's
  importance (loss when it alone is INT2), the bound search, uniform INT4; writes the adapted
  experts (``experts-quantized.safetensors`` and ``expert_bits`` in ``expert-offload.json``).

Each writes a small JSON file the planner reads (``edgeshard moe scenario --activations
--storage --bits``). Long work reports progress and stops on cancel.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from core.errors import EdgeShardError, FormatError
from core.reporting import Cancelled, NullReporter, Reporter

PROFILE_FILE = "expert-profile.safetensors"
ACTIVATIONS_FILE = "expert-activations.json"
STORAGE_FILE = "storage-profile.json"
BITS_FILE = "expert-bits.json"


def read_texts(path: str | Path, model_dir: str | Path, minimum: int = 1) -> list[list[int]]:
    """Token ids of each non-empty line of ``path`` (2 tokens or more); refused when fewer than ``minimum``."""
    from core.runs.generation import load_tokenizer

    try:
        lines = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines()]
    except (OSError, UnicodeDecodeError) as err:
        raise FormatError(str(path), f"cannot read the text file ({err}); give a UTF-8 file, one text per line") from None
    tok = load_tokenizer(str(model_dir))
    texts = [ids for ids in (tok(line)["input_ids"] for line in lines if line) if len(ids) >= 2]
    if len(texts) < minimum:
        raise FormatError(str(path), f"has {len(texts)} usable texts (lines of 2 tokens or more); "
                                     f"need at least {minimum}")
    return texts


def require_moe(model_dir: str | Path) -> None:
    """A Mixtral checkpoint, from its config.json alone (no torch): what an entrance checks before
    it loads a tokenizer or a model."""
    from core.models.units import load_model_spec

    family = load_model_spec(model_dir).family
    if family != "mixtral":
        raise EdgeShardError(f"{model_dir} is a {family} model: expert offloading needs a Mixtral (MoE) one")


def _moe_dir(model_dir: str | Path):
    from core.models.checkpoints import check_model_dir

    require_moe(model_dir)
    return check_model_dir(model_dir)


def _executor(model_dir, info, **options):
    from agents.techniques.expert_offload.offload import ExpertOffloadExecutor

    probe = json.loads((Path(model_dir) / "config.json").read_text())
    everything = int(probe["num_hidden_layers"]) * int(probe["num_local_experts"])
    return ExpertOffloadExecutor(str(model_dir), 0, info.num_units, slots=options.pop("slots", everything), **options)


def _perplexities(executor, texts, reporter: Reporter, done: int, total: int) -> float:
    """Perplexity over ``texts`` one at a time, reporting progress (stops on cancel)."""
    from agents.techniques.expert_offload.offload import perplexity

    nll = count = 0.0
    import math

    for i, ids in enumerate(texts):
        if reporter.cancel_requested():
            raise Cancelled()
        p = perplexity(executor, [ids])
        nll += math.log(p) * (len(ids) - 1)
        count += len(ids) - 1
        reporter.progress(done + i + 1, total)
    return math.exp(nll / count)


def activation_profile(model_dir: str | Path, texts: list[list[int]], held_out: list[list[int]],
                       reporter: Reporter | None = None) -> dict:
    """Learn the transitions on ``texts``, save them beside the checkpoint, measure top-k recall on ``held_out``."""
    from safetensors.torch import save_file

    reporter = reporter or NullReporter()
    info = _moe_dir(model_dir)
    total = len(texts) + len(held_out)
    reporter.status(f"profiling expert activations on {len(texts)} calibration texts")
    learner = _executor(model_dir, info, preload=0)
    try:
        _perplexities(learner, texts, reporter, 0, total)
        transitions = learner.predictor.transitions.contiguous()
        frequency = learner.predictor.frequency
    finally:
        learner.close()
    save_file({"transitions": transitions}, str(Path(model_dir) / PROFILE_FILE))
    k = int(json.loads((Path(model_dir) / "config.json").read_text()).get("num_experts_per_tok", 2))
    reporter.status(f"measuring the profile's top-{k} recall on {len(held_out)} held-out texts")
    recall = profile_recall(model_dir, held_out, reporter, len(texts), total)
    result = {"format": "edgeshard.expert-activations", "version": 1, "top_k": k,
              "recall": recall, "calibration_texts": len(texts), "held_out_texts": len(held_out),
              "calibration_tokens": sum(len(t) for t in texts),
              "activations": [[int(c) for c in row] for row in frequency.tolist()]}
    (Path(model_dir) / ACTIVATIONS_FILE).write_text(json.dumps(result, indent=1))
    return result


def profile_recall(model_dir: str | Path, texts: list[list[int]], reporter: Reporter | None = None, done: int = 0,
                   total: int | None = None) -> float | None:
    """The saved profile's top-k recall on ``texts``, frozen (it learns nothing from them): out of sample on
    held-out texts, in sample on the calibration texts it was learnt on (bench/expert_offload.py reports both)."""
    info = _moe_dir(model_dir)
    k = int(json.loads((Path(model_dir) / "config.json").read_text()).get("num_experts_per_tok", 2))
    frozen = _executor(model_dir, info, preload=k, learn=False)
    try:
        _perplexities(frozen, texts, reporter or NullReporter(), done, total if total is not None else len(texts))
        return frozen.stats()["predictor_recall"]
    finally:
        frozen.close()


def _drop_cached(path: Path) -> bool:
    """Ask the kernel to forget this file's cached pages (so the next read comes from the device)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    finally:
        os.close(fd)


def _smallest_tensor(files: list[Path]) -> tuple[Path, str]:
    """The checkpoint's smallest tensor (a norm's weight): reading it costs what any read costs besides its bytes."""
    from math import prod

    from safetensors import safe_open

    sizes = []
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            sizes += [(prod(handle.get_slice(n).get_shape()), str(f), n) for n in handle.keys()]
    _, file, name = min(sizes)
    return Path(file), name


def _timed_fixed_read(file: Path, name: str, repeats: int) -> float:
    """Median seconds of opening the checkpoint and reading its smallest tensor (as ``ExpertStore.read`` opens it)."""
    from statistics import median

    from safetensors import safe_open

    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        with safe_open(str(file), framework="pt") as handle:
            handle.get_tensor(name)
        times.append(time.perf_counter() - started)
    return median(times)


def storage_bandwidth(model_dir: str | Path, repeats: int = 1, reporter: Reporter | None = None) -> dict:
    """Read every expert of the checkpoint ``repeats`` times with the files' cached pages dropped first
    (``cold``: from the device), then again as they stay cached (``warm``: how a run that reads the
    checkpoint the agent just loaded finds them, when the host's page cache holds it), and time the
    smallest tensor's read (the fixed cost of any read). Each kind's ``read_s`` (median seconds per
    expert) splits into ``fixed_s`` and ``bandwidth_bps`` for its bytes; ``bandwidth_bps`` at the top is
    the cold reads' bytes over their seconds (profiles that predate the split read only it)."""
    from statistics import median

    import torch

    from agents.techniques.expert_offload.offload import ExpertStore

    reporter = reporter or NullReporter()
    _moe_dir(model_dir)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    layers, experts = int(config["num_hidden_layers"]), int(config["num_local_experts"])
    store = ExpertStore(str(model_dir), "model.layers.", torch.float32)
    files = sorted(set(store.reader._file_of.values()))
    total = (repeats + 1) * layers * experts
    reads: dict[str, list[float]] = {"cold": [], "warm": []}
    nbytes = 0
    dropped = True
    for r in range(repeats + 1):
        kind = "cold" if r < repeats else "warm"  # the last pass reads what the cold ones left cached
        if kind == "cold":
            dropped = all([_drop_cached(Path(f)) for f in files]) and dropped
        reporter.status(f"reading {layers * experts} experts ({kind}, pass {r + 1} of {repeats + 1})")
        for layer in range(layers):
            for expert in range(experts):
                if reporter.cancel_requested():
                    raise Cancelled()
                before, started = store.bytes_read, time.perf_counter()
                store.read(layer, expert)
                reads[kind].append(time.perf_counter() - started)
                if kind == "cold":
                    nbytes += store.bytes_read - before
                reporter.progress(r * layers * experts + layer * experts + expert + 1, total)
    expert_bytes = nbytes // (repeats * layers * experts)
    fixed = _timed_fixed_read(*_smallest_tensor([Path(f) for f in files]), repeats=max(8, layers * experts))

    def split(kind: str) -> dict:
        read = median(reads[kind])
        per_bytes = max(read - fixed, 0.1 * read)  # a read is never all fixed cost
        return {"read_s": read, "fixed_s": read - per_bytes, "bandwidth_bps": expert_bytes / per_bytes}

    seconds = sum(reads["cold"])
    return {"format": "edgeshard.storage-profile", "version": 2, "bandwidth_bps": nbytes / seconds,
            "bytes": nbytes, "seconds": seconds, "reads": repeats * layers * experts, "expert_bytes": expert_bytes,
            "cold": split("cold"), "warm": split("warm"), "caches_dropped": dropped,
            "path": str(Path(model_dir).resolve())}


STORAGE_CACHES = ("warm", "cold")


def storage_read_cost(data: dict, cache: str = "warm") -> tuple[float, float]:
    """(bandwidth_bps, read_fixed_s) of a storage profile's ``cache`` reads ("warm": the page cache holds
    the checkpoint, as for a studio's local agents; "cold": every read from the device); a profile that
    predates the split gives its cold bandwidth and no fixed cost."""
    part = data.get(cache) if isinstance(data.get(cache), dict) else None
    if part is None:
        return float(data["bandwidth_bps"]), 0.0
    return float(part["bandwidth_bps"]), float(part["fixed_s"])


def bit_options(model_dir: str | Path, texts: list[list[int]], bound: float, reporter: Reporter | None = None) -> dict:
    """EdgeMoE's adaptation on ``texts`` (core.techniques.expert_offload.adaptation: global lower/upper
    widths from uniform INT8/INT4/INT2, importance per expert at the lower one, K raised while within
    the bound); the adapted experts are written into ``model_dir``."""
    import shutil
    import tempfile

    from agents.techniques.expert_offload.offload import write_quantized_experts
    from core.techniques.expert_offload.adaptation import WIDTHS, edgemoe_adaptation

    reporter = reporter or NullReporter()
    info = _moe_dir(model_dir)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    keys = [(b, e) for b in range(int(config["num_hidden_layers"])) for e in range(int(config["num_local_experts"]))]
    evaluations = [0]
    budget = (1 + len(WIDTHS) + 2 * len(keys) + 1) * len(texts)  # the most the search can take

    def ppl(directory) -> float:
        executor = _executor(directory, info)
        try:
            out = _perplexities(executor, texts, reporter, evaluations[0] * len(texts), budget)
        finally:
            executor.close()
        evaluations[0] += 1
        return out

    with tempfile.TemporaryDirectory(prefix="edgeshard-bits-") as tmp:
        scratch = Path(tmp) / "model"
        shutil.copytree(model_dir, scratch, ignore=shutil.ignore_patterns("experts-quantized.safetensors",
                                                                           "expert-offload.json"))
        reporter.status("perplexity at full precision")
        base = ppl(scratch)
        cache: dict = {}

        def loss(bits_of) -> float:
            key = tuple(sorted(bits_of.items()))
            if key not in cache:
                write_quantized_experts(str(scratch), bits_of)
                cache[key] = ppl(scratch) / base - 1.0
            return cache[key]

        result = edgemoe_adaptation(keys, loss, bound, progress=reporter.status)
    write_quantized_experts(str(model_dir), result.bits_of)  # empty: every expert stays full precision
    summary = bits_summary(result, base, bound, len(keys), evaluations[0])
    (Path(model_dir) / BITS_FILE).write_text(json.dumps(summary, indent=1))
    return summary


def bits_summary(result, base: float, bound: float, experts: int, evaluations: int) -> dict:
    """The ``expert-bits.json`` content of an adaptation (``Adaptation``) from perplexity ``base``."""
    uniform = [{"name": f"int{w}", "avg_bits": float(w), "accuracy_loss": max(0.0, loss)}
               for w, loss in sorted(result.uniform_loss.items(), reverse=True)]
    if result.upper is None:
        adapted_name = "fp32"
    elif result.lower == result.upper or result.int_low == 0:
        adapted_name = f"int{result.upper if result.int_low == 0 else result.lower}"
    else:
        adapted_name = f"int{result.lower}x{result.int_low}+int{result.upper}"
    adapted = {"name": f"adapted {adapted_name}", "avg_bits": result.average_bits(experts),
               "accuracy_loss": max(0.0, result.loss)}
    return {"format": "edgeshard.expert-bits", "version": 1, "bound": bound, "perplexity_fp32": base,
            "perplexity_adapted": base * (1 + result.loss), "perplexity_int4": base * (1 + result.uniform_loss[4]),
            "lower_bits": result.lower, "upper_bits": result.upper, "low_experts": result.int_low,
            "experts": experts, "evaluations": evaluations,
            "options": [{"name": "fp32", "avg_bits": 32.0, "accuracy_loss": 0.0}, *uniform, adapted],
            "perplexity": {"fp32": base, **{f"int{w}": base * (1 + v) for w, v in result.uniform_loss.items()},
                           "adapted": base * (1 + result.loss)},
            "importance": {f"{b}.{e}": v for (b, e), v in result.importance.items()}}
