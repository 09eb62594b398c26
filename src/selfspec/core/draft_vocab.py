"""The draft's vocabulary: LM-head rows a draft pass scores, grown from the tokens the model has seen.

A draft step of a small model with a large vocabulary is mostly its LM head: Gemma 3 270M's
262k x 640 head is over half of a one-token step, so skipping half its layers saves little.
A draft only proposes; the full model verifies every token with its full head, so a draft may
score any subset of the vocabulary and stay lossless: a token outside the subset cannot be
proposed (that draft is rejected, as any wrong draft is) and costs nothing else.

:class:`DraftVocabulary` keeps a growing copy of the head's quantised rows for a subset of
token ids: the ``base`` lowest ids (byte-level BPE vocabularies, like SmolLM2's, number their
frequent tokens first: its ids below 16k cover 93% of the tokens it generated on Spec-Bench),
then every token the full model is fed (the prompt, and each verified token as it is
committed), since text reuses its tokens (Gemma 3, whose ids are not frequency-ordered: ids
below 16k cover 62% of its generated tokens, with the tokens seen before 93%).  Draft passes
compute logits for those rows only; the rest are -inf.  Only quantised heads take this path
(see ``Engine``); ``SELFSPEC_DRAFT_VOCAB=0`` switches it off.  Under int8 activations
(:func:`~selfspec.core.quant.int8_activations`) the subset keeps an interleaved copy too and scores
with the head's own int8 products, so a draft's logit of a token is the full model's whenever the
draft skips nothing.
"""

from __future__ import annotations

import os

import torch

from . import hugepages
from .heap import return_free_heap
from .quant import QuantWeight, int8_activations, native, pack_x16

DRAFT_VOCAB_ENV = "SELFSPEC_DRAFT_VOCAB"
BASE_ROWS = 16384  # the lowest ids every draft scores
MIN_VOCAB = 2 * BASE_ROWS  # smaller vocabularies keep the full head (the subset would save little)
MAX_SHARE = 0.5  # the subset stops growing at this share of the vocabulary
# learned ids (the tokens read) kept beyond the base: past twice this many the oldest go, so that a long session's
# subset stays near the base's cost (a server reading ~30 new ids a request would otherwise grow it to its limit,
# half the vocabulary: Qwen's 76k rows, 4.7x the base's bytes in every draft step; 4096 rows are ~2% of a step)
LEARNED_KEEP = 4096
ADD_CHUNK = 2048  # rows copied from the head at a time


def enabled() -> bool:
    return os.environ.get(DRAFT_VOCAB_ENV, "1").strip() != "0"


class DraftVocabulary:
    """Rows of a quantised LM head ``[V, hidden]`` for a growing subset of token ids."""

    def __init__(self, head: QuantWeight, *, base: int = BASE_ROWS, keep: int = LEARNED_KEEP) -> None:
        self.head, self.keep = head, keep
        self.vocab_size = head.out_features
        self.limit = max(base, int(self.vocab_size * MAX_SHARE))  # rows at most
        self.member = torch.zeros(self.vocab_size, dtype=torch.bool)
        self._column = torch.full((self.vocab_size,), -1, dtype=torch.int64)  # id -> its column, -1 if absent
        self._known = bytearray(self.vocab_size)  # the same membership, cheap to test from Python per token
        self.size = self.capacity = 0
        self.ids = self._codes = self._scale = self._minv = None
        self._x16: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None  # made on first int8 product
        # under int8 activations the products read the interleaved copy only: no row copies are held (the head's
        # rows are read again where a block of the copy is remade); float32 products make them when first run
        self._hold_rows = not (int8_activations() and head.out_features % 16 == 0)
        self._allocate(min(self.limit, base + base // 2))
        self._append(torch.arange(min(base, self.vocab_size)))
        if not self._hold_rows:
            self._repack(0, self.capacity)  # at load: a first draft would pay it (20 ms on SmolLM2)
        self.base_size = self.size

    def add_to_base(self, token_ids) -> None:
        """Make these ids part of the base, which every draft scores for good (the model's end-of-sequence and
        end-of-turn tokens: Qwen2.5's ``<|im_end|>`` is id 151645, far past the lowest ids, so a draft could
        never propose the end of an answer and drafted on past it).  Called at load, before anything is learned."""
        if self.size != self.base_size:
            raise RuntimeError("add_to_base after ids were learned")
        ids = torch.as_tensor(list(token_ids), dtype=torch.int64).reshape(-1)
        ids = torch.unique(ids[(ids >= 0) & (ids < self.vocab_size)])
        ids = ids[~self.member[ids]]
        if len(ids):
            self._append(ids)
        self.base_size = self.size

    def learned(self) -> list[int]:
        """The ids added after the base, in the order they came (what :meth:`restore` takes back)."""
        return self.ids[self.base_size : self.size].tolist()

    @torch.inference_mode()
    def restore(self, learned: list[int]) -> None:
        """The subset as the base plus ``learned`` (a :meth:`learned` of earlier): every other id is dropped.
        A benchmark gives each method the vocabulary its own generations grew, so that no method drafts with
        tokens another one's answer to the same prompt brought in (bench/runner.py).  In inference mode, as
        :meth:`_append`: the model's passes make and grow the subset's tensors in it, and a caller outside it
        could not change them in place."""
        if self.learned() == list(learned):
            return
        dropped = self.ids[self.base_size : self.size]
        self.member[dropped] = False
        self._column[dropped] = -1
        for t in dropped.tolist():
            self._known[t] = 0
        self.size = self.base_size  # rows past it are stale until rewritten; products read only the first size
        if learned:
            self._append(torch.tensor(list(learned), dtype=torch.int64))

    def _allocate(self, rows: int) -> None:
        """Room for ``rows`` rows (rounded up to whole blocks of 16, zero beyond the subset), keeping the ones
        copied so far (the subset grows by doubling)."""
        head, n = self.head, self.size
        rows = -(-rows // 16) * 16

        def grown(old: torch.Tensor | None, width: int | None, dtype: torch.dtype) -> torch.Tensor | None:
            if width is None:
                return None
            new = torch.zeros((rows, width) if width else (rows,), dtype=dtype)
            if old is not None and n:
                new[:n] = old[:n]
            return new

        k, groups = head.in_features, head.in_features // head.group
        self.ids = grown(self.ids, 0, torch.int64)
        if self._hold_rows:
            q4 = head.fmt == "q4"
            self._codes = grown(self._codes, k // 2 if q4 else k, torch.uint8 if q4 else torch.int8)
            self._scale = grown(self._scale, groups, torch.float32)
            self._minv = grown(self._minv, groups if head.has_minima else None, torch.float32)
        self.capacity = rows
        self._x16 = None  # remade from the row copies on the next int8 product

    @property
    def nbytes(self) -> int:
        """Memory held by the copied rows (the allocated capacity, the interleaved copy included)."""
        parts = (self._codes, self._scale, self._minv, *(self._x16 or ()))
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def _rows(self, lo: int, hi: int) -> QuantWeight:
        """Copied rows ``lo..hi`` (whole blocks of 16; zero beyond the subset) as a weight of their own (read from
        the head again where no row copies are held)."""
        h = self.head
        if self._codes is not None:
            return QuantWeight(h.fmt, hi - lo, h.in_features, h.group, self._codes[lo:hi], self._scale[lo:hi],
                               None if self._minv is None else self._minv[lo:hi], h.source)  # fmt: skip
        codes, scale, minv = self._read_head(self.ids[lo : max(lo, min(hi, self.size))], hi - lo)
        return QuantWeight(h.fmt, hi - lo, h.in_features, h.group, codes, scale, minv, h.source)

    def _read_head(self, ids: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The head's row form of ``ids`` in ``rows`` rows (zero beyond them)."""
        h = self.head
        k, groups = h.in_features, h.in_features // h.group
        q4 = h.fmt == "q4"
        codes = torch.zeros(rows, k // 2 if q4 else k, dtype=torch.uint8 if q4 else torch.int8)
        scale = torch.zeros(rows, groups, dtype=torch.float32)
        minv = torch.zeros(rows, groups, dtype=torch.float32) if h.has_minima else None
        self._copy_head_rows(ids, (codes, scale, minv), 0)
        return codes, scale, minv

    def _copy_head_rows(self, ids: torch.Tensor, into: tuple, at: int) -> None:
        """The head's row form of ``ids`` written into the row tables ``into`` (codes, scale, minimum) from row
        ``at``, a few thousand rows at a time (the load's peak stays low; from the head's int8 copy if its rows
        are released)."""
        for i in range(0, len(ids), ADD_CHUNK):
            part = ids[i : i + ADD_CHUNK]
            for table, rows in zip(into, self.head.row_slices(part), strict=True):
                if table is not None:
                    table[at + i : at + i + len(part)] = rows

    def _repack(self, lo: int, hi: int) -> None:
        """Bring the interleaved copy up to date for rows ``lo..hi`` (or make it, for all rows)."""
        if self._x16 is None:
            self._build_x16()
        else:
            self._pack_blocks(lo // 16, -(-hi // 16))

    def _build_x16(self, whole: bool = False) -> None:
        """The interleaved copy of every row, a few thousand rows at a time (``whole``: in one piece)."""
        step = self.capacity if whole else max(16, ADD_CHUNK // 16 * 16)
        rows = self._rows(0, min(step, self.capacity))
        with hugepages.temporaries():  # (the copy grows: a new one each time, not the model's lasting weights)
            first, self._x16_form = rows.x16(), rows.x16_form  # (the form: bits, half scales)
        made = min(step, self.capacity) // 16  # blocks of 16 rows in the first piece
        per = [None if t is None else t.numel() // made for t in first]  # elements per block of 16 rows
        # read by every draft step: on 2 MB pages where the system gives them, each table in a mapping of its own
        # (unmapped when the subset outgrows it, core/hugepages.py)
        self._x16 = tuple(None if t is None else torch.from_numpy(hugepages.empty(m * (self.capacity // 16),
                                                                                  t.numpy().dtype, alone=True))
                          for t, m in zip(first, per, strict=True))  # fmt: skip
        for out, t, m in zip(self._x16, first, per, strict=True):
            if out is not None:
                out[: m * made] = t.reshape(-1)
        if step >= self.capacity:
            return
        for b0 in range(step // 16, self.capacity // 16, step // 16):
            if not self._pack_blocks(b0, min(b0 + step // 16, self.capacity // 16)):
                return
            return_free_heap()  # each piece's temporaries (a 1.5B model's 24k rows: 40 MB left resident else)

    def _pack_blocks(self, b0: int, b1: int) -> bool:
        """Repack blocks ``b0..b1`` of 16 rows into the copy; False where their scales take another form than the
        copy's (some not halves, or now all are): the whole copy is then made again in one piece."""
        fresh = pack_x16(self._rows(16 * b0, 16 * b1))
        if fresh[1].dtype != self._x16[1].dtype:
            self._x16 = None
            self._build_x16(whole=True)
            return False
        for whole, part in zip(self._x16, fresh, strict=True):
            if whole is None:  # symmetric q8: no minima
                continue
            per = whole.numel() // (self.capacity // 16)  # elements per block of 16 rows
            whole.view(-1)[b0 * per : b1 * per] = part.reshape(-1)
        return True

    def add(self, token_ids: torch.Tensor) -> None:
        """Score these ids in later drafts too (ids already in, or out of range, are ignored)."""
        ids = token_ids.reshape(-1).to(torch.int64).cpu()
        if len(ids) <= 16:  # a decoding step's few tokens: mostly known already, checked without tensor ops
            known, v = self._known, self.vocab_size
            if all(0 <= t < v and known[t] for t in ids.tolist()):
                return
        ids = ids[(ids >= 0) & (ids < self.vocab_size)]
        ids = ids[~self.member[ids]]
        if len(ids) == 0:
            return
        self._append(torch.unique(ids)[: self.limit - self.size])
        if self.size - self.base_size > 2 * self.keep:  # the newest `keep` stay (the tokens read last among them)
            self.restore(self.learned()[-self.keep :])

    @torch.inference_mode()
    def _append(self, ids: torch.Tensor) -> None:
        """Rows for ``ids`` (distinct, none in the subset yet) after the subset's, in that order (in inference
        mode whoever calls: see :meth:`restore`)."""
        if self.size + len(ids) > self.capacity:
            self._allocate(min(self.limit, max(2 * self.capacity, self.size + len(ids))))
        lo, hi = self.size, self.size + len(ids)
        if self._codes is not None:
            self._copy_head_rows(ids, (self._codes, self._scale, self._minv), lo)
        self.ids[lo:hi] = ids
        self.size = hi
        if self._x16 is not None:
            self._repack(lo, hi)
        self.member[ids] = True
        self._column[ids] = torch.arange(lo, hi)
        for t in ids.tolist():
            self._known[t] = 1

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden] @ rows.T``: the subset's logits ``[T, size]`` (fp32; row-exact kernels)."""
        x = x.to(torch.float32).contiguous()
        rows = x.shape[0]
        lib, head = native(), self.head
        if int8_activations() and head.out_features % 16 == 0:  # the head's own arithmetic, blocks of 16 rows
            if self._x16 is None:
                self._repack(0, self.capacity)
            n = -(-self.size // 16) * 16
            y = torch.empty(rows, n, dtype=torch.float32)
            codes, scale, minv = (None if t is None else t.data_ptr() for t in self._x16)
            if lib.selfspec_linear_x16(self._x16_form, rows, n, head.in_features, head.group,
                                       x.data_ptr(), codes, scale, minv, None, y.data_ptr()):  # fmt: skip
                raise MemoryError("no memory to quantise the activations of a draft's head")
            return y[:, : self.size]
        if self._codes is None:  # float32 products after int8 ones: the row copies, made once
            self._codes, self._scale, self._minv = self._read_head(self.ids[: self.size], self.capacity)
            self._hold_rows = True
        y = torch.empty(rows, self.size, dtype=torch.float32)
        minv = None if self._minv is None else self._minv.data_ptr()
        if head.fmt == "q4":
            lib.selfspec_linear_q4(rows, self.size, head.in_features, x.data_ptr(), self._codes.data_ptr(),
                                   self._scale.data_ptr(), minv, y.data_ptr())  # fmt: skip
        else:
            lib.selfspec_linear_q8(rows, self.size, head.in_features, head.group, x.data_ptr(),
                                   self._codes.data_ptr(), self._scale.data_ptr(), minv, y.data_ptr())  # fmt: skip
        return y

    def scatter(self, sub: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``[T, V]`` from the subset's: -inf outside the subset."""
        out = torch.full((sub.shape[0], self.vocab_size), float("-inf"), dtype=sub.dtype)
        out[:, self.ids[: self.size]] = sub
        return out

    def columns(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The subset's columns of these ids, in their order; -1 for an id outside the subset (or the
        vocabulary), so that what goes with each id (a count) stays with its column."""
        ids = token_ids.reshape(-1).to(torch.int64).cpu()
        inside = (ids >= 0) & (ids < self.vocab_size)
        cols = torch.full_like(ids, -1)
        cols[inside] = self._column[ids[inside]]
        return cols

    def token_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """Token ids of subset positions (argmax over the subset -> vocabulary ids)."""
        return self.ids[positions]
