"""The draft's vocabulary (core/draft_vocab.py): draft passes score a growing subset of the LM head's rows, exactly
as the full head scores them; verification keeps the full head; every method stays lossless."""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.core.draft_vocab import DraftVocabulary
from selfspec.core.quant import quantize_weight
from selfspec.core.skipset import NO_SKIP, SkipSet


@pytest.mark.parametrize("bits", [8, 4])
def test_subset_rows_score_as_the_full_head_does(bits):
    head = quantize_weight(torch.randn(3000, 64, generator=torch.Generator().manual_seed(0)), bits)
    vocab = DraftVocabulary(head, base=100)
    assert vocab.size == 100 and torch.equal(vocab.ids[:100], torch.arange(100))
    vocab.add(torch.tensor([2500, 7, 2500, 1999, -1, 3000]))  # repeats, known, out-of-range ids are ignored
    assert vocab.size == 102 and set(vocab.ids[100:102].tolist()) == {1999, 2500}
    vocab.add(torch.arange(400, 700))  # past the first allocation: grows, keeping the rows copied before
    assert vocab.size == 402 and vocab.capacity >= 402
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    full = head.matmul(x)
    sub = vocab.product(x)
    assert torch.equal(sub, full[:, vocab.ids[: vocab.size]])  # the same kernel: bit-identical rows
    logits = vocab.scatter(sub)
    inside = vocab.member
    assert torch.equal(logits[:, inside], full[:, inside]) and torch.all(logits[:, ~inside] == float("-inf"))
    assert torch.equal(vocab.token_ids(sub.argmax(-1)), torch.where(inside, full, float("-inf")).argmax(-1))


def test_ids_added_to_the_base_stay_whatever_is_learned_and_restored():
    """The end-of-sequence ids join the base at load (Qwen2.5's <|im_end|> is id 151645): a benchmark's restore
    and the learned ids' eviction keep them, and the base cannot grow once ids were learned."""
    head = quantize_weight(torch.randn(3000, 64, generator=torch.Generator().manual_seed(0)), 8)
    vocab = DraftVocabulary(head, base=100)
    vocab.add_to_base([2999, 5, 2999, 4000])  # repeats, known and out-of-range ids are ignored
    assert vocab.base_size == vocab.size == 101 and bool(vocab.member[2999])
    vocab.add(torch.tensor([1500, 1600]))
    assert vocab.learned() == [1500, 1600]
    vocab.restore([])
    assert vocab.size == 101 and bool(vocab.member[2999]) and not bool(vocab.member[1500])
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(vocab.product(x), head.matmul(x)[:, vocab.ids[: vocab.size]])
    vocab.add(torch.tensor([1700]))
    with pytest.raises(RuntimeError, match="after ids were learned"):
        vocab.add_to_base([1800])


def test_a_loaded_models_end_of_sequence_ids_are_in_its_draft_vocabulary(smollm2):
    vocab = smollm2.engine.draft_vocab
    assert vocab is not None and smollm2.eos_token_ids
    assert all(bool(vocab.member[i]) and i in vocab.ids[: vocab.base_size].tolist() for i in smollm2.eos_token_ids)


def test_the_subset_stops_growing_at_half_the_vocabulary():
    head = quantize_weight(torch.randn(1000, 32), 8)
    vocab = DraftVocabulary(head, base=100)
    vocab.add(torch.arange(1000))
    assert vocab.size == 500 and int(vocab.member.sum()) == 500


def test_draft_passes_score_the_subset_and_verification_the_full_head(smollm2):
    engine = smollm2.engine
    vocab = engine.draft_vocab
    assert vocab is not None and vocab.vocab_size == smollm2.adapter.vocab_size
    ids = torch.tensor(smollm2.encode("Tokens of the prompt join the draft's vocabulary: Zyzzyva quokka."))
    cache = engine.new_cache(len(ids) + 8)
    engine.forward(cache, ids, 0, prefill=True)
    assert bool(vocab.member[ids].all())  # the prompt's tokens, whatever their ids
    tok = ids[-1:]
    full = engine.forward(cache, tok, len(ids))
    half = SkipSet(attention=frozenset(range(1, engine.num_layers, 2)), mlp=frozenset())
    draft = engine.forward(cache, tok, len(ids), skip=half)
    assert torch.all(draft[:, ~vocab.member] == float("-inf"))
    assert torch.all(torch.isfinite(draft[:, vocab.member])) and torch.all(torch.isfinite(full))
    # with nothing skipped but a lower precision, a draft is the full model over the subset's rows
    same = engine.forward(cache, tok, len(ids), skip=NO_SKIP, precision=torch.float16)
    assert torch.equal(same[:, vocab.member], full[:, vocab.member])
    argmax = engine.forward(cache, tok, len(ids), skip=half, argmax_only=True)
    assert torch.equal(argmax, draft.argmax(-1))


def test_methods_stay_lossless_with_the_draft_vocabulary(gemma3):
    """Gemma 3 (262k tokens, ids not frequency-ordered): drafts that cannot name a token are rejected, nothing
    else; the outputs equal vanilla's."""
    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    ref = selfspec.generate(gemma3, prompt, method="vanilla", max_new_tokens=40)
    skips = SkipSet(attention=frozenset(range(4, 14, 2)), mlp=frozenset(range(5, 14, 3)))
    for method, options in (("swift", {}), ("asd", {"preset": "paper"}), ("static", {"skip_set": skips})):
        out = selfspec.generate(gemma3, prompt, method=method, max_new_tokens=40, **options)
        assert out.token_ids == ref.token_ids, method
    assert gemma3.engine.draft_vocab.size > 16384  # the prompt's and the answers' tokens joined


def test_minus_infinity_outside_the_subset_is_a_usable_draft_but_nan_is_not():
    from selfspec.drafters.layerskip import broken_draft

    row = torch.full((10,), float("-inf"))
    row[3] = 1.5
    assert not broken_draft(row) and not broken_draft(torch.stack([row, row]))
    assert broken_draft(torch.full((10,), float("-inf")))  # nothing finite: nothing to propose
    for bad in (float("nan"), float("inf")):
        broken = row.clone()
        broken[5] = bad
        assert broken_draft(broken)


def test_layer_skip_drafts_are_proposed_and_accepted_with_the_draft_vocabulary(smollm2):
    """A skip set that keeps most of the model drafts tokens the full model keeps (a draft whose logits are -inf
    outside the subset must not be mistaken for a broken one)."""
    assert smollm2.engine.draft_vocab is not None
    skips = SkipSet(attention=frozenset({10, 20}), mlp=frozenset({15}))
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    ref = selfspec.generate(smollm2, prompt, method="vanilla", max_new_tokens=32)
    out = selfspec.generate(smollm2, prompt, method="static", skip_set=skips, max_new_tokens=32)
    assert out.token_ids == ref.token_ids
    assert out.stats.drafted > 0 and out.stats.accepted > 0


def test_a_draft_skipping_nothing_scores_the_subset_and_is_accepted(smollm2):
    """engine.forward(draft=True) with nothing skipped: every sublayer, the head over the draft vocabulary only
    (the full pass's logits on its rows), its tokens not joining the vocabulary; as a static draft it keeps
    vanilla's tokens and nearly every drafted one is accepted."""
    engine = smollm2.engine
    vocab = engine.draft_vocab
    ids = torch.tensor(smollm2.encode("A draft that skips nothing saves its head."))
    cache = engine.new_cache(len(ids) + 8)
    engine.forward(cache, ids, 0, prefill=True)
    tok = torch.tensor([vocab_outsider(vocab)])
    size = vocab.size
    draft = engine.forward(cache, tok, len(ids), draft=True)
    assert vocab.size == size, "a drafted token is no input of the full model"
    member = vocab.member.clone()
    full = engine.forward(cache, tok, len(ids))
    assert bool(vocab.member[tok].all()), "... but the full model's input is"
    assert torch.all(draft[:, ~member] == float("-inf"))
    assert torch.equal(draft[:, member], full[:, member])
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    ref = selfspec.generate(smollm2, prompt, method="vanilla", max_new_tokens=32)
    out = selfspec.generate(smollm2, prompt, method="static", skip_set=NO_SKIP, draft_length=4, max_new_tokens=32)
    assert out.token_ids == ref.token_ids
    assert out.stats.drafted > 0 and out.stats.accepted >= 0.9 * out.stats.drafted


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_the_vocab_method_verifies_by_the_head_alone_and_keeps_vanillas_tokens(name, request):
    """Method ``vocab``: the whole model drafts over its draft vocabulary; each round's full logits come from the
    full head over the draft passes' own hidden states (no verification pass).  Greedy and seeded coupled
    sampling give vanilla's tokens; tokens outside the vocabulary at first join it as they are verified."""
    from selfspec.decoding import loop

    model = request.getfixturevalue(name)
    passes = []
    real = loop.engine_pass
    loop.engine_pass = lambda engine, item: passes.append(item) or real(engine, item)
    try:
        for prompt in ("The capital of France is", "def fibonacci(n):\n    "):
            passes.clear()
            ref = selfspec.generate(model, prompt, "vanilla", max_new_tokens=40)
            assert len(passes) == len(ref.token_ids) - 1, "the hook sees every verification pass"
            passes.clear()
            out = selfspec.generate(model, prompt, "vocab", max_new_tokens=40)
            assert out.token_ids == ref.token_ids
            assert out.stats.drafted > 0 and out.stats.accepted > 0
            assert not any(len(p.input_ids) > 1 for p in passes), "no verification pass over drafted tokens"
        kw = {"temperature": 0.8, "top_p": 0.95, "seed": 5}
        ref = selfspec.generate(model, "Once upon a time", "vanilla", max_new_tokens=40, **kw)
        assert selfspec.generate(model, "Once upon a time", "vocab", max_new_tokens=40, **kw).token_ids == ref.token_ids
    finally:
        loop.engine_pass = real


def test_a_pass_without_its_head_gives_the_states_and_entries_of_one_with_it(smollm2, monkeypatch):
    """``forward(head=False)`` (the last step of a head-only verification): the same hidden states and cache
    entries as the pass with its head, no logits, no head product; under the simulated clock it is charged less
    than the pass with its head by its head's rows; without ``hidden_out`` it is refused."""
    from selfspec.core import clock
    from selfspec.cost.costs import read_bound_profile

    engine = smollm2.engine
    ids = torch.tensor(smollm2.encode("The head of a draft step scores the draft vocabulary."))
    products = []
    product = engine.draft_vocab.product
    monkeypatch.setattr(engine.draft_vocab, "product", lambda x: products.append(1) or product(x))
    caches, states = [], []
    for head in (True, False):
        cache = engine.new_cache(len(ids) + 4)
        engine.forward(cache, ids[:-1], 0, prefill=True)
        hidden: list = []
        products.clear()
        out = engine.forward(cache, ids[-1:], len(ids) - 1, last_only=True, draft=True, hidden_out=hidden, head=head)
        assert (out is None) == (not head)
        assert len(products) == (1 if head else 0), "the draft head is computed only by a pass with its head"
        caches.append(cache)
        states.append(hidden[0])
    assert torch.equal(states[0], states[1])
    for i in range(engine.num_layers):
        pairs = zip(caches[0].layer(i, len(ids)), caches[1].layer(i, len(ids)), strict=True)
        assert all(torch.equal(x, y) for x, y in pairs)
    with pytest.raises(ValueError, match="hidden_out"):
        engine.forward(caches[1], ids[-1:], len(ids) - 1, last_only=True, draft=True, head=False)
    charged = []
    for head in (True, False):
        with clock.simulated(read_bound_profile):
            t0 = clock.now()
            engine.forward(caches[1], ids[-1:], len(ids) - 1, last_only=True, draft=True, hidden_out=[], head=head)
            charged.append(clock.now() - t0)
    assert 0 < charged[1] < charged[0]


def vocab_outsider(vocab) -> int:
    """A token id outside the draft vocabulary."""
    return int((~vocab.member).nonzero()[0])


def test_int8_subset_rows_score_as_the_int8_full_head_does():
    """Under int8 activations the subset keeps an interleaved copy, updated as ids join and rebuilt as it grows:
    its rows score bit for bit as the full head's int8 product does."""
    from selfspec.core.quant import activations

    head = quantize_weight(torch.randn(3008, 64, generator=torch.Generator().manual_seed(0)), 8)
    vocab = DraftVocabulary(head, base=100)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    with activations("int8"):
        full = head.matmul(x)
        assert torch.equal(vocab.product(x), full[:, vocab.ids[: vocab.size]])
        vocab.add(torch.tensor([2500, 1999, 3001]))  # into the copy made by the first product
        assert torch.equal(vocab.product(x), full[:, vocab.ids[: vocab.size]])
        vocab.add(torch.arange(400, 700))  # past the allocation: the copy is remade
        assert torch.equal(vocab.product(x), full[:, vocab.ids[: vocab.size]])
    with activations("float32"):
        assert not torch.equal(head.matmul(x), full)


def test_a_chain_ends_at_a_drafted_end_of_sequence_token(smollm2):
    """A drafted stop token ends the chain: were it kept, the answer would end there, so nothing after it could
    be used.  The same draft without the stop set goes on past it."""
    from selfspec.drafters.layerskip import FixedDraftLength, draft_round

    engine = smollm2.engine
    ids = torch.tensor(smollm2.encode("One, two, three, four, five, six, seven, eight"))

    def chain(stop):
        cache = engine.new_cache(len(ids) + 16)
        engine.forward(cache, ids[:-1], 0, prefill=True)
        out = draft_round(engine, cache, len(ids) - 1, int(ids[-1]), skip=NO_SKIP, budget=8,
                          length=FixedDraftLength(6), stop=stop)  # fmt: skip
        return list(out.tree.tokens[1 : 1 + out.steps])

    free = chain(())
    assert len(free) == 6
    assert chain({free[2]}) == free[:3]
    assert chain(smollm2.eos_token_ids - set(free)) == free  # stop tokens never drafted change nothing


@pytest.mark.parametrize("acts", ["int8", "float32"])
def test_restore_takes_the_subset_back_to_an_earlier_state(acts):
    """``learned`` / ``restore``: the subset goes back to the base plus the ids learned by then, in their order,
    and scores them as before, however it grew since (past its allocation too) and on whichever product."""
    from selfspec.core.quant import activations

    head = quantize_weight(torch.randn(3008, 64, generator=torch.Generator().manual_seed(0)), 8)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    with activations(acts):
        vocab = DraftVocabulary(head, base=100)
        vocab.add(torch.tensor([2500, 1999]))
        before, product = vocab.learned(), vocab.product(x)
        vocab.add(torch.arange(400, 700))
        vocab.add(torch.tensor([3001]))
        vocab.restore(before)
        assert vocab.learned() == before and vocab.size == 102
        assert int(vocab.member.sum()) == 102 and not vocab.member[450] and vocab.member[2500]
        assert vocab.columns(torch.tensor([450, 1999])).tolist() == [-1, before.index(1999) + 100]
        assert torch.equal(vocab.product(x), product)
        vocab.add(torch.tensor([450]))  # it grows again from there
        assert vocab.learned() == [*before, 450]
        assert torch.equal(vocab.product(x), head.matmul(x)[:, vocab.ids[: vocab.size]])


@pytest.mark.parametrize("acts", ["int8", "float32"])
def test_a_subset_grown_inside_inference_mode_is_restored_and_grown_outside_it(acts):
    """The model's passes (inference mode) make and grow the subset's tensors; a benchmark restores it between its
    methods outside that mode (bench/turns.py), which once failed as an in-place update of inference tensors."""
    from selfspec.core.quant import activations

    head = quantize_weight(torch.randn(3008, 64, generator=torch.Generator().manual_seed(0)), 8)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    with activations(acts):
        with torch.inference_mode():
            vocab = DraftVocabulary(head, base=100)
            vocab.add(torch.tensor([2500]))
            before = vocab.learned()
            vocab.add(torch.arange(400, 700))  # past the first allocation: the copy is made again whole
            vocab.product(x)
        vocab.restore(before)
        vocab.add(torch.tensor([450, 3001]))
        assert vocab.learned() == [*before, 450, 3001]
        assert torch.equal(vocab.product(x), head.matmul(x)[:, vocab.ids[: vocab.size]])


def test_a_benchmarked_method_drafts_with_the_vocabulary_its_own_runs_grew(gemma3):
    """The draft vocabulary is the engine's and learns every token the model reads.  In a benchmark each method
    starts from what its own generations added, not from the answer the method before it gave to the same
    prompt (Gemma 3: its base ids hold 62% of its answers' tokens): the tokens vanilla's answer brought in are
    outside the subset when `vocab` starts, inside after."""
    from selfspec.bench.runner import _Runner
    from selfspec.bench.spec import BenchMethod
    from selfspec.core.sampling import SamplingParams
    from selfspec.datasets import load_prompts

    vocab = gemma3.engine.draft_vocab
    vocab.restore([])
    methods = [BenchMethod("vanilla", label="vanilla"), BenchMethod("vocab", label="vocab")]
    runner = _Runner(gemma3, methods, 48, SamplingParams())
    item = load_prompts("spec-bench", limit=1, categories=["mt_bench"], chat=False)[0]
    base = runner.record(0, item, methods[0], runner.session(methods[0]))
    new = set(base.token_ids) - set(gemma3.encode(item.prompt)) - set(range(vocab.base_size))
    assert new and all(vocab.member[t] for t in new), "vanilla's answer grew the vocabulary"
    runner.own_vocabulary(methods[1])
    assert not any(vocab.member[t] for t in new), "vocab starts without the tokens of vanilla's answer"
    out = runner.record(0, item, methods[1], runner.session(methods[1]))
    assert out.token_ids == base.token_ids and all(vocab.member[t] for t in new)
    runner.own_vocabulary(methods[0])
    assert sorted(vocab.learned()) == sorted(runner.learned["vanilla"])
    vocab.restore([])


def test_second_turns_are_timed_without_the_answer_in_the_draft_vocabulary(gemma3, monkeypatch):
    """``selfspec bench --turns 2`` times each second turn several times both ways: every timed answer starts
    from the vocabulary as the first turn left it, never holding the answer an earlier repeat gave."""
    from selfspec.bench import turns
    from selfspec.bench.spec import parse_methods
    from selfspec.core.sampling import SamplingParams

    vocab = gemma3.engine.draft_vocab
    vocab.restore([])
    entries, answers, timed = [], [], turns._timed

    def spy(session, prompt, max_new_tokens, sampling):
        entries.append(sorted(vocab.learned()))
        out = timed(session, prompt, max_new_tokens, sampling)
        answers.append((set(session.last_result.token_ids), set(gemma3.encode(prompt))))
        return out

    monkeypatch.setattr(turns, "_timed", spy)
    question = turns.two_turn_questions("spec-bench", limit=1)[0]
    records = turns.run_turns(gemma3, [question], parse_methods("vanilla,vocab"), 48, SamplingParams(), repeats=2)
    assert all(r.identical for r in records) and len(entries) == 8
    for method in (0, 1):  # 4 timed answers per method, all from one state
        states = entries[4 * method : 4 * method + 4]
        assert all(s == states[0] for s in states)
    answer, prompt = answers[0]  # vanilla's: its vocabulary learns only the tokens read
    fresh = answer - prompt - set(range(vocab.base_size))
    assert fresh and not fresh & set(entries[0]), "the second turn's own new words are not in it yet"
    vocab.restore([])


def test_a_long_session_keeps_only_the_newest_learned_ids():
    """Past twice ``keep`` learned ids the oldest go (a server's subset does not grow to half the vocabulary),
    and the products still score exactly the ids the subset holds."""
    head = quantize_weight(torch.randn(3008, 64, generator=torch.Generator().manual_seed(0)), 8)
    vocab = DraftVocabulary(head, base=100, keep=50)
    vocab.add(torch.tensor([500, 501, 700]))
    vocab.add(torch.arange(1000, 1097))  # 100 learned ids: at the bound, all kept
    assert len(vocab.learned()) == 100 and vocab.member[500]
    vocab.add(torch.tensor([2000]))  # one past it: the newest 50 stay
    assert vocab.learned() == [*range(1048, 1097), 2000]
    assert not vocab.member[500] and vocab.member[2000] and vocab.size == 150
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    assert torch.equal(vocab.product(x), head.matmul(x)[:, vocab.ids[: vocab.size]])


@pytest.mark.parametrize("skipped", [False, True])
def test_guesses_riding_along_change_a_chains_passes_not_its_tokens(smollm2, skipped):
    """``draft_round``'s ``ride``: guessed tokens as extra rows of a draft pass.  Guesses the draft then drafts
    itself give the next tokens from the same pass (fewer passes); wrong guesses change nothing but the rows.
    The chain is the same either way and, verified by the head alone (a draft that skips nothing), so are the
    full model's logits of its nodes."""
    from selfspec.core.sampling import GREEDY_SAMPLER
    from selfspec.drafters.layerskip import FixedDraftLength, draft_round

    engine = smollm2.engine
    ids = torch.tensor(smollm2.encode("One, two, three, four, five, six, seven, eight, nine"))
    skip = SkipSet.of([3, 7], [5]) if skipped else NO_SKIP

    def chain(ride):
        cache = engine.new_cache(len(ids) + 16)
        engine.forward(cache, ids[:-1], 0, prefill=True)
        out = draft_round(engine, cache, len(ids) - 1, int(ids[-1]), skip=skip, budget=9,
                          length=FixedDraftLength(8), sampler=GREEDY_SAMPLER, ride=ride)  # fmt: skip
        passes = out.passes if out.passes is not None else out.steps
        return list(out.tree.tokens[1 : 1 + out.steps]), passes, out.logits

    plain, passes, logits = chain(None)
    assert len(plain) == 8 and passes == (9 if not skipped else 8)
    right, right_passes, right_logits = chain(lambda drafted: plain[len(drafted) : len(drafted) + 3])
    assert right == plain and right_passes == passes - 6  # 4 tokens from each of two passes
    wrong, wrong_passes, wrong_logits = chain(lambda drafted: [t + 1 for t in plain[len(drafted) : len(drafted) + 3]])
    assert wrong == plain and wrong_passes == passes
    if not skipped:
        assert torch.allclose(right_logits, logits, atol=1e-4) and torch.allclose(wrong_logits, logits, atol=1e-4)
    else:
        assert logits is None and right_logits is None
