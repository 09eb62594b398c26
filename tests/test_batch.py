"""Concurrent requests decoded together (decoding/batch.py, Engine.forward_batch): each sequence's logits in a
batched pass are bit for bit its logits alone; decodings sharing a batcher give, per request, the tokens they
give alone (greedy and seeded sampling; mixed methods and lengths; one consumer leaving early); a draft is
priced by the batch it runs in."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest
import torch

from selfspec.api import Session
from selfspec.core.sampling import SamplingParams
from selfspec.cost.costs import CostProfile, DraftCosts
from selfspec.cost.economy import Economy
from selfspec.decoding import batch_share
from selfspec.decoding.batch import StepBatcher
from selfspec.decoding.loop import prefill
from selfspec.model.engine import BatchItem
from selfspec.server.worker import default_parallel, prompt_chunk

PROMPTS = ["The capital of France is", "def reverse(xs):\n    return", "Once upon a time, in a land far away,",
           "List three colours: red, green,"]  # fmt: skip


def _prefilled(model, prompt: str, room: int = 24):
    engine = model.engine
    ids = torch.tensor(model.encode(prompt))
    cache = engine.new_cache(len(ids) + room)
    engine.forward(cache, ids, 0, prefill=True)
    cache.commit(len(ids))
    return cache


def _copy(engine, cache):
    twin = engine.new_cache(cache.capacity)
    twin.load_prefix(cache.prefix(cache.length), cache.length)
    return twin


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_a_batched_pass_gives_each_sequence_its_logits_alone(name, request):
    model = request.getfixturevalue(name)
    engine = model.engine
    assert engine.fused, "the batched native pass is what this tests"
    caches = [_prefilled(model, p) for p in PROMPTS[:3]]
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root and two children
    items = [
        lambda c: BatchItem(c, torch.tensor([42]), c.length, last_only=True),  # a plain step
        lambda c: BatchItem(c, torch.tensor([5, 6, 7, 8]), c.length),  # a chain of drafts
        lambda c: BatchItem(c, torch.tensor([9, 10, 11]), c.length, tree_mask=tree,
                            positions=torch.tensor([c.length, c.length + 1, c.length + 1])),  # fmt: skip
    ]
    alone = [engine.forward(it.cache, it.input_ids, it.start, positions=it.positions, tree_mask=it.tree_mask,
                            last_only=it.last_only)
             for it in (make(_copy(engine, c)) for make, c in zip(items, caches, strict=True))]  # fmt: skip
    batched_caches = [_copy(engine, c) for c in caches]
    together = engine.forward_batch([make(c) for make, c in zip(items, batched_caches, strict=True)])
    for a, b in zip(alone, together, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)
    # the keys and values written are the ones a pass alone writes
    twin = _copy(engine, caches[1])
    engine.forward(twin, torch.tensor([5, 6, 7, 8]), twin.length)
    for layer in range(engine.num_layers):
        k1, v1 = twin.layer(layer, twin.length + 4)
        k2, v2 = batched_caches[1].layer(layer, twin.length + 4)
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_a_member_away_does_not_hold_the_batch(smollm2):
    """While a member copies a prefix (``away``: no pass of its own coming), the others' passes run without it;
    back, it takes part again."""
    engine = smollm2.engine
    batcher, mine, theirs = StepBatcher(engine), _prefilled(smollm2, PROMPTS[0]), _prefilled(smollm2, PROMPTS[1])
    inside, release, back = threading.Event(), threading.Event(), threading.Event()

    def away_for_a_while():
        with batcher.member():
            with batcher.away():
                inside.set()
                release.wait(60)
            back.set()
            batcher.forward(BatchItem(theirs, torch.tensor([7]), theirs.length, last_only=True))

    with batcher.member():
        other = threading.Thread(target=away_for_a_while)
        other.start()
        assert inside.wait(60)
        logits = batcher.forward(BatchItem(mine, torch.tensor([5]), mine.length, last_only=True))
        assert logits.shape[0] == 1 and batcher.stats.sequences == 1  # ran alone: the other was away
        release.set()
        assert back.wait(60)
        batcher.forward(BatchItem(mine, torch.tensor([6]), mine.length, last_only=True))
    other.join(60)
    assert not other.is_alive() and batcher.stats.passes >= 2 and batcher.members == 0


LONG = ("A long prompt read in chunks: " + " ".join(f"item {i} is {i * i % 97};" for i in range(120)) +
        " The last item is")  # fmt: skip


@contextmanager
def _beside_another_decoding(model, batcher):
    """Inside the block the calling thread is a member of ``batcher`` and another member decodes plain steps of
    its own sequence in a thread, so that the caller's passes share the batch."""
    other = _prefilled(model, PROMPTS[0], room=64)
    stepped = threading.Event()

    def decode_beside():
        with batcher.member():
            while not stepped.is_set():
                batcher.forward(BatchItem(other, torch.tensor([42]), other.length, last_only=True))

    with batcher.member():
        thread = threading.Thread(target=decode_beside)
        thread.start()
        try:
            yield
        finally:
            stepped.set()
    thread.join(60)


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_a_prompt_prefilled_in_batch_chunks_is_a_whole_prefill(name, request):
    """Beside another decoding, a prompt read in chunks of the batch's passes leaves the keys, values and last
    logits a whole prefill leaves (prompt rows are computed as one-token rows), or runs alone where they are not."""
    model = request.getfixturevalue(name)
    engine, ids = model.engine, model.encode(LONG)
    alone = prefill(model, ids, max_new_tokens=8, cosine=True)  # with ASD's statistic of the prompt
    batcher = StepBatcher(engine, prompt_chunk=37)
    with _beside_another_decoding(model, batcher):
        chunked = prefill(model, ids, max_new_tokens=8, batcher=batcher, cosine=True)
    assert torch.equal(alone.last_logits, chunked.last_logits) and alone.first_token == chunked.first_token
    for a, b in ((alone.cosine.attention, chunked.cosine.attention), (alone.cosine.mlp, chunked.cosine.mlp)):
        assert b == pytest.approx(a, abs=1e-6), "the chunks' means combine into the whole prompt's"
    n = len(ids)
    for layer in range(engine.num_layers):
        for a, b in zip(alone.cache.layer(layer, n), chunked.cache.layer(layer, n), strict=True):
            assert torch.equal(a, b)
    if engine.prompt_rows_exact:
        assert batcher.stats.sequences > batcher.stats.passes, "the prompt's chunks shared passes"
        assert batcher.stats.rows >= n
    else:
        assert batcher.stats.rows < n, "a prefill whose rows differ from one-token rows runs alone"


def _alone(model, jobs) -> dict[int, tuple[int, ...]]:
    """Each job's tokens when it runs alone (the jobs that run to their end), for :func:`_run_together`'s."""
    return {i: Session(model, m, prefix_cache=0).generate(
                p, max_new_tokens=n, temperature=s.temperature, top_p=s.top_p, seed=s.seed).token_ids
            for i, (m, p, n, s, stop) in enumerate(jobs) if stop is None}  # fmt: skip


def _run_together(model, jobs, batcher):
    """Each job (method, prompt, max_new_tokens, sampling, stop_after) in its own thread, sessions sharing the
    batcher; stop_after: close the stream after that many pieces (a client leaving), None: run to the end."""
    results: dict[int, tuple[int, ...] | str] = {}
    start = threading.Barrier(len(jobs))

    def run(i, method, prompt, n, sampling, stop_after):
        session = Session(model, method, prefix_cache=0, batcher=batcher)
        start.wait()
        pieces = session.pieces(prompt, max_new_tokens=n, sampling=sampling)
        for k, _ in enumerate(pieces):
            if stop_after is not None and k + 1 >= stop_after:
                pieces.close()
                results[i] = "left"
                return
        results[i] = session.last_result.token_ids

    threads = [threading.Thread(target=run, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not any(t.is_alive() for t in threads), "a decoding waited for ever"
    return results


@pytest.mark.slow
def test_concurrent_decodings_give_each_request_its_tokens_alone(smollm2):
    seeded = SamplingParams(temperature=0.7, top_p=0.9, seed=11)
    jobs = [("vanilla", PROMPTS[0], 24, SamplingParams(), None), ("pld", PROMPTS[1], 40, SamplingParams(), None),
            ("asd", PROMPTS[2], 32, SamplingParams(), None), ("auto", PROMPTS[3], 16, seeded, None),
            ("swift", PROMPTS[1], 20, SamplingParams(), None), ("vanilla", PROMPTS[2], 48, SamplingParams(), 3),
            ("pld", PROMPTS[0], 48, seeded, None), ("vanilla", LONG, 16, SamplingParams(), None)]  # fmt: skip
    alone = _alone(smollm2, jobs)
    batcher = StepBatcher(smollm2.engine)
    together = _run_together(smollm2, jobs, batcher)
    assert together.pop(5) == "left"
    assert together == alone
    stats = batcher.stats
    assert stats.passes > 0 and stats.sequences > stats.passes, "rounds of several requests ran in one pass"
    assert batcher.members == 0, "every decoding left the batch"


@pytest.mark.slow
def test_low_bit_drafts_in_a_batch_keep_each_requests_tokens(gemma3):
    """Drafts from the 4-bit copies (method lowbit, ``draft_dtype=q4``) beside other requests: the batch's pass
    verifies them with the model's own weights, so each request gets its tokens alone."""
    seeded = SamplingParams(temperature=0.7, top_p=0.9, seed=5)
    jobs = [("lowbit", PROMPTS[0], 32, SamplingParams(), None), ("vanilla", PROMPTS[1], 24, SamplingParams(), None),
            ("lowbit", PROMPTS[2], 24, seeded, None), ("asd", PROMPTS[3], 24, SamplingParams(), None)]  # fmt: skip
    alone = _alone(gemma3, jobs)
    batcher = StepBatcher(gemma3.engine)
    assert _run_together(gemma3, jobs, batcher) == alone
    assert batcher.stats.sequences > batcher.stats.passes


def _profile(forward_ms: dict[int, float]) -> CostProfile:
    return CostProfile("hand-written", forward_ms, {"same": DraftCosts(0.1, 0.3, 0.5, 1.0)}, 4)


def test_a_draft_is_priced_by_the_batch_it_runs_in():
    # a pass costs 10 ms for up to 4 rows, then 2 ms per further row
    economy = Economy(_profile({1: 10.0, 4: 10.0, 8: 18.0, 16: 34.0}), draft_ms_predicted=1.0)
    try:
        assert economy.verify_ms(4) - economy.verify_ms(1) == 0.0  # alone: three more rows are free
        assert economy.token_ms == economy.ms_per_token
        batch_share.record(batch_share.Share(members=4, rows_beside=6))
        assert economy.verify_ms(1) == 10.0  # a plain round keeps its price
        assert economy.verify_ms(4) - economy.verify_ms(1) == pytest.approx(6.0)  # beside 6 rows: 2 ms each
        assert economy.token_ms == pytest.approx(economy.ms_per_token / 4)  # a round's time is shared by 4
        assert economy.worth_leaf(1.0, tree_size=1), "a sure token (worth 10/4 ms) pays a 2 ms row"
        assert not economy.worth_leaf(0.7, tree_size=1), "0.7 of a token (1.75 ms) does not"
    finally:
        batch_share.reset()
    assert economy.worth_leaf(0.7, tree_size=1), "alone, the same leaf is free"


def test_the_default_number_of_slots_follows_the_batch_curve():
    assert default_parallel(_profile({1: 10.0, 2: 10.5, 4: 12.0, 8: 20.0})) == 4
    assert default_parallel(_profile({1: 10.0, 2: 14.0, 4: 22.0})) == 2
    assert default_parallel(_profile({1: 10.0, 2: 20.0, 4: 40.0})) == 1


def test_prompt_chunks_are_the_fewest_rows_read_nearly_as_fast_as_the_most():
    # per row: 8 rows 2.5 ms, 16 rows 1.5, 32 rows 1.0, 64 rows 0.98 (within 2% of 32) or 0.95 (5% below it)
    assert prompt_chunk(_profile({1: 10.0, 8: 20.0, 16: 24.0, 32: 32.0, 64: 63.0})) == 32  # within CHUNK_SLACK
    assert prompt_chunk(_profile({1: 10.0, 8: 20.0, 16: 24.0, 32: 32.0, 64: 61.0})) == 64  # 5% cheaper per row
    assert prompt_chunk(_profile({1: 10.0, 8: 12.0, 16: 24.0, 64: 96.0})) == 8  # per row rises with rows
    assert prompt_chunk(_profile({1: 10.0, 2: 11.0, 4: 12.0})) == StepBatcher.PROMPT_CHUNK  # no grid to read
