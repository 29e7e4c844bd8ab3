"""Send each agent only its stage's weights, over the encrypted control channel.

For every stage of a plan the coordinator cuts the checkpoint down to the stage's units
(``core.models.stage_checkpoint``, cached locally) and adds every other file the stage reads (those
its ``Stage.options`` name), asks the agent how much of each file
(by sha256) it already holds, and sends only the rest in chunks, a few in flight per
agent. The agent keeps files by content hash (``agents.weights``): a plan change re-sends
only the stages whose units moved, and an interrupted transfer resumes where it stopped.
The agent checks each file's sha256 when its last byte arrives.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
from dataclasses import dataclass
from pathlib import Path

from agents.protocol import ErrorReply, PutWeights, QueryWeights, WeightsHeld
from core.errors import RunFailed
from core.models.stage_checkpoint import write_stage_checkpoint
from core.paths import edgeshard_home
from core.planning.plan import ShardPlan
from core.reporting import Cancelled, NullReporter, Reporter

CHUNK_BYTES = 512 * 1024
"""Below the control channel's 1 MiB frame limit with room for the message around it."""
IN_FLIGHT = 4
"""Chunks sent ahead per agent (the channel keeps them in order)."""


@dataclass(frozen=True)
class ShippedFile:
    path: Path
    name: str
    digest: str
    size: int


@dataclass(frozen=True)
class ShipReport:
    """What a transfer did: bytes sent and bytes the agents already held, per device."""

    sent: dict[str, int]
    already_held: dict[str, int]
    files: dict[str, tuple[tuple[str, str], ...]]
    """(name, sha256) per device: what its ``LoadShard`` names."""


def default_cache_dir() -> Path:
    return edgeshard_home() / "stage-weights"


def file_digest(path: Path) -> str:
    """sha256 of ``path``, remembered beside it (stage slices never change once written)."""
    st = path.stat()
    side = path.with_name(path.name + ".sha256")
    stamp = f"{st.st_size}:{st.st_mtime_ns}"
    try:
        saved_stamp, digest = side.read_text().split()
        if saved_stamp == stamp:
            return digest
    except (OSError, ValueError):
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()
    try:
        side.write_text(f"{stamp} {digest}\n")
    except OSError:
        pass  # only a cache
    return digest


def stage_files(model_dir: str | Path, start: int, end: int, cache_dir: Path) -> list[ShippedFile]:
    out = write_stage_checkpoint(model_dir, start, end, cache_dir)
    names = [n for n in ("config.json", "generation_config.json", "model.safetensors") if (out / n).is_file()]
    return [ShippedFile(out / n, n, file_digest(out / n), (out / n).stat().st_size) for n in names]


def option_files(model_dir: str | Path, stage) -> list[ShippedFile]:
    """The files beside the checkpoint that ``stage``'s kind reads, as its options name them
    (``Stage.options["files"]``: (name, sha256), e.g. expert offloading's quantised experts), sent
    whole; one that is not the file the plan names is refused before anything is sent."""
    out = []
    for name, digest in (stage.options or {}).get("files", ()):
        path = Path(model_dir) / name
        if not path.is_file() or file_digest(path) != digest:
            state = "is missing" if not path.is_file() else "is not the file the plan was made with (sha256 differs)"
            raise RunFailed(f"{path} {state}: its {stage.kind} stage reads it; make the plan again", stage.device)
        out.append(ShippedFile(path, name, digest, path.stat().st_size))
    return out


def ship_stage_weights(coordinator, plan: ShardPlan, model_dir: str | Path, *, cache_dir: Path | None = None,
                       reporter: Reporter | None = None, timeout_s: float = 120) -> ShipReport:
    """Make every agent of ``plan`` hold its stage's files; returns what ``LoadShard.files`` needs."""
    reporter = reporter or NullReporter()
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    reporter.status(f"preparing {len(plan.stages)} stage slice(s) of {Path(model_dir).name}")
    wanted = {s.device: stage_files(model_dir, s.start, s.end, cache_dir) + option_files(model_dir, s)
              for s in plan.stages}
    todo: dict[str, list[tuple[ShippedFile, int]]] = {}
    held_total: dict[str, int] = {}
    for dev, files in wanted.items():
        reply = coordinator.request(dev, QueryWeights(digests=tuple(f.digest for f in files)), timeout_s)
        held = reply.held if isinstance(reply, WeightsHeld) else (0,) * len(files)
        todo[dev] = [(f, h) for f, h in zip(files, held) if h < f.size]
        held_total[dev] = sum(min(h, f.size) for f, h in zip(files, held))
    total = sum(f.size - h for items in todo.values() for f, h in items)
    sent = dict.fromkeys(wanted, 0)
    if total:
        reporter.status(f"sending stage weights: {total / 2**20:.1f} MiB to "
                        f"{sum(1 for v in todo.values() if v)} device(s)")
        _send_all(coordinator, todo, sent, total, reporter, timeout_s)
    else:
        reporter.status("stage weights already on every device")
    reporter.progress(total, total or 1)
    files = {dev: tuple((f.name, f.digest) for f in fs) for dev, fs in wanted.items()}
    return ShipReport(sent=sent, already_held=held_total, files=files)


def _chunks(items: list[tuple[ShippedFile, int]]):
    for f, offset in items:
        with open(f.path, "rb") as fh:
            fh.seek(offset)
            while offset < f.size:
                data = fh.read(CHUNK_BYTES)
                if not data:
                    raise RunFailed(f"{f.path} shrank while being sent")
                yield PutWeights(digest=f.digest, offset=offset, size=f.size, data=data)
                offset += len(data)


def _send_all(coordinator, todo, sent: dict[str, int], total: int, reporter: Reporter, timeout_s: float) -> None:
    streams = {dev: _chunks(items) for dev, items in todo.items() if items}
    in_flight: dict[cf.Future, tuple[str, int]] = {}

    def top_up(dev: str) -> None:
        while sum(1 for d, _ in in_flight.values() if d == dev) < IN_FLIGHT:
            msg = next(streams[dev], None)
            if msg is None:
                return
            in_flight[coordinator.request_async(dev, msg)] = (dev, len(msg.data))

    for dev in streams:
        top_up(dev)
    while in_flight:
        if reporter.cancel_requested():
            raise Cancelled("weights transfer cancelled; the next run resumes it")
        done, _ = cf.wait(list(in_flight), timeout=timeout_s, return_when=cf.FIRST_COMPLETED)
        if not done:
            dev = next(iter(in_flight.values()))[0]
            raise RunFailed(f"no answer while receiving stage weights after {timeout_s:.0f} s", dev)
        for fut in done:
            dev, n = in_flight.pop(fut)
            reply = fut.result()  # a lost agent's future holds its RunFailed
            if isinstance(reply, ErrorReply):
                raise RunFailed(f"cannot store its stage weights ({reply.code}): {reply.message}", dev)
            sent[dev] += n
            top_up(dev)
        reporter.progress(sum(sent.values()), total)
