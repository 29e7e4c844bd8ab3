"""Expert offloading planned for the connected cluster (the studio's measured source).

The paper-shaped problem (``scenarios.paper_shaped``: a phone reading a Mixtral-like model's
experts from flash) answers "what if"; this module builds the problem of a device the studio
profiled: the checkpoint's sizes and the device's measured compute times (``scenarios.
from_profile``), the device's memory budget as the agent reported it (a share of the experts can
cap it lower, to try offloading on a device that would hold everything), the measured storage
bandwidth (``storage-profile.json`` beside the checkpoint, written by ``measure_storage``), and
the activation recall and bit options when their offline profiles are there too.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from core.errors import FormatError
from core.reporting import Reporter
from core.techniques.expert_offload.problem import OffloadProblem
from core.techniques.expert_offload.profiling import ACTIVATIONS_FILE, BITS_FILE, STORAGE_FILE

PROFILED_BATCHES = (1, 2, 4)
"""Decode batch sizes the agents are timed at for the MoE: a run of a few prompts is priced from
measured steps, not scaled from one sequence's."""


def device_memory_bytes(profile, device: str) -> int:
    """The memory budget the device's agent reported (its profile's cluster)."""
    for d in profile.cluster.devices:
        if d.id == device:
            return int(d.memory_bytes)
    raise FormatError("profile", f"has no device {device!r}: profile the cluster again")


def stored_read_cost(model_dir: str | Path, cache: str = "warm") -> tuple[float, float] | None:
    """(bandwidth_bps, read_fixed_s) measured for this checkpoint's ``cache`` reads (its
    ``storage-profile.json``; ``profiling.storage_read_cost``), None when none was measured, the file
    is not one, or it predates the split (version 1: cold reads only, which priced the demo's reads
    ~2x slow): the studio's view then measures again."""
    from core.techniques.expert_offload.profiling import storage_read_cost

    path = Path(model_dir) / STORAGE_FILE
    try:
        data = json.loads(path.read_text())
        if not isinstance(data.get(cache), dict):
            return None
        bandwidth, fixed = storage_read_cost(data, cache)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return (bandwidth, fixed) if bandwidth > 0 and fixed >= 0 else None


def stored_bandwidth_bps(model_dir: str | Path) -> float | None:
    """The bandwidth of the measured reads a run of the studio's agents finds (warm: the agents read the
    checkpoint through the host's page cache, which the emulated memory budget does not limit)."""
    cost = stored_read_cost(model_dir)
    return cost[0] if cost else None


def measure_storage(model_dir: str | Path, reporter: Reporter | None = None) -> float:
    """Read every expert of the checkpoint (cold, then warm) and keep the result beside it; the warm
    bytes/s (``stored_bandwidth_bps``). Read here, from the files the local cluster's agents read (a
    remote device: ``edgeshard moe profile-storage`` on it)."""
    from core.techniques.expert_offload.profiling import storage_bandwidth

    result = storage_bandwidth(model_dir, reporter=reporter)
    (Path(model_dir) / STORAGE_FILE).write_text(json.dumps(result, indent=1))
    return float(result["warm"]["bandwidth_bps"])


def profile_agents(coordinator, model_dir: str | Path, *, repeats: int = 3,
                   reporter: Reporter | None = None):
    """The connected agents profiled for this Mixtral checkpoint (each unit's decode time and one
    expert's; no links: one device runs the model), then its storage measured: what the measured
    problem needs when the studio's profile is of another model. Returns the ``Profile``."""
    from core.devices.profiling import profile_cluster
    from core.techniques.expert_offload.profiling import require_moe

    require_moe(model_dir)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    result = profile_cluster(coordinator, config, model_name=Path(model_dir).name, batch_sizes=PROFILED_BATCHES,
                             repeats=repeats, prompt_tokens=16, network=False, reporter=reporter)
    measure_storage(model_dir, reporter)
    return result.profile


def cluster_problem(profile, device: str, model_dir: str | Path, *, bandwidth_bps: float,
                    expert_share: float = 1.0, read_fixed_s: float | None = None) -> OffloadProblem:
    """The problem of ``device`` of the profiled cluster: measured compute times and sizes, its
    memory budget (at most the resident weights and ``expert_share`` of all the experts' bytes: a
    small model's embedding can outweigh its experts, so a share of the whole model could leave
    room for one expert or none), ``bandwidth_bps`` (the measured storage) and ``read_fixed_s`` (None:
    the stored measurement's warm fixed cost per read, 0 without one), measured recall and bit
    options where their files are beside the checkpoint. Bad input is a ``FormatError`` naming what
    to do (``from_profile``)."""
    from core.techniques.expert_offload.scenarios import from_profile, measured

    base = from_profile(profile, device, str(model_dir), 1.0, bandwidth_bps)
    m = base.model
    cap = m.resident_bytes + int(expert_share * m.layers * m.experts * m.expert_bytes)
    if read_fixed_s is None:
        stored = stored_read_cost(model_dir)
        read_fixed_s = stored[1] if stored else 0.0
    problem = msgspec.structs.replace(base, memory_budget_bytes=max(1, min(device_memory_bytes(profile, device), cap)),
                                      read_fixed_s=read_fixed_s)
    here = Path(model_dir)
    return measured(problem, activations=str(here / ACTIVATIONS_FILE) if (here / ACTIVATIONS_FILE).is_file() else None,
                    bits=str(here / BITS_FILE) if (here / BITS_FILE).is_file() else None)


__all__ = ["cluster_problem", "device_memory_bytes", "measure_storage", "profile_agents", "stored_bandwidth_bps",
           "stored_read_cost"]
