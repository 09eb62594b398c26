"""Preallocated per-layer KV cache with a committed length.

Slots ``[0, length)`` of every layer hold the full model's keys and values of
the accepted sequence.  A forward call writes its T new tokens at slots
``[start, start + T)`` and attends over ``[0, start + T)``; what lies beyond
``length`` is scratch (draft or verification entries) until :meth:`commit`.
Rolling back is therefore just a length update, and a sublayer skipped while
drafting simply writes nothing.

The buffers are allocated on first write, from the shape of the keys the
model produces, so the cache needs no architecture knowledge.  They hold the
keys' own dtype, or a storage ``dtype`` fixed when the cache is made (the
fused CPU stack keeps halves: see :func:`selfspec.core.quant.kv_cache_dtype`);
a pass computing in another dtype writes rounded entries and reads them back
widened.  A cache of dtype :data:`Q8` (``torch.int8``) holds 8-bit blocks, as
``fused_decoder.c`` writes and reads them: each 32 values of a head's row as 32
signed codes and their float32 scale (36 bytes), so its buffers' last dimension
is :func:`q8_width` of the head size; :func:`q8_encode` and :func:`q8_decode`
are the same arithmetic in torch, bit for bit.

On the CPU the buffers of one cache share one mapping on 2 MB pages (:func:`zeroed_buffers`): a one-token step
reads every key and value it may see, tens of MB after a few thousand tokens, and on 4 KB pages that stream
crossed a page every 32 keys of a head (a TLB miss each, and the prefetchers stop at page boundaries).
"""

from __future__ import annotations

import numpy as np
import torch

from . import hugepages

Q8 = torch.int8  # a cache dtype: 8-bit blocks (module docstring)
Q8_BLOCK, Q8_BYTES = 32, 36  # values per block; its bytes: the codes, then the scale


def q8_width(dim: int) -> int:
    """The bytes of a ``dim``-value row in 8-bit blocks (``dim`` a multiple of 32)."""
    if dim % Q8_BLOCK:
        raise ValueError(f"an 8-bit cache needs head sizes that are multiples of {Q8_BLOCK}, not {dim}")
    return dim // Q8_BLOCK * Q8_BYTES


def row_width(dim: int, dtype: torch.dtype | None) -> int:
    """The last dimension of a cache buffer of ``dtype`` holding rows of ``dim`` values: the values themselves,
    or the bytes of their 8-bit blocks."""
    return q8_width(dim) if dtype == Q8 else dim


def q8_encode(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` as 8-bit blocks ``[..., q8_width(D)]`` (int8), as the C code writes them: per 32 values
    the scale d = max |x| / 127 and the codes round(x / d) (ties to even); a block holding an infinity or NaN:
    scale NaN, codes 0."""
    *lead, dim = x.shape
    q8_width(dim)
    blocks = x.to(torch.float32).reshape(*lead, dim // Q8_BLOCK, Q8_BLOCK)
    mags = blocks.abs()
    bad = ~(mags <= torch.finfo(torch.float32).max).all(-1, keepdim=True)
    scale = torch.where(bad, float("nan"), mags.amax(-1, keepdim=True) / 127.0)
    codes = torch.where(scale > 0, torch.round(blocks / scale), 0.0).to(torch.int8)
    out = torch.cat([codes, scale.contiguous().view(torch.int8)], dim=-1)
    return out.reshape(*lead, dim // Q8_BLOCK * Q8_BYTES)


def q8_decode(b: torch.Tensor) -> torch.Tensor:
    """The float32 values ``[..., D]`` of 8-bit blocks ``[..., q8_width(D)]``: each code times its block's scale
    (one rounded product, as the C code reads them)."""
    *lead, width = b.shape
    blocks = b.reshape(*lead, width // Q8_BYTES, Q8_BYTES)
    scale = blocks[..., Q8_BLOCK:].contiguous().view(torch.float32)
    return (blocks[..., :Q8_BLOCK].to(torch.float32) * scale).reshape(*lead, width // Q8_BYTES * Q8_BLOCK)


def zeroed_buffers(shapes: list[tuple[int, int]], capacity: int, dtype: torch.dtype,
                   device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Zeroed cache buffers ``[1, heads, capacity, width]`` of ``dtype``, one per ``(heads, width)`` of
    ``shapes``: on the CPU carved from one fresh mapping advised for 2 MB pages (:mod:`hugepages`; fresh
    anonymous memory reads as zeros, and only the pages written become resident), each 64-byte aligned;
    elsewhere, or where huge pages are off, ``torch.zeros`` each."""
    size = torch.empty(0, dtype=dtype).element_size()
    counts = [heads * capacity * width for heads, width in shapes]
    if torch.device(device).type != "cpu" or not hugepages.enabled() or not counts:
        return [torch.zeros(1, h, capacity, w, dtype=dtype, device=device) for h, w in shapes]
    offsets, total = [], 0
    for n in counts:
        offsets.append(total)
        total += -(-n * size // hugepages.ALIGN) * hugepages.ALIGN
    arena = torch.from_numpy(hugepages.empty((total,), np.uint8, alone=True))
    return [arena[o : o + n * size].view(dtype).view(1, h, capacity, w)
            for o, n, (h, w) in zip(offsets, counts, shapes, strict=True)]  # fmt: skip


def kv_kind(dtype: torch.dtype | None) -> int:
    """The C code's name of a cache dtype (``fused_decoder.c``: KV_F32 0, KV_F16 1, KV_Q8 2)."""
    return 2 if dtype == Q8 else 1 if dtype == torch.float16 else 0


class KVCache:
    def __init__(self, num_layers: int, capacity: int, dtype: torch.dtype | None = None) -> None:
        self.capacity = capacity
        self.dtype = dtype  # storage dtype of every buffer; None: the dtype of the first keys written
        self.length = 0
        self._keys: list[torch.Tensor | None] = [None] * num_layers
        self._values: list[torch.Tensor | None] = [None] * num_layers
        self._layout = None  # the native slot copy's view of the buffers (see _native_layout); False: torch's
        self._pointers: tuple | None = None  # (shapes, dtype, pointers): buffer_pointers' answer, once all exist

    # -- the one named rewind ------------------------------------------------
    def commit(self, length: int) -> None:
        """Declare slots ``[0, length)`` final; everything after is scratch."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"cache length {length} outside [0, {self.capacity}]")
        self.length = length

    def move(self, src_slots: list[int], dst_start: int) -> None:
        """Copy entries of ``src_slots`` to ``dst_start, dst_start+1, ...`` in every layer.

        Used after tree verification: the accepted path's entries are scattered
        over the linearised tree and must become contiguous.
        """
        if list(src_slots) == list(range(dst_start, dst_start + len(src_slots))):
            return
        with torch.inference_mode():  # the buffers are inference tensors (created inside Engine.forward)
            self._move(src_slots, dst_start)

    def _move(self, src_slots: list[int], dst_start: int) -> None:
        in_order = all(s >= dst_start + i and (i == 0 or s > src_slots[i - 1]) for i, s in enumerate(src_slots))
        layout = self._native_layout() if in_order else None
        if layout is not None:  # one C call instead of two torch operations per buffer (0.33 ms for SmolLM2's 60)
            lib, ptrs, heads, dims, esize = layout
            src = np.asarray(src_slots, dtype=np.int64)
            lib.selfspec_move_slots(len(ptrs), ptrs.ctypes.data, heads.ctypes.data, dims.ctypes.data, self.capacity,
                                    src.ctypes.data, len(src), dst_start, esize)  # fmt: skip
            return
        for buffers in (self._keys, self._values):
            for buf in buffers:
                if buf is not None:
                    idx = torch.as_tensor(src_slots, device=buf.device)
                    buf[:, :, dst_start : dst_start + len(src_slots)] = buf.index_select(2, idx)

    def writer(self, start: int) -> _CacheWriter:
        """An object with HF's ``update(k, v, layer_idx)`` protocol writing at ``start``."""
        return _CacheWriter(self, start)

    def reader(self, end: int) -> _PrefixReader:
        """Like :meth:`writer`, but leaves the cache untouched: new keys and values are appended to a copy
        of slots ``[0, end)`` (for training passes, where autograd must see them)."""
        return _PrefixReader(self, end)

    def layer(self, idx: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots ``[0, end)`` of one layer (for tests and tools; an 8-bit cache's decoded)."""
        k, v = self._keys[idx], self._values[idx]
        assert k is not None and v is not None, f"layer {idx} was never written"
        if k.dtype == Q8:  # their values
            return q8_decode(k[:, :, :end]), q8_decode(v[:, :, :end])
        return k[:, :, :end], v[:, :, :end]

    def prefix(self, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of every layer's keys and values of slots ``[0, end)`` (``[1, heads, end, dim]``, the buffers'
        own dtype: bit for bit), for :class:`selfspec.core.prefix_store.PrefixStore`."""
        with torch.inference_mode():
            pairs = zip(self._keys, self._values, strict=True)
            return [(k[:, :, :end].clone(), v[:, :, :end].clone()) for k, v in pairs]

    def take_prefix(self, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's keys and values of slots ``[0, end)``, as :meth:`prefix` gives them but without a copy:
        views of this cache's own buffers, which the cache then lets go of (it is empty afterwards, and a later
        write allocates new buffers).  For a decoding's last use of its cache: handing it to the prefix store
        cost nothing where copying 10 MB (SmolLM2, 450 tokens) took 30 ms beside a loaded server's passes."""
        if any(b is None for b in self._keys + self._values):
            raise RuntimeError("take_prefix of a cache that was never written")
        with torch.inference_mode():
            pairs = [(k[:, :, :end], v[:, :, :end]) for k, v in zip(self._keys, self._values, strict=True)]
        n = len(self._keys)
        self._keys, self._values = [None] * n, [None] * n
        self._layout, self._pointers, self.length = None, None, 0
        return pairs

    def load_prefix(self, layers: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        """Fill slots ``[0, length)`` of an empty cache with ``layers`` (what :meth:`prefix` gave, the same dtype
        kept) and commit them."""
        if self.length or any(b is not None for b in self._keys):
            raise RuntimeError("load_prefix needs an empty cache")
        if length > self.capacity:
            raise RuntimeError(f"KV cache overflow: need {length} slots, have {self.capacity}")
        with torch.inference_mode():  # like the buffers Engine.forward allocates: inference tensors
            sources = [(buffers, i, src) for i, (k, v) in enumerate(layers)
                       for buffers, src in ((self._keys, k), (self._values, v))]  # fmt: skip
            if not sources:
                return self.commit(length)
            first = sources[0][2]
            for _, _, src in sources:
                if src.dtype != (self.dtype or first.dtype):
                    raise RuntimeError(f"a prefix of {src.dtype} entries for a cache of {self.dtype or first.dtype}")
            made = zeroed_buffers([(src.shape[1], src.shape[3]) for _, _, src in sources], self.capacity,
                                  first.dtype, first.device)  # fmt: skip
            for (buffers, i, src), buf in zip(sources, made, strict=True):
                buf[:, :, :length] = src[:, :, :length]
                buffers[i] = buf
        self.commit(length)

    def buffer_pointers(self, shapes: list[tuple[int, int]], dtype: torch.dtype) -> list[tuple[int, int]]:
        """Data pointers of every layer's key and value buffers (``[1, heads, capacity, head_dim]``, contiguous),
        allocating those never written; ``shapes``: (heads, head_dim) per layer.  For native code writing
        and reading the cache directly (:mod:`selfspec.core.fused`).  Remembered for the same ``shapes`` object:
        a buffer, once made, is never replaced (as :meth:`_native_layout` relies on too)."""
        memo = self._pointers
        if memo is not None and memo[0] is shapes and memo[1] == dtype:
            return memo[2]
        missing = [(buffers, i) for i in range(len(shapes)) for buffers in (self._keys, self._values)
                   if buffers[i] is None]  # fmt: skip
        made = zeroed_buffers([(shapes[i][0], row_width(shapes[i][1], dtype)) for _, i in missing], self.capacity,
                              dtype)  # fmt: skip
        for (buffers, i), buf in zip(missing, made, strict=True):
            buffers[i] = buf
        pointers = []
        for i, (heads, dim) in enumerate(shapes):
            dim = row_width(dim, dtype)
            for buffers in (self._keys, self._values):
                buf = buffers[i]
                if buf.shape != (1, heads, self.capacity, dim) or buf.dtype != dtype or not buf.is_contiguous():
                    raise RuntimeError(f"layer {i}: cache buffer {tuple(buf.shape)} {buf.dtype} does not fit")
            pointers.append((self._keys[i].data_ptr(), self._values[i].data_ptr()))
        self._pointers = (shapes, dtype, pointers)
        return pointers

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._keys + self._values if b is not None)

    def _native_layout(self):
        """(library, buffer pointers, heads, head dims, entry size) for the native slot copy, once every buffer
        exists as a contiguous float32, float16 or 8-bit block CPU tensor [1, heads, capacity, dim], all of one dtype
        (they never move after); None otherwise."""
        if self._layout is not None:
            return self._layout or None
        buffers = self._keys + self._values
        if not buffers or any(b is None for b in buffers):
            return None
        dtype = buffers[0].dtype
        if dtype not in (torch.float32, torch.float16, Q8) or not all(
                b.device.type == "cpu" and b.dtype == dtype and b.is_contiguous() and b.dim() == 4
                and b.shape[0] == 1 and b.shape[2] == self.capacity for b in buffers):  # fmt: skip
            self._layout = False
            return None
        from .quant import NativeUnavailable, native

        try:
            lib = native()
        except NativeUnavailable:
            self._layout = False
            return None
        ptrs = np.array([b.data_ptr() for b in buffers], dtype=np.uint64)
        heads = np.array([b.shape[1] for b in buffers], dtype=np.int64)
        dims = np.array([b.shape[3] for b in buffers], dtype=np.int64)
        self._layout = (lib, ptrs, heads, dims, buffers[0].element_size())
        return self._layout

    def _write(self, layer_idx: int, start: int, k: torch.Tensor, v: torch.Tensor):
        end = start + k.shape[2]  # k: [B, H, T, D]
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: need {end} slots, have {self.capacity}")
        kb = self._keys[layer_idx]
        dtype = self.dtype or k.dtype
        if kb is None:
            kb = self._keys[layer_idx] = torch.zeros(k.shape[0], k.shape[1], self.capacity,
                                                     row_width(k.shape[3], dtype), dtype=dtype, device=k.device)
            self._values[layer_idx] = torch.zeros(v.shape[0], v.shape[1], self.capacity,
                                                  row_width(v.shape[3], dtype), dtype=dtype, device=v.device)
        vb = self._values[layer_idx]
        if dtype == Q8:
            kb[:, :, start:end] = q8_encode(k)
            vb[:, :, start:end] = q8_encode(v)
            return q8_decode(kb[:, :, :end]).to(k.dtype), q8_decode(vb[:, :, :end]).to(v.dtype)
        kb[:, :, start:end] = k  # rounded where the cache stores another dtype
        vb[:, :, start:end] = v
        return kb[:, :, :end].to(k.dtype), vb[:, :, :end].to(v.dtype)


class _CacheWriter:
    """Per-call view handed to HF attention modules as ``past_key_values``."""

    __slots__ = ("_cache", "_start")

    def __init__(self, cache: KVCache, start: int) -> None:
        self._cache = cache
        self._start = start

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self._cache._write(layer_idx, self._start, key_states, value_states)


class _PrefixReader:
    """``past_key_values`` for training passes: committed slots plus the new entries, nothing written."""

    __slots__ = ("_cache", "_end")

    def __init__(self, cache: KVCache, end: int) -> None:
        self._cache = cache
        self._end = end

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        k, v = self._cache.layer(layer_idx, self._end)
        k, v = k.to(key_states.dtype, copy=True), v.to(value_states.dtype, copy=True)
        return torch.cat([k, key_states], dim=2), torch.cat([v, value_states], dim=2)
