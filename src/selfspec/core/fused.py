"""The fused decoder stack: all decoder layers of a quantised model in one native call per forward pass.

On a CPU, a small model's decoding step spent more time in Python and in the ~40 small torch operations
of each layer (norms, rotary, cache writes, attention plumbing, residual adds) than in its matrix
products.  ``fused_decoder.c`` (built with ``quant_kernels.c`` into one library, see
:mod:`selfspec.core.quant`) runs every layer over the T new tokens in one call instead; each token's row
is computed the same way whatever T is and wherever its keys sit in the cache, so one-token decoding,
chain and tree verification give it the same logits bit for bit (see the C file's header).

This module knows no model architecture: the adapter describes each layer as a :class:`FusedLayer`
(which quantised linears, which norm weights, which activation) and :class:`FusedStack` runs them.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from .cache import Q8, KVCache, kv_kind
from .quant import QuantLinear, int8_activations, low_bit_copy, native, prefill_kernel
from .skipset import SkipSet

ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu_new": 1, "gelu_fast": 1}
MAX_HEAD_DIM = 1024  # the C code's rotary scratch


class _QMat(ctypes.Structure):
    _fields_ = [("bits", ctypes.c_long), ("N", ctypes.c_long), ("K", ctypes.c_long), ("G", ctypes.c_long),
                ("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("minv", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("x16_codes", ctypes.c_void_p), ("x16_scale", ctypes.c_void_p),
                ("x16_min", ctypes.c_void_p), ("x16_form", ctypes.c_long)]  # fmt: skip


class _Layer(ctypes.Structure):
    _fields_ = [*((name, _QMat) for name in ("q", "k", "v", "o", "gate", "up", "down")),
                *((name, ctypes.c_void_p) for name in ("attn_in_norm", "attn_out_norm", "mlp_in_norm",
                                                       "mlp_out_norm", "q_norm", "k_norm")),
                ("eps", ctypes.c_double), ("norm_offset", ctypes.c_double), ("scaling", ctypes.c_double),
                *((name, ctypes.c_long) for name in ("n_heads", "n_kv", "head_dim", "hidden", "inter",
                                                     "act"))]  # fmt: skip


MAX_CACHED_SKIP_SETS = 256
# Low-bit drafts (:attr:`FusedStack.has_low_bit`): a 4-bit copy reads half a byte a weight and a half-precision
# scale per 32; copies are made only where they cut a draft pass's layer read by this share at least
Q4_COPY_BYTES = 0.5 + 2 / 32
LOW_BIT_MIN_SAVING = 0.10
IO_FIELDS = 5  # per layer: mask, cos, sin, key cache, value cache (pointers, the C struct layer_io)


@dataclass(frozen=True)
class FusedLayer:
    """One decoder layer as the native code sees it.  Norms compute ``x / rms(x) * (weight + norm_offset)``;
    the ``*_out_norm`` (Gemma 3's sandwich norms) and the per-head ``q_norm``/``k_norm`` may be None."""

    linears: tuple[QuantLinear, ...]  # q, k, v, o, gate, up, down
    attn_in_norm: torch.Tensor
    attn_out_norm: torch.Tensor | None
    mlp_in_norm: torch.Tensor
    mlp_out_norm: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float
    norm_offset: float
    scaling: float
    n_heads: int
    n_kv: int
    head_dim: int
    activation: str
    window: int | None  # sliding attention window (keys the engine's masks key by)
    rope_key: str  # which rotary table the layer uses


def _qmat(linear: QuantLinear, int8: bool) -> _QMat:
    """The C struct of one product; with ``int8``, the weight's interleaved copy for int8 activations too (its row
    form may then be released: NULL pointers, which the C code never reads while the pass quantises its rows)."""
    w = linear.qweight
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    packed = (w.x16() if int8 else None) or (None, None, None)
    return _QMat(4 if w.fmt == "q4" else 8, w.out_features, w.in_features, w.group, *w.row_pointers(),
                 ptr(linear.bias), *map(ptr, packed), 0 if packed[0] is None else w.x16_form)  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, offset: float, eps: float) -> torch.Tensor | None:
    """``x`` ``[..., n]`` normed as the stack's norms compute (``x / rms(x) * (weight + offset)``), a new tensor:
    the model's final norm on the stack's passes; None where the native code cannot take it (not float32 rows
    and weights on the CPU)."""
    if not (x.dtype == weight.dtype == torch.float32 and x.device.type == weight.device.type == "cpu"):
        return None
    n = x.shape[-1]
    if weight.shape != (n,) or x.requires_grad:
        return None
    x = x.contiguous()
    out = torch.empty_like(x)
    native().selfspec_rms_norm_rows(x.numel() // n, n, x.data_ptr(), weight.contiguous().data_ptr(), offset, eps,
                                    out.data_ptr())  # fmt: skip
    return out


def unsupported_reason(layer: FusedLayer) -> str | None:
    """Why the native code cannot run this layer (None when it can)."""
    if layer.activation not in ACTIVATIONS:
        return f"activation {layer.activation!r}"
    if layer.head_dim > MAX_HEAD_DIM or layer.head_dim % 2:
        return f"head dimension {layer.head_dim}"
    if layer.n_heads % layer.n_kv:
        return "query heads not a multiple of key/value heads"
    norms = (layer.attn_in_norm, layer.attn_out_norm, layer.mlp_in_norm, layer.mlp_out_norm, layer.q_norm,
             layer.k_norm)  # fmt: skip
    if any(n is not None and (n.dtype != torch.float32 or n.device.type != "cpu") for n in norms):
        return "norm weights not fp32 on the CPU"
    if any(m.qweight.device.type != "cpu" for m in layer.linears):
        return "weights not on the CPU"
    return None


class FusedStack:
    """Runs a model's decoder layers natively (see the module docstring)."""

    def __init__(self, layers: list[FusedLayer], *, lib: ctypes.CDLL | None = None) -> None:
        self.layers = layers
        self._lib = lib if lib is not None else native()  # another build (tests: the portable C path)
        # the tensors the C structs point to must live as long as this object: contiguous fp32 norm weights
        self._keep: list[torch.Tensor] = []
        self._low_linears: list[tuple[QuantLinear, ...]] | None = None  # draft precision q4: the layers' copies
        self._low_structs = None
        self._describe(int8_activations())
        self._windows = sorted({layer.window for layer in layers}, key=lambda w: (w is not None, w or 0))
        self._rope_keys = sorted({layer.rope_key for layer in layers})
        self._window_of = np.array([self._windows.index(layer.window) for layer in layers])
        self._rope_of = np.array([self._rope_keys.index(layer.rope_key) for layer in layers])
        self._skip_flags: dict[SkipSet, np.ndarray] = {}
        self.kv_shapes = tuple((layer.n_kv, layer.head_dim) for layer in layers)  # one object: caches remember it
        fn = self._lib.selfspec_fused_layers
        fn.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long,
                       ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                       ctypes.c_int, ctypes.c_int]  # fmt: skip
        fn.restype = ctypes.c_int
        self._fn = fn

    def _describe(self, int8: bool, *, release: bool = True) -> None:
        """The C structs of every layer; with ``int8``, products take int8 activations (``int8_kernels.c``) and,
        with ``release`` while the prompt takes the same kernels, the layers' weights keep their interleaved
        copy only (half the memory; the row form is rebuilt if anything reads it)."""
        self.int8 = int8
        # fp32 products and the blocked fp32 prompt kernel read the row form
        keep_rows = not int8 or not release or prefill_kernel() != "rows"
        for layer in self.layers:
            for m in layer.linears:
                if keep_rows:
                    m.qweight.restore_rows()
                else:
                    m.qweight.release_rows()
        self._released = self._first_released()  # run() re-releases when a read outside the stack rebuilt them
        self._keep.clear()
        self._structs = (_Layer * len(self.layers))(*(self._struct(layer) for layer in self.layers))
        self._low_structs = None  # remade on next use, for this mode

    def _first_released(self) -> bool:
        """Whether the first product's weight holds its interleaved copy only (it stands for every layer's)."""
        return self.layers[0].linears[0].qweight.rows_released

    @property
    def has_low_bit(self) -> bool:
        """Whether a low-bit draft (draft precision ``q4``) is worth its copies: they would cut a draft pass's read
        of the layers' weights by ``LOW_BIT_MIN_SAVING`` at least.  Where every weight is at 4 bits or fewer there
        is nothing to requantise; on a K-quant "M" mix of a 1-8B model (Q4_K with some Q6_K tensors) 4-bit copies
        of the Q6_K ones save ~6% of the read (a 1.5B Q4_K_M: 805 -> 754 MB) for ~200 MB more memory, which no
        draft can earn back (the 0.5B Qwen2.5 and Gemma 3 files, with Q5_0 / Q8_0 tensors, save 17-18%)."""
        own = low = 0
        for layer in self.layers:
            for m in layer.linears:
                size = m.qweight.step_bytes
                own += size
                low += size if self._four_bits_or_fewer(m) else m.in_features * m.out_features * Q4_COPY_BYTES
        return own > 0 and low <= (1 - LOW_BIT_MIN_SAVING) * own

    def _four_bits_or_fewer(self, m: QuantLinear) -> bool:
        """Whether a product reads its weight at 4 bits a code or fewer (q4; under int8 activations also Q2_K's,
        Q3_K's and IQ4's interleaved copies): a low-bit draft shares it."""
        return m.qweight.fmt == "q4" or (self.int8 and m.qweight.x16_code_bits <= 4)

    def low_bit_bytes(self) -> tuple[int, int]:
        """Bytes one pass reads of the layers' weights: (the model's own, the low-bit draft's)."""
        own = sum(m.qweight.step_bytes for layer in self.layers for m in layer.linears)
        low = sum(m.qweight.step_bytes for linears in self._low_bit_linears() for m in linears)
        return own, low

    def _low_bit_linears(self) -> list[tuple[QuantLinear, ...]]:
        """Each layer's products for low-bit drafts: 5-8-bit weights requantised to 4 bits (made once, a second or
        two for a 0.5B model; under int8 activations only their interleaved copy is kept), those read at 4 bits or
        fewer shared (:meth:`_four_bits_or_fewer`)."""
        if self._low_linears is None:
            self._low_linears = [tuple(m if self._four_bits_or_fewer(m) else self._low_bit(m) for m in layer.linears)
                                 for layer in self.layers]  # fmt: skip
        return self._low_linears

    def _low_bit(self, m: QuantLinear) -> QuantLinear:
        """The 4-bit copy of one product; under int8 activations packed and its row form dropped at once (the
        copies' row forms are never all held together: a 1.5B model's would take 120 MB more at the peak)."""
        low = QuantLinear(low_bit_copy(m.qweight), m.bias)
        if self.int8:
            low.qweight.release_rows()
        return low

    def _low_bit_structs(self):
        if self._low_structs is None:
            structs = []
            for layer, linears in zip(self.layers, self._low_bit_linears(), strict=True):
                for m, own in zip(linears, layer.linears, strict=True):
                    if m is own:
                        continue
                    if self.int8:  # the copies are multiplied only: packed, their row form goes (NULL in the struct)
                        m.qweight.release_rows()
                    else:  # fp32 activations read the row form (rebuilt if an int8 pass had dropped it)
                        m.qweight.restore_rows()
                structs.append(self._struct(layer, linears))
            self._low_structs = (_Layer * len(self.layers))(*structs)
        return self._low_structs

    def prepare_low_bit(self) -> None:
        """Make the low-bit copies and their structs now (else on the first low-bit pass)."""
        self._low_bit_structs()

    def release_low_bit(self) -> None:
        """Drop the low-bit copies (memory), made again if a draft asks for them."""
        self._low_linears = self._low_structs = None

    @property
    def released_bytes(self) -> int:
        """Bytes of row forms the layers' weights hold in their interleaved copy only."""
        return sum(m.qweight.step_bytes for layer in self.layers for m in layer.linears if m.qweight.rows_released)

    def _cosine_buffer(self, cosines: np.ndarray, shape: tuple[int, ...]) -> int:
        """The address of ``cosines``, checked to be a contiguous float32 array of ``shape``."""
        if cosines.dtype != np.float32 or cosines.shape != shape or not cosines.flags.c_contiguous:
            raise ValueError(f"cosines must be a contiguous float32 array of shape {shape}")
        return cosines.ctypes.data

    def _norm(self, weight: torch.Tensor | None) -> int | None:
        if weight is None:
            return None
        w = weight.detach().to(torch.float32).contiguous()
        self._keep.append(w)
        return w.data_ptr()

    def _struct(self, layer: FusedLayer, linears: tuple[QuantLinear, ...] | None = None) -> _Layer:
        q, k, v, o, gate, up, down = (_qmat(m, self.int8) for m in linears or layer.linears)
        return _Layer(q, k, v, o, gate, up, down, self._norm(layer.attn_in_norm), self._norm(layer.attn_out_norm),
                      self._norm(layer.mlp_in_norm), self._norm(layer.mlp_out_norm), self._norm(layer.q_norm),
                      self._norm(layer.k_norm), layer.eps, layer.norm_offset, layer.scaling, layer.n_heads,
                      layer.n_kv, layer.head_dim, layer.linears[3].out_features, layer.linears[4].out_features,
                      ACTIVATIONS[layer.activation])  # fmt: skip

    def _flags(self, skip: SkipSet) -> np.ndarray:
        flags = self._skip_flags.get(skip)
        if flags is None:
            if len(self._skip_flags) >= MAX_CACHED_SKIP_SETS:  # SWIFT's search tries many sets: stay bounded
                self._skip_flags.clear()
            flags = np.zeros(2 * len(self.layers), dtype=np.uint8)
            flags[0::2][list(skip.attention)] = 1
            flags[1::2][list(skip.mlp)] = 1
            self._skip_flags[skip] = flags
        return flags

    def run(self, h: torch.Tensor, *, cache: KVCache, start: int, skip: SkipSet, masks: dict,
            ropes: dict, cosines: np.ndarray | None = None, prompt: bool = False,
            low_bit: bool = False) -> torch.Tensor:  # fmt: skip
        """``h`` ``[1, T, hidden]`` through every layer (its new keys/values written at slots
        ``[start, start+T)``); ``masks`` by window: boolean ``[1, 1, T, start+T]`` or None (causal);
        ``ropes`` by rotary key: (cos, sin), each ``[1, T, head_dim]``.  ``cosines``: None, or float32
        ``[2 * layers]`` that receives each computed sublayer's mean cosine similarity of its input and output
        hidden states (attention of layer i at 2i, MLP at 2i+1; skipped sublayers keep their value).  ``prompt``:
        products of 65 rows or more take the blocked prompt kernel (``prompt_gemm.c``), whose rows differ from
        one-token rows in rounding; never for a pass whose rows are compared with one-token steps.  ``low_bit``
        (drafts only): the layers' 8-bit weights read from their 4-bit copies (:meth:`has_low_bit`)."""
        if self.int8 != int8_activations():  # the process-wide mode changed since the structs were made
            self._describe(not self.int8)
        elif self._released and not self._first_released():
            self._describe(self.int8)  # a pass outside the stack (fp32 tiles, while the mode was switched) read them
        if prompt and self.released_bytes:  # the blocked prompt kernel (asked for after load) reads row forms
            self._describe(self.int8, release=False)
        h = h.to(torch.float32, copy=True, memory_format=torch.contiguous_format)  # written in place
        T = h.shape[1]
        if start + T > cache.capacity:
            raise RuntimeError(f"KV cache overflow: need {start + T} slots, have {cache.capacity}")
        io, keep = self._io(cache, masks, ropes)
        structs = self._low_bit_structs() if low_bit else self._structs
        status = self._fn(len(self.layers), ctypes.addressof(structs), self._flags(skip).ctypes.data,
                          io.ctypes.data, T, start, cache.capacity, h.data_ptr(),
                          None if cosines is None else self._cosine_buffer(cosines, (2 * len(self.layers),)),
                          int(prompt),
                          int(self.int8), kv_kind(cache.dtype))  # fmt: skip
        del keep
        if status != 0:
            raise MemoryError("the fused decoder could not allocate its scratch memory")
        return h

    def run_batch(self, hs: list[torch.Tensor], *, caches: list[KVCache], starts: list[int], masks: list[dict],
                  ropes: list[dict], skip: SkipSet,
                  cosines: np.ndarray | None = None) -> list[torch.Tensor]:  # fmt: skip
        """Several sequences' passes in one native call (concurrent requests decoded together): ``hs[s]``
        ``[1, T_s, hidden]`` of sequence s through every layer, its keys/values written at slots
        ``[starts[s], starts[s] + T_s)`` of ``caches[s]``, under its ``masks[s]`` and ``ropes[s]`` (as
        :meth:`run` takes them).  Each sequence's rows come out as :meth:`run` gives them alone, bit for bit;
        the weights are read once for all of them.  ``cosines``: None, or float32 ``[sequences, 2 * layers]``
        that receives each sequence's mean cosines as :meth:`run`'s ``cosines`` does."""
        if self.int8 != int8_activations():
            self._describe(not self.int8)
        dtypes = {c.dtype for c in caches}
        if len(dtypes) != 1:
            raise ValueError(f"one batch needs caches of one dtype, not {sorted(map(str, dtypes))}")
        lengths = [h.shape[1] for h in hs]
        for cache, start, T in zip(caches, starts, lengths, strict=True):
            if start + T > cache.capacity:
                raise RuntimeError(f"KV cache overflow: need {start + T} slots, have {cache.capacity}")
        h = torch.cat([x.to(torch.float32) for x in hs], dim=1).contiguous()  # written in place
        ios, keep = zip(*(self._io(c, m, r) for c, m, r in zip(caches, masks, ropes, strict=True)), strict=True)
        io = np.ascontiguousarray(np.concatenate(ios))
        off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        start = np.asarray(starts, dtype=np.int64)
        cap = np.asarray([c.capacity for c in caches], dtype=np.int64)
        status = self._lib.selfspec_fused_layers_batch(
            ctypes.c_long(len(self.layers)), ctypes.c_void_p(ctypes.addressof(self._structs)),
            ctypes.c_void_p(self._flags(skip).ctypes.data), ctypes.c_void_p(io.ctypes.data),
            ctypes.c_long(len(hs)), ctypes.c_void_p(off.ctypes.data), ctypes.c_void_p(start.ctypes.data),
            ctypes.c_void_p(cap.ctypes.data), ctypes.c_void_p(h.data_ptr()),
            ctypes.c_void_p(None if cosines is None else self._cosine_buffer(cosines, (len(hs), 2 * len(self.layers)))),
            ctypes.c_int(int(self.int8)),
            ctypes.c_int(kv_kind(caches[0].dtype)))  # fmt: skip
        del keep
        if status != 0:
            raise MemoryError("the fused decoder could not allocate its scratch memory")
        return list(torch.split(h, lengths, dim=1))

    def _io(self, cache: KVCache, masks: dict, ropes: dict) -> tuple[np.ndarray, list]:
        """The C ``layer_io`` of every layer for one sequence ``[layers, 5]`` (mask, cos, sin, key and value
        cache pointers), and the tensors it points to (to be kept alive through the call)."""
        io = np.zeros((len(self.layers), IO_FIELDS), dtype=np.uint64)
        masks = [masks[w] for w in self._windows]
        masks = [None if m is None else m.contiguous() for m in masks]
        io[:, 0] = np.array([0 if m is None else m.data_ptr() for m in masks], dtype=np.uint64)[self._window_of]
        tables = [tuple(t.contiguous() for t in ropes[key]) for key in self._rope_keys]
        io[:, 1] = np.array([c.data_ptr() for c, _ in tables], dtype=np.uint64)[self._rope_of]
        io[:, 2] = np.array([s.data_ptr() for _, s in tables], dtype=np.uint64)[self._rope_of]
        kv_dtype = cache.dtype or torch.float32
        if kv_dtype not in (torch.float32, torch.float16, Q8):
            raise ValueError(f"the fused stack keeps its cache in float32, float16 or 8-bit blocks, not {kv_dtype}")
        io[:, 3:] = cache.buffer_pointers(self.kv_shapes, kv_dtype)
        return io, [masks, tables]
