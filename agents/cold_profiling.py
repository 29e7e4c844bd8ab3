"""Timing a unit as cold as a run finds it, within the memory the agent may use.

A unit is timed with its weights out of the CPU's last-level cache when a run finds them so
(agents/profiler.py's docstring says when): on copies of the unit timed in turn (``cold_copies``),
or, on a host whose other agents compute between a stage's steps, after overwriting the cache
(``CacheEvictor``). Both cost memory in proportion to the cache: about twice it. Sized by the
cache alone, a VM reporting a 480 MiB last-level cache built 256 MiB of copies (and an evictor
would have written 960 MiB) in an agent limited to 400 MiB more than it used, and profiling ended
in ``DefaultCPUAllocator: can't allocate memory``. So what profiling may add is bounded by the
memory the agent has (``profiling_room``: MemAvailable, its address-space limit, its cgroup's
limit, each less the headroom) and by absolute caps; where overwriting the cache does not fit,
the unit is timed warm and the profile says why (``ComputeProfile.cache_timing``).

The host is read by ``last_level_cache_bytes`` and ``read_memory_figures``; everything that
decides is a function of the figures passed in, so tests inject a cache and a memory limit.
Not bounded by an emulated memory budget (``--memory-budget-mib``): that limits the shard a
planner may place on the emulated device, while copies and evictor reproduce what this host's
real cache does to a run, in this host's real memory (bounded by it, the demo's emulated devices
would lose the cold timing that made their predictions match their runs).

This module ships with the agent: it must not import core/.
"""

from __future__ import annotations

import glob
import math
import os
import resource
from collections.abc import Callable
from typing import Any, NamedTuple

MIB = 1 << 20

RING_MAX_BYTES = 256 << 20
"""At most this many bytes of unit copies are built to time a unit cold."""

EVICTOR_MAX_BYTES = 256 << 20
"""The cache evictor's buffer never exceeds this, whatever the cache: it is written before every
timed call (repeats × batch sizes × units: ~1,000 calls for a 32-block model), so 256 MiB already
costs ~25 ms a call at 10 GB/s. It overwrites caches up to 128 MiB — every edge CPU this project
targets (a few MiB) and desktop or server parts up to 3D V-Cache and Sapphire Rapids (96–112.5 MiB
per L3); beyond that (VMs reporting several hundred MiB) a unit the cache holds is timed warm and
the profile says so."""


# ------------------------------------------------------------------------------ host readers
def parse_cache_size(text: str) -> int:
    """sysfs cache size ("32768K", "1M", "512") in bytes; 0 if unreadable."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in ("K", "M", "G") else text
    return int(digits) * scale if digits.isdigit() else 0


def last_level_cache_bytes(cpu_dir: str = "/sys/devices/system/cpu/cpu0") -> int:
    """Size of this CPU's last-level cache (the largest data or unified cache sysfs lists under
    ``cpu_dir``); 0 if unknown."""
    best = 0
    for d in glob.glob(os.path.join(cpu_dir, "cache", "index*")):
        try:
            with open(os.path.join(d, "type")) as f:
                if f.read().strip() == "Instruction":
                    continue
            with open(os.path.join(d, "size")) as f:
                best = max(best, parse_cache_size(f.read()))
        except OSError:
            continue
    return best


def parse_meminfo(text: str) -> dict[str, int]:
    """``/proc/meminfo``'s "Key: N kB" lines in bytes."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * 1024
    return out


def read_meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    try:
        with open(path) as f:
            return parse_meminfo(f.read())
    except OSError:
        return {}


def memory_budget(headroom_bytes: int, device: str = "cpu",
                  meminfo: Callable[[], dict[str, int]] = read_meminfo) -> tuple[int, int, int]:
    """(budget, total, available): free accelerator memory when the runtime computes on
    ``cuda``, else available RAM (MemAvailable), minus ``headroom_bytes`` kept for the OS,
    the agent and activations."""
    if device.startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return max(0, int(free) - headroom_bytes), int(total), int(free)
    info = meminfo()
    total = info.get("MemTotal", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    avail = info.get("MemAvailable", total)
    return max(0, avail - headroom_bytes), total, avail


class MemoryFigures(NamedTuple):
    """What bounds the memory this process may still allocate; None: no such limit."""

    available_bytes: int | None
    """The system's MemAvailable."""
    address_space_room_bytes: int | None = None
    """The soft address-space limit (RLIMIT_AS, ``ulimit -v``) less the address space in use."""
    cgroup_room_bytes: int | None = None
    """The process's memory cgroup limit less its usage (v2 ``memory.max``, v1 ``memory.limit_in_bytes``)."""


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_room(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """What this process's memory cgroup still allows (limit less usage; v2 or v1); None: no limit seen."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            limit, used = (_read_int(f"{root}{path}/memory.{n}") for n in ("max", "current"))
        elif "memory" in controllers.split(","):  # v1
            limit, used = (_read_int(f"{root}/memory{path}/memory.{n}_in_bytes") for n in ("limit", "usage"))
        else:
            continue
        if limit is not None and used is not None and limit < 1 << 60:  # v1 writes "no limit" as ~2^63
            return max(0, limit - used)
    return None


def read_memory_figures() -> MemoryFigures:
    """This process's ``MemoryFigures``, read now."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    room = None
    if soft != resource.RLIM_INFINITY:
        status = read_meminfo("/proc/self/status")  # "VmSize: N kB" parses the same way
        room = max(0, soft - status.get("VmSize", 0))
    return MemoryFigures(available_bytes=read_meminfo().get("MemAvailable"), address_space_room_bytes=room,
                         cgroup_room_bytes=cgroup_room())


# ------------------------------------------------------------------------------ decisions
class Room(NamedTuple):
    bytes: int
    """What profiling may add to the memory it uses (copies of a unit, the evictor's buffer)."""
    bound: str
    """What sets it, for the profile's reason: "MemAvailable less 512 MiB of headroom"."""


def profiling_room(figures: MemoryFigures, headroom_bytes: int) -> Room:
    """The least of the figures' limits, each less ``headroom_bytes`` (kept for the OS, the agent's
    other work and the timed calls' activations); unbounded figures give an unbounded room."""
    named = (("MemAvailable", figures.available_bytes),
             ("the address-space limit (RLIMIT_AS)", figures.address_space_room_bytes),
             ("the memory cgroup's limit", figures.cgroup_room_bytes))
    limits = [(max(0, v - headroom_bytes), name) for name, v in named if v is not None]
    if not limits:
        return Room(1 << 62, "no memory limit")
    room, name = min(limits)
    return Room(room, f"{name} less {headroom_bytes / MIB:.0f} MiB of headroom")


def cold_copies(unit_bytes: int, model_bytes: int, cache_bytes: int, max_bytes: int = RING_MAX_BYTES) -> int:
    """Copies of a unit to time in turn so that each timed call finds its weights out of a
    ``cache_bytes`` last-level cache, as in a run of a model of ``model_bytes`` (1: time it as is).

    A model that fits in the cache stays there between tokens: its units are timed warm (1).
    Otherwise the copies together span about twice the cache (an LRU-like cache then holds
    none of the next copy's weights); a unit that is itself twice the cache evicts its own
    weights and needs no copy. Fewer than that fit in ``max_bytes``: 1 (the cache would hold
    them all, so they would be timed warm anyway, at the cost of building them)."""
    if cache_bytes <= 0 or unit_bytes <= 0 or model_bytes <= cache_bytes or unit_bytes >= 2 * cache_bytes:
        return 1
    want = math.ceil(2 * cache_bytes / unit_bytes)
    return want if want * unit_bytes <= max_bytes else 1


def evictor_bytes(cache_bytes: int, room: Room, shared_host: bool) -> int:
    """The evictor's buffer (twice the cache) where the host is shared and it fits both the
    room and ``EVICTOR_MAX_BYTES``; else 0 (no evictor)."""
    want = 2 * cache_bytes
    return want if shared_host and 0 < want <= min(EVICTOR_MAX_BYTES, room.bytes) else 0


class UnitCold(NamedTuple):
    """How one unit is timed."""

    copies: int
    """Copies of it timed in turn (1: the unit alone)."""
    evict: bool
    """The caches are overwritten before each timed call."""
    warm: str
    """Why its weights are in the cache at a timed call; "" when they are not (cold)."""


def _mib(n: int) -> str:
    return f"{n / MIB:.0f} MiB" if n >= 10 * MIB or n == 0 else f"{n / MIB:.1f} MiB"


def _limit(cap: int, cap_name: str, room: Room, used: int = 0) -> str:
    """What profiling may add, and what bounds it: the cap or the room (less what is ``used``)."""
    left = max(0, room.bytes - used)
    return f"{_mib(cap)} ({cap_name})" if cap <= left else f"{_mib(left)} ({room.bound})"


def unit_cold(unit_bytes: int, model_bytes: int, cache_bytes: int, room: Room, *, evictor: int = 0,
              shared_host: bool = False, accelerator: bool = False) -> UnitCold:
    """How to time one unit (not the embedding: a step reads only its tokens' rows) of a model of
    ``model_bytes`` under a ``cache_bytes`` last-level cache, as cold as a run finds it, adding at
    most ``room`` (``evictor``: the bytes of it the evictor holds, 0 without one); warm, saying why,
    where that is not possible or a run finds it warm too."""
    if accelerator:
        return UnitCold(1, False, "timed on an accelerator, whose caches are not modelled")
    if cache_bytes <= 0:
        return UnitCold(1, False, "the CPU's last-level cache size is unknown")
    if unit_bytes >= 2 * cache_bytes:
        return UnitCold(1, False, "")  # evicts its own weights
    need = f"overwriting the {_mib(cache_bytes)} last-level cache takes {_mib(2 * cache_bytes)}"
    if model_bytes <= cache_bytes:  # a run keeps the model cached, unless other agents overwrite it
        if not shared_host:
            return UnitCold(1, False, f"the model ({_mib(model_bytes)}) fits in the {_mib(cache_bytes)} "
                                      "last-level cache, where a run on a host of its own keeps it")
        if evictor:
            return UnitCold(1, True, "")
        return UnitCold(1, False, f"{need}; profiling may add "
                                  f"{_limit(EVICTOR_MAX_BYTES, 'the evictor cap', room)}")
    space = min(RING_MAX_BYTES, max(0, room.bytes - evictor))
    copies = cold_copies(unit_bytes, model_bytes, cache_bytes, max_bytes=space)
    if copies > 1:
        return UnitCold(copies, False, "")
    if evictor:
        return UnitCold(1, True, "")
    return UnitCold(1, False, f"{need} of unit copies; profiling may add "
                              f"{_limit(RING_MAX_BYTES, 'the copies cap', room, evictor)}")


def cache_timing(warm_reasons: list[str]) -> str:
    """The profile's summary of its units' ``UnitCold.warm``: "cold" when every unit was timed cold,
    else "warm: WHY" (prefixed "K of N units" when only some were)."""
    warm = [r for r in warm_reasons if r]
    if not warm:
        return "cold"
    why = "; ".join(dict.fromkeys(warm))
    return f"warm: {why}" if len(warm) == len(warm_reasons) else f"warm: {len(warm)} of {len(warm_reasons)} units: {why}"


# ------------------------------------------------------------------------------ timing
class Timed(NamedTuple):
    run: Callable[[], Any]
    """What is timed."""
    reset: Callable[[], Any] | None = None
    """Run before each call (warm-up or timed), untimed."""
    cold: Callable[[], Any] | None = None
    """Run after ``reset`` before each timed call only, untimed: the cache evictor (``evicting``).
    Not before warm-ups: their times are dropped, and each timed call finds the caches overwritten
    by its own eviction whatever the warm-ups did (37 % of an agent's evictions in the demo's profile)."""


def in_turn(timed: list[Timed]) -> Timed:
    """One ``Timed`` that runs the copies' calls in turn (each ``reset`` prepares the copy the
    next ``run`` uses)."""
    if len(timed) == 1:
        return timed[0]
    turn = [0]

    def reset():
        r = timed[turn[0]].reset
        if r is not None:
            r()

    def run():
        t = timed[turn[0]]
        turn[0] = (turn[0] + 1) % len(timed)
        return t.run()

    return Timed(run, reset)


class CacheEvictor:
    """Overwrites this CPU's caches: what a unit finds of them when other agents of its host ran
    between two of its steps. Writes a buffer of ``nbytes`` (``evictor_bytes``: twice the last-level
    cache, so nothing of what ran before stays; dirty lines), allocated once."""

    def __init__(self, nbytes: int) -> None:
        import torch

        if not 0 < nbytes <= EVICTOR_MAX_BYTES:
            raise ValueError(f"an evictor of {nbytes} bytes: must be 1 to {EVICTOR_MAX_BYTES}")
        self._buffer = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)

    def __call__(self) -> None:
        self._buffer.add_(1.0)


def evicting(timed: Timed, evict: Callable[[], None] | None) -> Timed:
    """``timed`` with the caches overwritten before each timed call (untimed, after its reset)."""
    return timed if evict is None else timed._replace(cold=evict)
