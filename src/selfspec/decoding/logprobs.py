"""Log-probabilities of the generated tokens: what OpenAI's ``logprobs`` / ``top_logprobs`` report.

They are the full model's own distribution at each position (a log-softmax of its logits), before temperature,
top-k/p, min-p and penalties shape what is sampled, as vLLM reports by default.  Every token the decoder emits
was chosen from a row of the full model's logits, whether that row came from a one-token step (vanilla), a
verification pass over a draft, or the model's own draft steps (``vocab``); so the figures do not depend on the
method: greedy, a speculative method reports the log-probabilities vanilla decoding reports (equal bits where
the engine computes a verification row as a one-token row, float32 rounding apart elsewhere).  Computing them
costs a log-softmax over the vocabulary per token (about 0.1-0.5 ms on a CPU), paid only when asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core.prefix_store import PrefixStore
from ..errors import InvalidInputError
from ..model.models import Model
from .limits import check_lengths

MAX_TOP = 20  # OpenAI's bound on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One token: its id, its log-probability under the model, and the ``top`` most likely tokens at its
    position (id, log-probability), most likely first (empty when none were asked for).  ``logprob`` is None
    only for the first token of a prompt (:func:`prompt_logprobs`), which nothing before it predicts."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


def check_top(top: int | None) -> int | None:
    """``top`` (None: no log-probabilities), validated: 0 asks for the chosen tokens' only."""
    if top is None:
        return None
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP:
        raise InvalidInputError(f"logprobs must be an integer between 0 and {MAX_TOP} (the alternatives reported "
                                f"per token), got {top!r}")  # fmt: skip
    return top


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """``tokens[i]``'s log-probability under ``logits[i]`` (``[n, V]``), with the ``top`` best of each row."""
    if logits.shape[0] != len(tokens):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(tokens)} tokens")
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(tokens), dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, ids[:, None])[:, 0].tolist()
    if top:
        values, indices = lp.topk(min(top, lp.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(int(t), float(c), k) for t, c, k in zip(tokens, chosen, tops, strict=True)]


PROMPT_CHUNK = 64  # prompt rows scored per pass: [64, V] float32 logits (39 MB for a 152k vocabulary) at a time


def prompt_logprobs(model: Model, ids: Sequence[int], top: int, store: PrefixStore | None = None,
                    ) -> list[TokenLogprob]:  # fmt: skip
    """Each prompt token's log-probability given the tokens before it (OpenAI's ``echo`` with ``logprobs``, how
    evaluation harnesses score a continuation): a pass of the full model over the prompt in chunks, each row as
    a verification pass computes it; the first token's entry has ``logprob`` None.  ``store``: the pass's keys
    and values are kept there (where it keeps exact ones), so that a generation after the prompt prefills only
    its last token instead of reading the prompt again."""
    check_lengths(model, len(ids), 1)
    engine = model.engine
    cache = engine.new_cache(len(ids))
    tokens = torch.tensor(list(ids), dtype=torch.long, device=engine.device)
    out = [TokenLogprob(int(ids[0]), None)]
    for a in range(0, len(ids) - 1, PROMPT_CHUNK):
        b = min(len(ids) - 1, a + PROMPT_CHUNK)  # rows [a, b) predict tokens [a + 1, b + 1)
        logits = engine.forward(cache, tokens[a:b], a)
        out.extend(token_logprobs(logits, tokens[a + 1 : b + 1].tolist(), top))
    if store is not None:  # slots [0, len - 1): every prompt token but the last, which scores nothing here
        cache.commit(len(ids) - 1)
        store.save(engine, list(ids[:-1]), cache)
    return out
