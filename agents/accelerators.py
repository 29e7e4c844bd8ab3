"""Where a stage computes: the CPU or one of the CUDA devices torch sees on this agent.

``LoadShard.torch_device`` names it (``cpu``, ``cuda`` = ``cuda:0``, ``cuda:N``); the agent reports
what it has in its status (``AgentStatus.accelerators``) so a coordinator refuses a CUDA stage for an
agent without that GPU before any load, and the agent refuses it again at its own entrance (an older
coordinator, a hand-written request).
"""

from __future__ import annotations

import functools
import re

_NAME = re.compile(r"cpu|cuda(:[0-9]{1,2})?")


def device_name_problem(name: str) -> str:
    """Why ``name`` is not a device a stage can be placed on ('' when it is one)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        return f"torch_device must be cpu, cuda or cuda:N, got {name[:40]!r}" if isinstance(name, str) else \
            "torch_device must be a string"
    return ""


@functools.cache
def cuda_devices() -> tuple[tuple[str, str, int], ...]:
    """(``cuda:N``, model name, memory bytes) of every CUDA device torch sees; () on a CPU-only torch
    or machine (asked once: the answer does not change while the agent runs)."""
    import torch

    if getattr(torch.version, "cuda", None) is None or not torch.cuda.is_available():
        return ()
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        out.append((f"cuda:{i}", str(props.name), int(props.total_memory)))
    return tuple(out)


def canonical(name: str) -> str:
    """``cuda`` -> ``cuda:0``; others as they are."""
    return "cuda:0" if name == "cuda" else name


def unavailable_device(name: str, available: tuple[str, ...]) -> str:
    """Why a stage cannot be placed on ``name`` on an agent with the CUDA devices ``available`` ('' when it can)."""
    problem = device_name_problem(name)
    if problem or name == "cpu" or canonical(name) in available:
        return problem
    have = f"it has {', '.join(available)}" if available else "torch sees no CUDA device there"
    return f"asked to compute on {name}, but {have}: place the stage on cpu or on that agent's GPU"


class CudaBackend:
    """The GPUs a profiler may time units on, and how: torch's CUDA devices, their free memory and a
    synchronise before each clock read (kernels are asynchronous). An agent takes one
    (``Agent(accelerators=...)``) so its status, its load check and its profiler all ask the same
    thing; a test hands it one that computes on the CPU under a GPU's name (no GPU on the CI machine)."""

    def devices(self) -> tuple[tuple[str, str, int], ...]:
        """(``cuda:N``, model name, memory bytes) of each GPU (``cuda_devices``)."""
        return cuda_devices()

    def place(self, name: str):
        """The torch device a unit timed on GPU ``name`` is built and run on."""
        import torch

        return torch.device(canonical(name))

    def sync(self, name: str) -> None:
        """Wait for the GPU's queued kernels: a time read before would miss them."""
        import torch

        torch.cuda.synchronize(torch.device(canonical(name)))

    def memory(self, name: str) -> tuple[int, int]:
        """(free, total) bytes of the GPU's memory now."""
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(canonical(name)))
        return int(free), int(total)

    def clock(self) -> float:
        """What a GPU unit's time is read by: the wall clock (the GPU computes while the host waits)."""
        import time

        return time.perf_counter()


    # ----- boundary activations (agents.boundary_copy): a side stream copies while the next step computes
    def pinned(self, shape: tuple, dtype):
        """A page-locked host buffer: the GPU's copy engine reads and writes it without a bounce."""
        import torch

        with torch.inference_mode(False):
            return torch.empty(shape, dtype=dtype, pin_memory=True)

    def copy_stream(self, name: str):
        """The stream a stage's outputs are copied to the host on, beside the one that computes."""
        import torch

        return torch.cuda.Stream(torch.device(canonical(name)))

    def copy_to_host(self, src, dst, stream):
        """Start ``dst.copy_(src)`` on ``stream`` once the computing stream has made ``src``; the returned
        event's ``query()`` says whether it is done, ``synchronize()`` waits for it (the GIL released)."""
        import torch

        stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def copy_to_device(self, src, device):
        """``src`` (a pinned buffer) on ``device``, queued on the computing stream, and the event after
        which ``src`` may be written again."""
        import torch

        out = src.to(device, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        return out, done


CUDA = CudaBackend()
