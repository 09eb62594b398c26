"""Lasting weight copies on 2 MB pages (core/hugepages.py): arrays carved from advised mappings hold their values
apart from each other, temporaries and small arrays stay on the heap, the switch and the system's setting are
honoured, and a product reads the same numbers from either kind of memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_quant import random_blocks

from selfspec.core import hugepages
from selfspec.core.quant import activations, from_gguf, pack_x16


def _on_mapping(a: np.ndarray) -> bool:
    return hugepages.placed(a.ctypes.data)


@pytest.fixture
def placing(monkeypatch):
    """Placement on, whatever this machine's setting (the mappings are advised; whether the kernel then backs
    them with huge pages is its business, not what these tests check)."""
    monkeypatch.setenv(hugepages.HUGE_PAGES_ENV, "1")
    monkeypatch.setattr(hugepages, "setting", lambda: "madvise")
    if not hugepages.enabled():
        pytest.skip("Python's mmap has no MADV_HUGEPAGE here (not Linux)")


@pytest.mark.usefixtures("placing")
def test_placed_arrays_are_aligned_writable_and_do_not_overlap():
    shapes = [(300_000,), (70, 5000), (hugepages.CHUNK // 4 + 7,)]  # the last needs a chunk of its own
    arrays = [hugepages.empty(s, np.float32) for s in shapes]
    for i, a in enumerate(arrays):
        assert a.shape == shapes[i] and a.dtype == np.float32 and a.flags.writeable and a.flags.c_contiguous
        assert _on_mapping(a)
        assert a.ctypes.data % hugepages.ALIGN == 0
        a[...] = i + 1
    for i, a in enumerate(arrays):  # no array wrote over another
        assert np.all(a == i + 1)
    spans = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))


@pytest.mark.usefixtures("placing")
def test_a_chunk_is_unmapped_once_none_of_its_arrays_is_left():
    import gc

    a = hugepages.empty((hugepages.CHUNK + hugepages.PAGE,), np.uint8)  # a chunk of its own, filled
    b = hugepages.empty((1 << 20,), np.uint8)  # so in the next one
    start = a.ctypes.data
    assert hugepages.placed(start) and hugepages.placed(b.ctypes.data)
    del a
    gc.collect()
    assert not hugepages.placed(start)  # nothing held it: unmapped, its pages back to the system
    assert hugepages.placed(b.ctypes.data)


@pytest.mark.usefixtures("placing")
def test_small_arrays_and_a_disabled_switch_stay_on_the_heap(monkeypatch):
    small = hugepages.empty((hugepages.MIN_BYTES // 4 - 1,), np.float32)
    assert not _on_mapping(small)
    monkeypatch.setenv(hugepages.HUGE_PAGES_ENV, "0")
    assert not hugepages.enabled()
    assert not _on_mapping(hugepages.empty((1 << 20,), np.uint8))
    monkeypatch.setenv(hugepages.HUGE_PAGES_ENV, "1")
    monkeypatch.setattr(hugepages, "setting", lambda: "never")  # the system gives none: nothing to ask for
    assert not hugepages.enabled()


def test_the_system_setting_is_read_from_its_brackets(tmp_path, monkeypatch):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    monkeypatch.setattr(hugepages, "THP_SETTING", f)
    assert hugepages.setting() == "madvise"
    f.write_text("[never]\n")
    assert hugepages.setting() == "never"
    monkeypatch.setattr(hugepages, "THP_SETTING", tmp_path / "missing")
    assert hugepages.setting() is None


@pytest.mark.usefixtures("placing")
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q5_0"])
def test_a_lasting_copy_is_placed_and_computes_the_same_numbers(kind):
    qw = from_gguf(kind, random_blocks(kind, 1024, 512, seed=3), 1024, 512)
    heap, placed = pack_x16(qw), pack_x16(qw, lasting=True)
    assert _on_mapping(placed[0].numpy()) and not _on_mapping(heap[0].numpy())
    for a, b in zip(heap, placed, strict=True):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    with activations("int8"):
        ref = qw.matmul(x)  # the weight's own copy (made lasting by x16(), outside temporaries())
        assert _on_mapping(qw.x16()[0].numpy())
        other = from_gguf(kind, random_blocks(kind, 1024, 512, seed=3), 1024, 512)
        with hugepages.temporaries():
            assert not _on_mapping(other.x16()[0].numpy())  # a temporary piece stays on the heap
        assert torch.equal(other.matmul(x), ref)


@pytest.mark.usefixtures("placing")
def test_the_draft_vocabularys_copy_is_placed_alone_and_let_go_as_it_grows():
    import gc

    from selfspec.core.draft_vocab import DraftVocabulary
    from selfspec.core.quant import quantize_weight

    head = quantize_weight(torch.randn(6000, 256, generator=torch.Generator().manual_seed(0)), 8)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(1))
    with activations("int8"):
        vocab = DraftVocabulary(head, base=100)
        vocab.add(torch.arange(100, 200))
        assert torch.equal(vocab.product(x), head.matmul(x)[:, vocab.ids[: vocab.size]])
        first, capacity = vocab._x16[0], vocab.capacity
        assert hugepages.placed(first.data_ptr())
        gc.collect()
        mapped = len(hugepages._spans)
        del first
        vocab.add(torch.arange(1000, 2500))  # past its capacity: a new copy, the old one's mappings unmapped
        assert vocab.capacity > capacity
        assert torch.equal(vocab.product(x), head.matmul(x)[:, vocab.ids[: vocab.size]])
        gc.collect()
        assert hugepages.placed(vocab._x16[0].data_ptr()) and len(hugepages._spans) == mapped


@pytest.mark.usefixtures("placing")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int8])
def test_a_caches_buffers_share_one_placed_mapping_zeroed_and_apart(dtype):
    """The fused stack's key and value buffers (core/cache.py): one advised mapping for all, each zeroed, aligned,
    of its own shape, none overlapping another; a prefix loaded into a new cache lands on one too."""
    from selfspec.core.cache import KVCache

    shapes = [(3, 64), (1, 256), (2, 64)]
    cache = KVCache(len(shapes), 40, dtype)
    cache.buffer_pointers(shapes, dtype)
    bufs = cache._keys + cache._values
    for b, (heads, dim) in zip(bufs, shapes + shapes, strict=True):
        width = dim // 32 * 36 if dtype == torch.int8 else dim
        assert b.shape == (1, heads, 40, width) and b.dtype == dtype and b.is_contiguous()
        assert hugepages.placed(b.data_ptr()) and b.data_ptr() % hugepages.ALIGN == 0
        assert not b.any()
    for i, b in enumerate(bufs):
        b.fill_(i + 1)
    assert all(bool((b == i + 1).all()) for i, b in enumerate(bufs))  # no buffer wrote over another
    again = KVCache(len(shapes), 64, dtype)
    again.load_prefix(cache.prefix(30), 30)
    assert all(hugepages.placed(b.data_ptr()) for b in again._keys + again._values)
    assert all(torch.equal(a[:, :, :30], b[:, :, :30]) for a, b in zip(again._keys, cache._keys, strict=True))
    assert not again._keys[0][:, :, 30:].any()


def test_without_huge_pages_a_caches_buffers_are_torchs(monkeypatch):
    from selfspec.core.cache import KVCache

    monkeypatch.setenv(hugepages.HUGE_PAGES_ENV, "0")
    cache = KVCache(1, 16, torch.float16)
    cache.buffer_pointers([(2, 64)], torch.float16)
    assert not hugepages.placed(cache._keys[0].data_ptr()) and not cache._keys[0].any()
