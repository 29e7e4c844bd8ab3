"""A stage's weights move into one huge-page block at load, exactly and with tied weights
still shared; where the OS has no huge-page advice they stay where they were."""

from __future__ import annotations

import mmap

import pytest
import torch
from torch import nn

from agents import huge_pages
from agents.huge_pages import HUGE_PAGE, huge_page_block, place_in_huge_pages
from agents.shard import StageExecutor

needs_advice = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this OS")


@pytest.fixture(autouse=True)
def thp_madvise(monkeypatch, tmp_path):
    """THP set to "madvise", whatever this host's sysfs says (a host set to "never" would keep every
    weight where it was); a test of another setting writes its own."""
    enabled = tmp_path / "thp-enabled"
    enabled.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "THP_ENABLED", str(enabled))


def tied_pair() -> tuple[nn.Embedding, nn.Linear]:
    torch.manual_seed(0)
    embed = nn.Embedding(1024, 1024)  # 4 MiB of fp32
    head = nn.Linear(1024, 1024, bias=False)
    head.weight = nn.Parameter(embed.weight.detach(), requires_grad=False)  # as a stage ties its head
    return embed, head


@needs_advice
def test_moved_weights_keep_their_values_and_tied_weights_stay_shared():
    embed, head = tied_pair()
    before = embed.weight.detach().clone()
    moved = place_in_huge_pages([embed, head])
    assert moved == before.nbytes
    assert torch.equal(embed.weight, before)
    assert head.weight.data_ptr() == embed.weight.data_ptr()


@needs_advice
def test_block_starts_on_a_huge_page_boundary():
    block = huge_page_block(3 * HUGE_PAGE + 5)
    assert block is not None and block.data_ptr() % HUGE_PAGE == 0 and block.numel() == 3 * HUGE_PAGE + 5


def test_weights_under_one_huge_page_stay_where_they_are():
    small = nn.Linear(64, 64)
    where = small.weight.data_ptr()
    assert place_in_huge_pages([small]) == 0
    assert small.weight.data_ptr() == where


def test_without_huge_page_advice_weights_stay_where_they_are(monkeypatch):
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    embed, head = tied_pair()
    where = embed.weight.data_ptr()
    assert place_in_huge_pages([embed, head]) == 0
    assert embed.weight.data_ptr() == where == head.weight.data_ptr()


@needs_advice
def test_a_stage_in_huge_pages_computes_as_a_mapped_one(tiny_llama_dir, monkeypatch):
    """Same tokens; logits to float rounding (BLAS kernels may pick another path for
    differently aligned weights), the tolerance the equivalence tests hold stages to."""
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)  # the tiny model is under one huge page
    huge = StageExecutor(tiny_llama_dir, 0, 4)
    mapped = StageExecutor(tiny_llama_dir, 0, 4, huge_pages=False)
    assert huge.huge_page_bytes > 0 and mapped.huge_page_bytes == 0
    assert huge.memory_bytes() == mapped.memory_bytes()
    whole = StageExecutor(tiny_llama_dir, 0, huge.num_units)
    whole_mapped = StageExecutor(tiny_llama_dir, 0, huge.num_units, huge_pages=False)
    ids = torch.tensor([[5, 6, 7, 8]])
    mask = torch.ones_like(ids)
    def last(logits):  # the last position's logits, [1, vocab]
        return logits.reshape(-1, logits.shape[-1])[-1:]

    a, b = last(whole.prefill(0, ids, mask)), last(whole_mapped.prefill(0, ids, mask))
    for _ in range(6):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        token = a.argmax(-1, keepdim=True)
        assert torch.equal(token, b.argmax(-1, keepdim=True))
        a, b = last(whole.decode(0, token)), last(whole_mapped.decode(0, token))


@needs_advice
def test_where_the_block_cannot_be_mapped_weights_stay_where_they_are(monkeypatch):
    """ENOMEM (strict overcommit, ``ulimit -v``): the stage loads with its weights as they were."""
    def no_memory(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", no_memory)
    embed, head = tied_pair()
    where = embed.weight.data_ptr()
    assert place_in_huge_pages([embed, head]) == 0
    assert embed.weight.data_ptr() == where == head.weight.data_ptr()


@needs_advice
def test_each_weights_old_memory_is_released_before_the_next_is_copied(monkeypatch):
    """Weights the stage owns (converted at load) are not held twice: the first layer's old
    memory is gone when the second layer's weight is copied."""
    import weakref

    import numpy as np

    layers, owners = [], []
    for _ in range(2):
        owner = np.zeros(1024 * 1024, dtype=np.float32)  # 4 MiB, freed with the last tensor on it
        owners.append(weakref.ref(owner))
        layer = nn.Linear(1024, 1024, bias=False)
        layer.weight = nn.Parameter(torch.from_numpy(owner).view(1024, 1024), requires_grad=False)
        layers.append(layer)
    del owner, layer
    released_at_each_copy = []
    copy = torch.Tensor.copy_

    def recording_copy(self, src, *args, **kwargs):
        released_at_each_copy.append([ref() is None for ref in owners])
        return copy(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", recording_copy)
    assert place_in_huge_pages(layers) == 2 * 4 * 1024 * 1024
    assert released_at_each_copy == [[False, False], [True, False]]


@needs_advice
def test_where_transparent_huge_pages_are_off_weights_stay_where_they_are(monkeypatch, tmp_path):
    """THP "never": the kernel still accepts the advice, but the copy would stay in 4 KiB pages."""
    enabled = tmp_path / "enabled"
    enabled.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_ENABLED", str(enabled))
    embed, head = tied_pair()
    where = embed.weight.data_ptr()
    assert place_in_huge_pages([embed, head]) == 0
    assert embed.weight.data_ptr() == where == head.weight.data_ptr()
