"""Prefix reuse: the keys and values of recent sequences, so that a new prompt prefills only what follows its
longest cached prefix.

Where it sits in the data flow::

    prompt ─► tokenize ─► PrefixStore.lookup (longest cached prefix) ─► copy its slots into a fresh cache
           ─► prefill the rest (at least the last prompt token: its logits give the first new token)
           ─► decode ─► PrefixStore.save (prompt and committed output, copied out of the cache)

A chat resends its whole conversation each turn; the second turn then prefills only its new message, not the
first turn's prompt and answer again (llama.cpp's ``cache_prompt``, vLLM's and SGLang's prefix caching).

**Bounded.**  Entries are kept by memory (``max_bytes``), least recently used evicted first; an entry whose
tokens are a prefix of a newly saved sequence is merged into it; a sequence larger than the whole bound keeps
its first tokens only.  Entries are scanned linearly for the longest common prefix (a store holds tens of
sequences, each compared in one numpy operation).

**Exact.**  A request's output must not depend on whether its prefix came from here.  That holds where every
row of the prompt's pass is computed as a one-token decoding step computes it, whatever the pass's number of
rows and wherever its keys sit in the cache: the fused native stack with the int8 row kernels for the prompt
(the default where the CPU has AVX512-VNNI; :func:`selfspec.core.quant.prefill_kernel` ``rows``).  Then the
keys and values of a prefix are the same bits whether a prefill computed them in one pass, in several, or a
decoding step did (the previous answer), and the copies here are of the cache's own storage dtype (IEEE halves
under int8 activations), bit for bit.  Elsewhere (transformers' modules, the blocked ``gemm`` or bf16 prompt
kernels) a row's rounding depends on the pass, so :func:`inexact_reason` says why and the store stays unused.

**Sliding windows** (Gemma 3: 15 of 18 layers see the last 512 positions) need nothing special: the cache
keeps every slot of every layer and the attention mask applies the window, so a reused prefix longer than the
window is exact too.  The store keeps the sliding layers' old slots as well (a shorter later match may need
them), which costs their memory.

**ASD's statistic.**  ASD (and ``auto``, whose layer-skip source it is) chooses skip sets from the mean over
prompt positions of each sublayer's cosine similarity, measured during prefill.  A prefix from here was not
run through the full model now, and the answer tokens of an earlier turn were decoded, never measured.  So an
entry keeps *marks* (:class:`CosineMark`): at a length c, the sum of each sublayer's cosine over the positions
below c that a prefill measured, and their count.  A request that wants the statistic reuses its whole match;
its prefill measures the new tokens, and its statistic is the mean over every measured position: the longest
mark within the match plus the new tokens (a second turn: the first turn's prompt and the second's question,
not the first answer between them).  Where the match's marks cover it whole (a prompt extending an earlier
prompt) that is a fresh prefill's statistic to float32 rounding (combined in float64); where an earlier answer
lies inside, it is the statistic of the measured positions only.  Running the full model over that answer
again to measure it cost as much as re-reading it (a second turn of ``auto``: 20-30% of its time, measured),
which is what reuse saves.  Outputs do not depend on the statistic (every method is lossless under greedy and
coupled sampling), only their speed does; under rejection sampling (exact in distribution) other drafts mean
other draws, so a seeded second turn may differ from a whole prefill's there, as two runs whose drafts differ may.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import quant
from .cache import KVCache

DEFAULT_MB = 256  # a Session's and `selfspec serve`'s default bound (SmolLM2: ~23 kB a token, ~11k tokens)
MB = 1 << 20


def inexact_reason(engine: Any) -> str | None:
    """Why a reused prefix would not be bit-identical to a fresh prefill on ``engine`` (None: it would)."""
    if not engine.fused:
        return ("the model runs on transformers' modules, whose products round a row differently with the number "
                "of rows in the pass")  # fmt: skip
    if quant.prefill_has_own_kernel() or quant.prefill_kernel() != "rows":
        return (
            f"the prompt's products take the {quant.prefill_kernel()!r} kernel (prefill dtype "
            f"{str(quant.prefill_dtype()).removeprefix('torch.')}), whose rows differ in rounding from "
            "one-token rows; reuse needs the row kernels (int8 activations, the default wherever the native "
            "kernels build)"
        )
    return None


def _signature(engine: Any) -> tuple:
    """What an entry's bits depend on besides the tokens (a process-wide mode may change between calls)."""
    return (quant.int8_activations(), quant.kv_cache_dtype(), quant.prefill_kernel(), engine.path_signature)


@dataclass(frozen=True)
class CosineMark:
    """ASD's statistic so far: each sublayer's cosine summed over ``count`` measured positions, float64 [2L]
    (attention sublayers first), so that parts measured apart combine exactly to float32 rounding."""

    sums: np.ndarray
    count: int

    def plus(self, sums: np.ndarray, count: int) -> CosineMark:
        return CosineMark(self.sums + sums, self.count + count)


@dataclass
class _Entry:
    tokens: np.ndarray  # int64 [n]
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, H, n, D] in the cache's dtype
    signature: tuple
    marks: dict[int, CosineMark] = field(default_factory=dict)  # length c -> measured cosines below c

    @property
    def nbytes(self) -> int:
        """The memory the entry keeps: its tensors' whole storage, each storage once (a cache handed over whole,
        see :meth:`PrefixStore.save`, keeps its slots past the entry's tokens too, and its buffers may share
        one mapping: core/cache.py)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for pair in self.layers for t in pair}
        return sum(storages.values())


@dataclass(frozen=True)
class Hit:
    """What a lookup found: copy ``length`` slots; the tokens agree for ``common`` positions."""

    entry: _Entry
    length: int  # slots to copy into the new cache (< the prompt's length)
    common: int  # tokens the prompt shares with the entry
    mark: CosineMark | None  # the longest mark within the match (a method wanting ASD's statistic); None: none
    mark_at: int  # the length that mark holds for (0: none)

    def marks(self) -> dict[int, CosineMark]:
        """The entry's marks that hold for the prompt too (within the shared tokens)."""
        return {c: s for c, s in self.entry.marks.items() if c <= self.common}


@dataclass(frozen=True)
class StoreStats:
    lookups: int
    hits: int
    reused_tokens: int  # prompt tokens whose keys and values were copied from the store
    prefilled_tokens: int  # prompt tokens run through the model by lookups' prefills
    entries: int
    bytes: int
    max_bytes: int
    evictions: int


class PrefixStore:
    """Keys and values of recent sequences keyed by their tokens (see the module docstring).  Thread-safe."""

    def __init__(self, max_bytes: int = DEFAULT_MB * MB) -> None:
        if max_bytes < 0:
            raise ValueError(f"the prefix store's bound must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._next = 0
        self._bytes = 0
        self._engine: weakref.ref | None = None
        self._lock = threading.Lock()
        self._lookups = self._hits = self._reused = self._prefilled = self._evictions = 0

    @classmethod
    def of_mb(cls, mb: float) -> PrefixStore:
        return cls(int(mb * MB))

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def usable(self, engine: Any) -> bool:
        return self.enabled and inexact_reason(engine) is None

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(self._lookups, self._hits, self._reused, self._prefilled, len(self._entries),
                              self._bytes, self.max_bytes, self._evictions)  # fmt: skip

    def copy(self) -> PrefixStore:
        """A store holding the same entries (their tensors shared: entries are never written in place), counters
        at zero: a benchmark repeats a request against the same cached state."""
        with self._lock:
            other = PrefixStore(self.max_bytes)
            for key, e in self._entries.items():
                other._entries[key] = _Entry(e.tokens, e.layers, e.signature, dict(e.marks))
            other._next, other._bytes, other._engine = self._next, self._bytes, self._engine
            return other

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    # -- lookup and restore ----------------------------------------------------------------------
    def lookup(self, engine: Any, tokens: list[int], *, cosine: bool = False) -> Hit | None:
        """The longest usable cached prefix of ``tokens`` (None: none).  At least the last token is left to
        run (its logits give the first new token); with ``cosine``, the hit also names the longest cosine mark
        within the match (the positions after it are measured by the decoder)."""
        if not self.usable(engine) or len(tokens) < 2:
            return None
        query = np.asarray(tokens, dtype=np.int64)
        n = len(query)
        with self._lock:
            self._lookups += 1
            self._check_engine(engine)
            sig = _signature(engine)
            best: Hit | None = None
            for key, entry in self._entries.items():
                if entry.signature != sig:
                    continue
                common = _common_prefix(entry.tokens, query)
                hit = _hit(entry, common, n, cosine)
                if hit is not None and (best is None or hit.length > best.length):
                    best, best_key = hit, key
            if best is None:
                self._prefilled += n
                return None
            self._entries.move_to_end(best_key)
            self._hits += 1
            self._reused += best.length
            self._prefilled += n - best.length
            return best

    def restore(self, hit: Hit, cache: KVCache) -> int:
        """Copy the hit's slots into ``cache`` (fresh, empty) and commit them; the number of slots."""
        cache.load_prefix([(k[:, :, : hit.length], v[:, :, : hit.length]) for k, v in hit.entry.layers], hit.length)
        return hit.length

    # -- save ----------------------------------------------------------------------------------------
    def save(self, engine: Any, tokens: list[int], cache: KVCache, marks: dict[int, CosineMark] | None = None, *,
             take: bool = False) -> None:  # fmt: skip
        """Keep the keys and values of ``tokens`` (the cache's committed slots ``[0, len(tokens))``), with the
        cosine ``marks`` that hold for them.  ``take``: the caller is done with ``cache``; the store may keep its
        buffers rather than a copy (it does when the tokens fill at least half of them: a copy otherwise, so
        that a short answer under a large ``max_tokens`` does not keep the unused room), and the cache is then
        left empty."""
        if not self.usable(engine) or len(tokens) < 2:
            return
        n = min(len(tokens), cache.length)
        per_token = cache.nbytes() // max(cache.capacity, 1)
        if per_token == 0:
            return
        n = min(n, self.max_bytes // per_token)  # larger than the whole bound: its first tokens only
        if n < 2:
            return
        seq = np.asarray(tokens[:n], dtype=np.int64)
        marks = {c: s for c, s in (marks or {}).items() if c <= n}
        with self._lock:
            self._check_engine(engine)
            sig = _signature(engine)
            for key, entry in list(self._entries.items()):
                if entry.signature != sig:
                    continue
                common = _common_prefix(entry.tokens, seq)
                if common == n:  # already held (an equal or longer sequence): its marks gain ours
                    entry.marks.update(marks)
                    self._entries.move_to_end(key)
                    return
                if common == len(entry.tokens):  # ours extends it: it goes, its marks come along
                    marks = {**entry.marks, **marks}
                    self._drop(key)
            whole = take and 2 * n >= cache.capacity and cache.nbytes() <= self.max_bytes
            entry = _Entry(seq, cache.take_prefix(n) if whole else cache.prefix(n), sig, marks)
            self._entries[self._next] = entry
            self._next += 1
            self._bytes += entry.nbytes
            while self._bytes > self.max_bytes and self._entries:
                self._drop(next(iter(self._entries)))
                self._evictions += 1

    # -- internals -----------------------------------------------------------------------------------
    def _drop(self, key: int) -> None:
        self._bytes -= self._entries.pop(key).nbytes

    def _check_engine(self, engine: Any) -> None:
        """A store serves one model: another one's entries are of no use (and may not even fit)."""
        current = self._engine() if self._engine is not None else None
        if current is not engine:
            if current is not None or self._entries:
                self._entries.clear()
                self._bytes = 0
            self._engine = weakref.ref(engine)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


def _hit(entry: _Entry, common: int, n: int, cosine: bool) -> Hit | None:
    """How much of ``entry`` a prompt of ``n`` tokens sharing ``common`` with it can reuse (all of the shared
    tokens but the prompt's last); with ``cosine``, the longest mark within them."""
    length = min(common, n - 1)
    if length <= 0:
        return None
    upto = max((c for c in entry.marks if c <= min(common, n)), default=0) if cosine else 0
    return Hit(entry, length, common, entry.marks.get(upto), upto)
