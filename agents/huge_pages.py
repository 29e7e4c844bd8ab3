"""A stage's weights in one block of memory backed by transparent huge pages, where the OS allows.

A decode step at batch 1 streams every weight of the stage once: it is memory-bound, and with
4 KiB pages it also walks the page tables for each 4 KiB of weights. A stage that has just
been idle — every stage of a sequential pipeline is idle while the others compute — finds
those translations gone from the CPU's caches, and on a virtual machine each walk is a
nested one. Measured on the 2-core build VM (171 M Llama in four stages in one process, each
stage idle ≈ 35 ms before its step, compute alone timed, load 1.2–1.9): per token 66.9 ms with
the weights memory-mapped against 47.9 ms for one stage holding them all (+40 %), and 53.0
against 47.3 ms (+12 %) with the weights in huge pages; a hot 64 MiB matrix-vector product
ran 23 % faster (docs/runtime.md, "Weights in huge pages").

safetensors maps the checkpoint file (4 KiB page-cache pages, which cannot be huge), so the
weights are copied once, at load, into an anonymous mapping advised ``MADV_HUGEPAGE``.
Where that advice does not exist (not Linux) or is refused, THP is set to ``never``, or the
block cannot be mapped (no address space or commit charge left: ``vm.overcommit_memory=2``,
``ulimit -v``), the copy is skipped and the mapped weights are used as before: huge pages are a speed-up, never a
requirement. Each weight's old memory is released as soon as it has been copied, so weights
the stage owns (converted to another dtype at load) are not held twice at once.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable

import torch
from torch import nn

HUGE_PAGE = 2 << 20
ALIGN = 64  # bytes: each tensor starts on a cache line
MIN_BYTES = HUGE_PAGE  # below one huge page there is nothing to gain
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_off() -> bool:
    """Whether the system turned transparent huge pages off ("[never]"): ``MADV_HUGEPAGE`` is
    still accepted then (the kernel only refuses it where THP is not built in), but every page
    stays 4 KiB, so a copy would cost the load and the page-cache sharing for nothing."""
    try:
        with open(THP_ENABLED) as f:
            return "[never]" in f.read()
    except OSError:  # no sysfs entry (not Linux, THP not built in): the advice decides
        return False


def _aligned(n: int, to: int) -> int:
    return -(-n // to) * to


def huge_page_block(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` of zeroed memory (uint8) starting on a huge-page boundary and advised to use
    huge pages, or None where the OS offers no such advice."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or _thp_off():
        return None
    # private: shared anonymous memory is shmem, whose huge pages are a separate, usually off, setting
    try:
        region = mmap.mmap(-1, _aligned(nbytes, HUGE_PAGE) + HUGE_PAGE,  # room to start on a boundary
                           flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # ENOMEM: no address space or commit charge for a second copy of the weights
        return None
    try:
        region.madvise(advice)
    except OSError:  # THP not built into this kernel
        region.close()
        return None
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps ``region`` alive while used
    start = (-whole.data_ptr()) % HUGE_PAGE
    return whole[start:start + nbytes]


def place_in_huge_pages(modules: Iterable[nn.Module]) -> int:
    """Move the parameters of ``modules`` into one huge-page block; returns the bytes moved (0:
    nothing moved). Parameters sharing memory (a tied embedding and head) stay shared; values
    are copied exactly. Quantized weights (tensor subclasses holding packed values and scales) stay
    where they are."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    sharing: dict[tuple, list[nn.Parameter]] = {}  # parameters on the same memory, moved as one
    for module in modules:
        for p in module.parameters():
            if not is_traceable_wrapper_subclass(p) and p.is_contiguous() and not p.is_meta:
                sharing.setdefault((p.data_ptr(), p.dtype, tuple(p.shape), tuple(p.stride())), []).append(p)
    total = sum(_aligned(group[0].nbytes, ALIGN) for group in sharing.values())
    if total < MIN_BYTES:
        return 0
    block = huge_page_block(total)
    if block is None:
        return 0
    offset = 0
    with torch.no_grad():
        for key in list(sharing):
            group = sharing.pop(key)
            view = block[offset:offset + group[0].nbytes].view(group[0].dtype).view(group[0].shape)
            view.copy_(group[0].data)
            for p in group:  # the old memory goes now if nothing else holds it, not after the last copy
                p.data = view
            offset += _aligned(view.nbytes, ALIGN)
    return offset
