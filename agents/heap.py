"""An agent gives the memory its steps free back to the OS, so its RSS is what it holds.

glibc serves a large allocation (≥ 128 KiB) from its own mapping and unmaps it when freed, but
raises that threshold to the size of the largest block freed so far (up to 32 MiB). After an
agent's first prefill every activation of a later one (MiBs each: batch × prompt × the MLP's
width) comes from the heap, and the heap keeps what they freed: an agent holding 88 MiB of
weights grew 267 MiB over a batch-8 × 400-token run (3.04× its model), and an agent's evicted
weights stayed in its heap (108 MiB for a 61.6 MiB plan). A
budget the agent checks before allocating means nothing if freed memory is never returned.

Fixing the threshold at 1 MiB (and so turning glibc's dynamic raise off) sends every block of
1 MiB or more back to the OS when it is freed: the same agents grew 101 MiB (1.15×) and
73 MiB (1.19×), measured with bench/memory_fidelity.py (docs/memory-budgets.md).
Smaller allocations (a decode step's activations at small batch) stay on the heap as before;
a large one costs a fresh mapping's page faults (the kernel's zeroing, ~0.1 ms per MiB), small
beside the work of a step that makes MiBs of activations.
"""

from __future__ import annotations

from contextlib import contextmanager

MMAP_THRESHOLD = 1 << 20
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def _libc():
    import ctypes
    import ctypes.util

    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def release_free_pages() -> bool:
    """Give the OS back the free pages inside every malloc arena (glibc's ``malloc_trim(0)``); False
    where there is none. For the blocks under the threshold: a worker thread's arena interleaves a
    stage's small weights (loaded there) with a request's activations, so what a request freed sits
    between live blocks and stays resident: an agent kept 21 MiB over its 29 MiB of weights
    after four requests (bench/memory_fidelity.py). Called once per served request and at the end
    of every run and held session (``Agent``: a dense stage kept 5.7 MiB more without), not per step."""
    try:
        return bool(_libc().malloc_trim(0))
    except (OSError, AttributeError):
        return False


def return_freed_memory_to_the_os(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes in this process; False where there is no
    glibc ``mallopt`` (another C library: nothing changes)."""
    try:
        return bool(_libc().mallopt(M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False


SMALL_BLOCK_THRESHOLD = 64 << 10
"""Where a computation that holds many sub-MiB tensors at once maps its blocks itself (``blocks_returned``)."""


@contextmanager
def blocks_returned(threshold: int = SMALL_BLOCK_THRESHOLD):
    """Within the block, glibc maps every allocation of ``threshold`` bytes or more on its own, so it
    goes back to the OS the moment it is freed; after it, ``MMAP_THRESHOLD`` again. For a computation
    whose live tensors are each under ``MMAP_THRESHOLD`` but many at once: an encode agent's CLIP
    tower keeps every layer's hidden states (0.8 MiB each for 8 tiles of 65 positions × 384) while
    each layer's temporaries come and go between them, and the heap they fragmented kept 17.8 MiB
    resident at the peak for 11.1 MiB live (the bench's encode agent was 1.41× its memory model).
    At 64 KiB the peak is the live tensors: 1.3, 5.6, 11.1, 22.1 MiB for 1, 4, 8, 16 tiles (the
    model: 1.5, 5.8, 11.7, 23.3; docs/memory-budgets.md), and the encode took as long (445–453 vs
    460–487 ms for 8 tiles, fastest of 15, load 12)."""
    changed = return_freed_memory_to_the_os(threshold)
    try:
        yield changed
    finally:
        if changed:
            return_freed_memory_to_the_os(MMAP_THRESHOLD)
