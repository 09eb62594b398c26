"""The forward pass every method shares.

``Engine.forward`` runs T new tokens at explicit positions through the model,
writing their keys/values at explicit cache slots, with a per-call skip set
(attention and MLP sublayers separately) and an optional tree mask saying
which of the new tokens each new token may attend to.  During prefill it can
also measure, for every sublayer, the mean cosine similarity of the hidden
state before and after the sublayer's residual add (ASD's statistic).

Nothing here knows HF internals; :mod:`selfspec.adapters` does.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..arch.adapters import LlamaAdapter
from ..core import clock, draft_vocab, fused, kernels, native_thread, quant, thread_guard
from ..core.cache import Q8_BLOCK, KVCache, row_width
from ..core.skipset import NO_SKIP, SkipSet
from ..errors import InvalidInputError

HEAD_ROWS = 8  # rows per LM-head product when only the argmax is wanted
GUARDED_ROWS = 64  # passes of at most this many rows (decoding, not a prompt's prefill) are timed for the guard


def _exclusive(method):
    """One pass at a time on an engine: concurrent decodings (a server's slots, each in its thread) share its
    weights, native scratch and draft vocabulary; their passes take turns, or run together via
    :meth:`Engine.forward_batch`."""

    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    @functools.wraps(method)
    def run(self, *args, **kwargs):  # on the native thread where several threads decode (core/native_thread.py)
        return native_thread.run(locked, self, *args, **kwargs)

    return run


@dataclass(frozen=True)
class BatchItem:
    """One sequence's full-model pass in :meth:`Engine.forward_batch`, as :meth:`Engine.forward` takes it."""

    cache: KVCache
    input_ids: torch.Tensor  # [T]
    start: int
    positions: torch.Tensor | None = None
    tree_mask: torch.Tensor | None = None
    last_only: bool = False
    cosine_out: list | None = None  # receives the pass's SublayerCosine over these rows (ASD's prompt statistic)


@dataclass(frozen=True)
class SublayerCosine:
    """Mean over positions of cos(h_before, h_after) per layer (0-based)."""

    attention: tuple[float, ...]
    mlp: tuple[float, ...]


def _is_draft(draft: bool, skip: SkipSet) -> bool:
    """Whether a pass is a draft: asked to be, or a skip set, a draft precision or draft adapters in force."""
    return (draft or bool(skip.attention or skip.mlp) or kernels.active_draft_precision() is not None
            or kernels.active_draft_adapters() is not None)  # fmt: skip


class Engine:
    def __init__(self, adapter: LlamaAdapter) -> None:
        self.adapter = adapter
        self._lock = threading.RLock()
        self.num_layers = adapter.num_layers
        self.device = adapter.device
        self._windows = adapter.windows
        self._layer_types = adapter.layer_types
        specs, self.fused_reason = adapter.fused_layers()
        self._fused = None
        if specs:
            try:
                self._fused = fused.FusedStack(specs)
            except quant.NativeUnavailable as exc:
                self.fused_reason = str(exc)
        self.fused_enabled = self._fused is not None  # tests switch it off to compare with the module path
        # which code computes a pass (the cost profile's cache key: another build of the native code costs anew)
        self.path_signature = quant.library_path().stem if self._fused is not None else "modules"
        self.path_signature += "" if quant.compact_codes() else "+byte-codes"  # another weight form, other costs
        self.path_signature += "" if quant.sub_scales() else "+fp32-k-scales"
        head = adapter.quantized_head()
        self.draft_vocab = None  # drafts score a growing subset of the head's rows (core/draft_vocab.py)
        if head is not None and draft_vocab.enabled() and head.out_features >= draft_vocab.MIN_VOCAB:
            self.draft_vocab = draft_vocab.DraftVocabulary(head)
            self.path_signature += "+draft-vocab"
        if head is not None and quant.int8_activations():
            head.release_rows()  # its int8 copy serves the products, token lookups and the draft vocabulary

    @property
    def low_bit_drafts(self) -> bool:
        """Whether the draft precision ``q4`` (4-bit copies of the layers' 8-bit weights) saves anything here:
        the fused stack runs, and some layer weight is stored at 5-8 bits."""
        return self.fused and self._fused.has_low_bit

    def low_bit_bytes(self) -> tuple[int, int]:
        """Bytes of layer weights a full pass and a low-bit draft pass read (the copies made if need be)."""
        return self._fused.low_bit_bytes() if self.low_bit_drafts else (0, 0)

    def prepare_low_bit(self) -> None:
        """Make the low-bit draft copies now (under 2 s for a 0.5B model on 2 cores) rather than in the first draft."""
        if self.low_bit_drafts:
            self._fused.prepare_low_bit()

    def release_low_bit(self) -> None:
        """Free the low-bit draft copies (made again when a draft asks for them)."""
        if self._fused is not None:
            self._fused.release_low_bit()

    @property
    def fused(self) -> bool:
        """Whether decoding passes run the native fused decoder stack (:mod:`selfspec.core.fused`)."""
        return self._fused is not None and self.fused_enabled

    @property
    def prompt_rows_exact(self) -> bool:
        """Whether the prompt's prefill computes each row as a one-token step computes it (the fused stack with
        the row kernels: int8 activations, the default on quantised models), so that a prompt prefilled in
        chunks, alone or beside other sequences' rows in :meth:`forward_batch`, gets the same bits as a whole."""
        return self.fused and not quant.prefill_has_own_kernel() and quant.prefill_kernel() != "gemm"

    def new_cache(self, capacity: int) -> KVCache:
        """An empty cache of ``capacity`` slots; on the fused stack its entries are stored as
        :func:`selfspec.core.quant.kv_cache_dtype` says (halves in the int8 speed mode)."""
        if not self.fused:  # the modules' own dtype (the setting is the fused stack's)
            return KVCache(self.num_layers, capacity, None)
        refusal = self.kv_cache_refusal()
        if refusal:
            raise InvalidInputError(refusal)
        return KVCache(self.num_layers, capacity, quant.kv_cache_dtype())

    def kv_bytes_per_token(self) -> int | None:
        """Bytes of keys and values a token of context holds in a cache of :meth:`new_cache` (fused stack only; None
        elsewhere, where the modules' dtype decides)."""
        if not self.fused or self.kv_cache_refusal():
            return None
        dtype = quant.kv_cache_dtype()
        size = torch.empty(0, dtype=dtype).element_size()
        return sum(2 * heads * row_width(dim, dtype) * size for heads, dim in self._fused.kv_shapes)

    def kv_cache_refusal(self) -> str | None:
        """Why this model cannot keep the cache that :func:`selfspec.core.quant.kv_cache_mode` asks for (None if it
        can): 8-bit blocks are written and read by the fused stack alone, in blocks of 32 values of a head.  A
        model on torch's modules caches in its own dtype whatever the process-wide setting; ``load(kv_cache=...)``
        refuses it with this reason when asked for it by name."""
        if quant.kv_cache_mode() != "q8_0":
            return None
        if not self.fused:
            return (f"kv_cache q8_0 needs the fused CPU stack of quantised weights (a GGUF file, or --quantize); "
                    f"this model runs on torch modules ({self.fused_reason or 'switched off'})")  # fmt: skip
        odd = sorted({d for _, d in self._fused.kv_shapes if d % Q8_BLOCK})
        return f"kv_cache q8_0 needs head sizes that are multiples of {Q8_BLOCK}, not {odd[0]}" if odd else None

    @_exclusive
    @torch.inference_mode()
    def forward(
        self,
        cache: KVCache,
        input_ids: torch.Tensor,
        start: int,
        *,
        positions: torch.Tensor | None = None,
        skip: SkipSet = NO_SKIP,
        tree_mask: torch.Tensor | None = None,
        last_only: bool = False,
        cosine_out: list | None = None,
        visible: int | None = None,
        precision: torch.dtype | None = None,
        input_embeds: torch.Tensor | None = None,
        adapters: dict | None = None,
        prefill: bool = False,
        argmax_only: bool = False,
        subset: bool = False,
        draft: bool = False,
        hidden_out: list | None = None,
        head: bool = True,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None] | None:
        """Logits ``[T, V]`` (``[1, V]`` with ``last_only``) for ``input_ids`` ``[T]``.

        The new tokens are written at cache slots ``[start, start+T)`` and attend
        to slots ``[0, start)`` plus, among themselves, what ``tree_mask``
        ``[T, T]`` allows (causal when None).  ``positions`` default to the slots.
        ``visible`` (default ``start``) narrows the old slots they attend to to
        ``[0, visible)``: a draft scored teacher-forced on already committed
        tokens (SWIFT's matchness) must not see the full model's entries of them.
        ``precision`` (drafts only) computes the linear layers with weights in
        that dtype (see :func:`selfspec.core.kernels.draft_precision`).
        ``input_embeds`` ``[T, H]`` replaces the embedding of ``input_ids`` (S3D's
        mask tokens); ``adapters`` (drafts only) switches on low-rank updates of
        linear layers (see :func:`selfspec.core.kernels.draft_adapters`).
        When ``cosine_out`` is a list, a :class:`SublayerCosine` is appended to it.
        ``argmax_only``: the argmax token ids ``[T]`` instead of the logits (scoring a window of drafts).
        ``hidden_out``: a list that receives the final hidden states ``[1, T, H]`` (the last row only with
        ``last_only``), for :meth:`head_logits`; ``head=False``: those states and the cache entries alone (None).
        ``subset`` (drafts): ``(logits, ids)``, a draft's logits over the draft vocabulary only and their token
        ids (``ids`` None: the whole vocabulary), sparing a draft step the work on a ``[T, V]`` tensor.
        ``draft``: a draft pass even with nothing skipped (its head scores the draft vocabulary, its tokens are
        not the full model's input); a skip set, a draft precision or adapters make any pass a draft.
        ``prefill`` (the prompt, which every method passes alike) lets quantised products of many rows take a
        faster path whose rows are not bit-equal to one-token products (see :func:`selfspec.core.quant.bulk_rows`).
        """
        if not head and hidden_out is None:
            raise ValueError("a pass without its head (head=False) needs hidden_out for its hidden states")
        again = dict(positions=positions, skip=skip, tree_mask=tree_mask, last_only=last_only, cosine_out=cosine_out,
                     visible=visible, input_embeds=input_embeds, argmax_only=argmax_only, subset=subset, draft=draft,
                     hidden_out=hidden_out, head=head)  # fmt: skip
        if prefill and (quant.prefill_has_own_kernel() or not self.fused):  # the fused stack runs its own
            with quant.bulk_rows():
                return self.forward(cache, input_ids, start, precision=precision, adapters=adapters, **again)
        if precision is not None or adapters is not None:
            with kernels.draft_precision(precision), kernels.draft_adapters(adapters):
                return self.forward(cache, input_ids, start, **again)
        T = input_ids.shape[0]
        draft = _is_draft(draft, skip)
        clock.charge(self, T, skip=skip, precision=kernels.active_draft_precision(), draft=draft,
                     last_only=last_only, head=head)  # simulated only; fmt: skip
        if positions is None:
            positions = torch.arange(start, start + T, device=self.device)
        if self.draft_vocab is not None and not draft and input_embeds is None:
            self.draft_vocab.add(input_ids)  # tokens the full model is fed: the prompt, verified tokens
        h = self.adapter.embed(input_ids.view(1, T)) if input_embeds is None else input_embeds.view(1, T, -1)
        ropes = self.adapter.rotary(h, positions.view(1, T))
        fused = self.fused and not quant.bulk_active() and kernels.active_draft_adapters() is None
        masks = self._masks(start, positions, tree_mask, start if visible is None else visible, causal_as_none=fused)
        if fused:
            prompt = prefill and quant.prefill_kernel() == "gemm"  # (the other prompt kernels never get here)
            low_bit = kernels.active_draft_precision() == quant.LOW_BIT_DRAFT  # draft precision q4
            h = self._fused_pass(h, cache, start, skip, ropes, masks, cosine_out, prompt, low_bit)
        else:
            h = self._module_pass(h, cache, start, skip, ropes, masks, cosine_out)
        if hidden_out is not None:
            hidden_out.append(h[:, -1:] if last_only else h)
        return self._head(h, last_only, argmax_only, draft, subset) if head else None

    @_exclusive
    @torch.inference_mode()
    def head_logits(self, hidden: list[torch.Tensor]) -> torch.Tensor:
        """The full model's logits ``[T, V]`` of final hidden states (``[1, t, H]`` each, as ``hidden_out`` of
        :meth:`forward` collects them), in one head product."""
        h = torch.cat(hidden, dim=1)
        clock.charge_head(self, h.shape[1])  # simulated only
        return self._head(h, False, False)

    @_exclusive
    @torch.inference_mode()
    def forward_batch(self, items: list[BatchItem]) -> list[torch.Tensor]:
        """Full-model passes of several sequences (concurrent requests' rounds) at once: the logits of each
        item, as :meth:`forward` gives them for it alone, bit for bit.  On the fused stack one native pass reads
        the weights once for all rows and one head product scores them; elsewhere the items run in turn."""
        if not self.fused or len(items) == 1 or quant.bulk_active():
            return [self.forward(it.cache, it.input_ids, it.start, positions=it.positions, tree_mask=it.tree_mask,
                                 last_only=it.last_only, cosine_out=it.cosine_out) for it in items]  # fmt: skip
        clock.charge(self, sum(it.input_ids.shape[0] for it in items), skip=NO_SKIP, precision=None)
        adapter, masks, lengths, every = self.adapter, [], [], []
        for it in items:
            T = it.input_ids.shape[0]
            positions = it.positions if it.positions is not None else torch.arange(it.start, it.start + T,
                                                                                   device=self.device)  # fmt: skip
            if self.draft_vocab is not None:
                self.draft_vocab.add(it.input_ids)
            lengths.append(T)
            every.append(positions)
            masks.append(self._masks(it.start, positions, it.tree_mask, it.start, causal_as_none=True))
        # one embedding lookup and one rotary table for every row (each row's values as alone: row-wise work)
        ids = torch.cat([it.input_ids for it in items])
        h_all = adapter.embed(ids.view(1, -1))
        hs = list(torch.split(h_all, lengths, dim=1))
        tables = adapter.rotary(h_all, torch.cat(every).view(1, -1))
        parts = {key: (c.split(lengths, dim=1), s.split(lengths, dim=1)) for key, (c, s) in tables.items()}
        ropes = [{key: (c[i], s[i]) for key, (c, s) in parts.items()} for i in range(len(items))]
        cos = None if all(it.cosine_out is None for it in items) else \
            np.full((len(items), 2 * self.num_layers), np.nan, dtype=np.float32)  # fmt: skip
        t0 = time.perf_counter()
        outs = self._fused.run_batch(hs, caches=[it.cache for it in items], starts=[it.start for it in items],
                                     masks=masks, ropes=ropes, skip=NO_SKIP, cosines=cos)  # fmt: skip
        for it, row in zip(items, cos if cos is not None else [], strict=False):
            if it.cosine_out is not None:
                it.cosine_out.append(SublayerCosine(tuple(map(float, row[0::2])), tuple(map(float, row[1::2]))))
        rows_in = tuple(h.shape[1] for h in hs)
        thread_guard.observe((id(self), rows_in), 1000 * (time.perf_counter() - t0))
        rows = [h[:, -1:] if it.last_only else h for h, it in zip(outs, items, strict=True)]
        logits = self._head(torch.cat(rows, dim=1), False, False)  # one head product for every row
        return list(torch.split(logits, [r.shape[1] for r in rows]))

    def _fused_pass(self, h: torch.Tensor, cache: KVCache, start: int, skip: SkipSet, ropes, masks,
                    cosine_out: list | None, prompt: bool, low_bit: bool = False) -> torch.Tensor:  # fmt: skip
        """The decoder layers in the native fused stack (timed for the thread guard when a decoding pass), the
        mean cosines around each sublayer appended to ``cosine_out`` when it is a list; ``low_bit``: a draft
        reading the 4-bit copies of the 8-bit weights (draft precision q4)."""
        T = h.shape[1]
        cos = np.full(2 * self.num_layers, np.nan, dtype=np.float32) if cosine_out is not None else None
        watched = T <= GUARDED_ROWS  # decoding's passes: the thread guard watches them (core/thread_guard.py)
        t0 = time.perf_counter()
        with contextlib.nullcontext() if watched else thread_guard.unwatched():  # a prompt: on the kept count
            h = self._fused.run(h, cache=cache, start=start, skip=skip, masks=masks, ropes=ropes, cosines=cos,
                                prompt=prompt, low_bit=low_bit)  # fmt: skip
        if watched:
            thread_guard.observe((id(self), T, skip, low_bit), 1000 * (time.perf_counter() - t0))
        if cos is not None:
            cosine_out.append(SublayerCosine(tuple(map(float, cos[0::2])), tuple(map(float, cos[1::2]))))
        return h

    def _module_pass(self, h: torch.Tensor, cache: KVCache, start: int, skip: SkipSet, ropes, masks,
                     cosine_out: list | None) -> torch.Tensor:  # fmt: skip
        """The decoder layers as torch modules (no fused stack): ``h`` [1, T, H] through every kept sublayer,
        the mean cosines around each appended to ``cosine_out`` when it is a list."""
        adapter, collect = self.adapter, cosine_out is not None
        kv = cache.writer(start)
        attn_cos = [float("nan")] * self.num_layers
        mlp_cos = [float("nan")] * self.num_layers
        for i in range(self.num_layers):
            if i not in skip.attention:
                h_new = adapter.attention(i, h, ropes[self._layer_types[i]], masks[self._windows[i]], kv)
                if collect:
                    attn_cos[i] = F.cosine_similarity(h, h_new, dim=-1).mean().item()
                h = h_new
            if i not in skip.mlp:
                h_new = adapter.mlp(i, h)
                if collect:
                    mlp_cos[i] = F.cosine_similarity(h, h_new, dim=-1).mean().item()
                h = h_new
        if collect:
            cosine_out.append(SublayerCosine(tuple(attn_cos), tuple(mlp_cos)))
        return h

    def _head(self, h: torch.Tensor, last_only: bool, argmax_only: bool, draft: bool = False,
              subset: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        adapter = self.adapter
        if last_only:
            h = h[:, -1:]
        if draft and self.draft_vocab is not None:
            sub = adapter.draft_head(h, self.draft_vocab, self.fused)
            if argmax_only:
                return self.draft_vocab.token_ids(sub.argmax(-1))
            if subset:
                return sub, self.draft_vocab.ids[: self.draft_vocab.size]
            return self.draft_vocab.scatter(sub)
        if subset:
            return self._head(h, False, argmax_only, draft), None
        if argmax_only:  # the head a few rows at a time: never a [T, V] tensor (V = 262k for Gemma 3)
            rows = h.shape[1]
            return torch.cat([adapter.head(h[:, i : i + HEAD_ROWS], self.fused)[0].argmax(-1)
                              for i in range(0, rows, HEAD_ROWS)])  # fmt: skip
        return adapter.head(h, self.fused)[0]  # [T, V]

    @_exclusive
    def forward_train(
        self,
        prefix: KVCache,
        prefix_len: int,
        input_embeds: torch.Tensor,
        positions: torch.Tensor,
        attend: torch.Tensor,
        skip: SkipSet,
    ) -> torch.Tensor:
        """Logits ``[T, V]`` with autograd on, for training draft-only parameters (S3D).

        ``input_embeds`` ``[T, H]`` at ``positions`` ``[T]`` attend to the
        committed slots ``[0, prefix_len)`` of ``prefix`` and to each other as
        ``attend`` ``[T, prefix_len + T]`` (bool) allows; the prefix is read,
        never written, so many independent draft blocks can share one forward.
        """
        T = input_embeds.shape[0]
        adapter = self.adapter
        h = input_embeds.view(1, T, -1)
        ropes = adapter.rotary(h, positions.view(1, T))
        key_pos = torch.cat([torch.arange(prefix_len, device=self.device), positions])
        masks = self._window_masks(attend, positions, key_pos)
        kv = prefix.reader(prefix_len)
        for i in range(self.num_layers):
            if i not in skip.attention:
                h = adapter.attention(i, h, ropes[self._layer_types[i]], masks[self._windows[i]], kv)
            if i not in skip.mlp:
                h = adapter.mlp(i, h)
        return adapter.head(h)[0]

    def _window_masks(self, base: torch.Tensor, positions: torch.Tensor, key_pos: torch.Tensor) -> dict:
        masks: dict = {}
        T, K = base.shape
        for w in set(self._windows):
            m = base
            if w is not None:
                m = base & ((positions[:, None] - key_pos[None, :]) < w)
            masks[w] = m.view(1, 1, T, K)
        return masks

    def _masks(self, start: int, positions: torch.Tensor, tree_mask: torch.Tensor | None, visible: int,
               causal_as_none: bool = False) -> dict:  # fmt: skip
        """Boolean attention masks ``[1, 1, T, start+T]`` keyed by sliding window (None = full).  With
        ``causal_as_none`` (the fused stack, whose None is causal for any T) a window's mask that would only be
        causal (each row every old slot and the new ones up to its own, no key past the window) is None too: the
        stack then reads a row's slots in order instead of listing them from its mask row in every layer (a
        prompt of T tokens listed T^2/2 slots per layer and key/value head)."""
        T = positions.shape[0]
        windows = set(self._windows)
        last_pos = start + T - 1 if tree_mask is None else int(positions.max())
        bites = {w: w is not None and last_pos + 1 > w for w in windows}
        causal = tree_mask is None and visible == start and (T == 1 or causal_as_none)
        if causal and not any(bites.values()):
            return dict.fromkeys(windows)  # every query attends to every key up to its own: no mask needed
        if tree_mask is None:
            tree_mask = torch.ones(T, T, dtype=torch.bool, device=self.device).tril_()
        old = torch.zeros(T, start, dtype=torch.bool, device=self.device)
        old[:, :visible] = True
        base = torch.cat([old, tree_mask], dim=1)
        key_pos = torch.cat([torch.arange(start, device=self.device), positions])
        masks = self._window_masks(base, positions, key_pos)
        return {w: None if causal and not bites[w] else m for w, m in masks.items()}
