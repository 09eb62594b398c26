"""Prefix reuse (selfspec.core.prefix_store): a request's output is the same whether its prefix came from the
store or was prefilled now.

Tiny models are quantised (int8 weights) so that they run the fused stack whose prompt rows are computed as
one-token rows, where reuse is exact; the keys, values and logits are compared bit for bit, the outputs token
for token, on Llama and on Gemma 3 (sliding window 16 here, prompts far longer).  The real built-in models are
checked at the end (slow).
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

import selfspec
from selfspec.core.prefix_store import MB, PrefixStore, inexact_reason
from selfspec.core.quant import activations, kv_cache_dtype, quantize_linears
from selfspec.decoding.loop import prefill

NEW = 24
SAMPLED = dict(temperature=0.9, top_p=0.95, seed=11)


@pytest.fixture(autouse=True)
def int8_activations_on_any_cpu(request):
    """Reuse needs the row kernels (int8 activations), the default wherever the native kernels build, but not
    under --activations float32: the tiny models are made and run with them forced, so the module checks
    exactness on any CPU and setting; the built-in models keep the machine's default and skip where it refuses
    reuse (:func:`reusing`)."""
    if "qtiny" not in request.fixturenames:
        yield
        return
    with activations("int8"):
        yield


def reusing(model: selfspec.Model) -> selfspec.Model:
    reason = inexact_reason(model.engine)
    if reason is not None:
        pytest.skip(f"this machine's default path refuses reuse: {reason}")
    return model


def quantised(arch: str) -> selfspec.Model:
    model = tiny_model(arch, seed=3)
    quantize_linears(model.hf, 8)
    return selfspec.model_from_hf(model.hf, model.tokenizer, name=f"tiny-{arch}-int8")


@pytest.fixture(scope="module", params=["llama", "gemma3_text"])
def qtiny(request) -> selfspec.Model:
    with activations("int8"):  # see int8_activations_on_any_cpu
        model = quantised(request.param)
        assert inexact_reason(model.engine) is None, inexact_reason(model.engine)
    return model


def ids_of(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + (torch.randint(5, 90, (n - 1,), generator=g)).tolist()


def fresh(model, prompt, method="vanilla", new: int = NEW, **kw):
    return selfspec.Session(model, method, prefix_cache=0).generate(prompt, max_new_tokens=new, **kw)


def same_bits(a, b, n: int, layers: int) -> bool:
    return all(torch.equal(x, y) for i in range(layers) for x, y in zip(a.layer(i, n), b.layer(i, n), strict=True))


def test_a_reused_prefix_gives_the_bits_of_a_whole_prefill(qtiny):
    """Prefix from a prefill of another prompt and from decoding steps: keys, values and logits bit for bit,
    across the sliding window (Gemma 3's is 16 here)."""
    L = qtiny.num_layers
    first = ids_of(40)
    store = PrefixStore()
    session = selfspec.Session(qtiny, "vanilla", prefix_cache=store)
    answer = list(session.generate(first, max_new_tokens=20).token_ids)  # prompt prefilled, answer decoded
    prompt = first + answer[:-1] + ids_of(30, seed=1)[1:]
    whole = prefill(qtiny, prompt, max_new_tokens=4)
    reused = prefill(qtiny, prompt, max_new_tokens=4, store=store)
    assert reused.reused == 40 + 19
    assert torch.equal(whole.last_logits, reused.last_logits)
    assert same_bits(whole.cache, reused.cache, len(prompt), L)
    assert reused.cache.dtype == whole.cache.dtype  # halves under int8 activations, copied as halves


def measured_mean(model, parts):
    """ASD's statistic over the positions of ``parts`` ((prompt, start, end): positions [start, end) of that
    prompt, each measured by a full-model pass over them after a prefill of what precedes them): the mean
    cosine per sublayer, (attention, mlp)."""
    sums, count = 0.0, 0
    for prompt, start, end in parts:
        if start == 0:
            cos = prefill(model, prompt[:end], cosine=True).cosine
        else:
            cache, out = prefill(model, prompt[:start], max_new_tokens=end - start).cache, []
            ids = torch.tensor(prompt[start:end], dtype=torch.long)
            model.engine.forward(cache, ids, start, last_only=True, cosine_out=out, prefill=True)
            cos = out[0]
        sums = sums + torch.tensor([*cos.attention, *cos.mlp], dtype=torch.float64) * (end - start)
        count += end - start
    mean = (sums / count).tolist()
    return mean[: model.num_layers], mean[model.num_layers:]


def test_asds_statistic_leaves_a_reused_answer_out_and_does_not_read_it_again(qtiny):
    """A second turn (first prompt, its decoded answer, a new question): the statistic is the mean over the
    positions a prefill measured, the first prompt's (a mark in the store) and the new question's; the answer
    between them is neither measured nor run through the model again."""
    first = ids_of(40)
    store = PrefixStore()
    answer = list(selfspec.Session(qtiny, "asd", prefix_cache=store).generate(first, max_new_tokens=20).token_ids)
    prompt = first + answer[:-1] + ids_of(30, seed=1)[1:]
    rows = []
    forward = qtiny.engine.forward
    qtiny.engine.forward = lambda cache, ids, *a, **k: rows.append(len(ids)) or forward(cache, ids, *a, **k)
    try:
        reused = prefill(qtiny, prompt, max_new_tokens=4, cosine=True, store=store)
    finally:
        del qtiny.engine.forward
    start = 40 + 19
    assert reused.reused == start and rows == [len(prompt) - start]
    whole = prefill(qtiny, prompt, max_new_tokens=4)
    assert torch.equal(whole.last_logits, reused.last_logits)
    attention, mlp = measured_mean(qtiny, [(first, 0, 40), (prompt, start, len(prompt))])
    assert reused.cosine.attention == pytest.approx(attention, abs=1e-6)
    assert reused.cosine.mlp == pytest.approx(mlp, abs=1e-6)
    again = prefill(qtiny, prompt, max_new_tokens=4, cosine=True, store=store)  # the mark it left: the same mean
    assert again.cosine == reused.cosine


@pytest.mark.parametrize("method", ["vanilla", "asd", "auto", "suffix", "swift"])
def test_second_turn_equals_a_fresh_prefill(qtiny, method):
    session = selfspec.Session(qtiny, method)
    turn1 = ids_of(50, seed=2)
    answer = list(session.generate(turn1, max_new_tokens=NEW).token_ids)
    turn2 = turn1 + answer + ids_of(20, seed=3)[1:]
    got = session.generate(turn2, max_new_tokens=NEW)
    assert got.token_ids == fresh(qtiny, turn2, method).token_ids
    assert got.stats.reused_tokens == len(turn1) + len(answer) - 1  # the answer's last token never ran


def test_asds_statistic_of_a_prompt_extending_a_measured_one_is_a_fresh_prefills(qtiny):
    """Every reused position measured (a prompt extending an earlier prompt): the statistic a whole prefill
    measures, to float32 rounding."""
    session = selfspec.Session(qtiny, "asd")
    turn1 = ids_of(50, seed=4)
    session.generate(turn1, max_new_tokens=NEW)
    turn2 = turn1 + ids_of(20, seed=5)[1:]
    got = session.generate(turn2, max_new_tokens=NEW).stats
    ref = fresh(qtiny, turn2, "asd").stats
    assert got.reused_tokens == len(turn1)
    for part in ("attention", "mlp"):
        assert got.cosine[part] == pytest.approx(ref.cosine[part], abs=1e-6)
    again = session.generate(turn2, max_new_tokens=NEW).stats  # an exact repeat: the mark at the whole prompt
    assert again.reused_tokens == len(turn2) - 1
    assert again.cosine == got.cosine


def test_a_prompt_sharing_part_of_a_cached_prefix(qtiny):
    session = selfspec.Session(qtiny, "auto")
    a = ids_of(60, seed=6)
    session.generate(a, max_new_tokens=NEW)
    b = a[:33] + ids_of(25, seed=7)[1:]
    assert b[33] != a[33]
    vanilla = selfspec.Session(qtiny, "vanilla", prefix_cache=session.prefix_store)
    got = vanilla.generate(b, max_new_tokens=NEW)
    assert got.stats.reused_tokens == 33
    assert got.token_ids == fresh(qtiny, b).token_ids


@pytest.mark.parametrize("method", ["vanilla", "asd", "auto"])
def test_an_exact_repeat_runs_its_last_token_only(qtiny, method):
    session = selfspec.Session(qtiny, method)
    prompt = ids_of(45, seed=8)
    first = session.generate(prompt, max_new_tokens=NEW)
    second = session.generate(prompt, max_new_tokens=NEW)
    assert second.stats.reused_tokens == len(prompt) - 1
    assert second.token_ids == first.token_ids


@pytest.mark.parametrize("scheme", ["coupled", "rejection"])
def test_seeded_sampling_is_unchanged_by_reuse(qtiny, scheme):
    method = "vanilla" if scheme == "rejection" else "auto"  # rejection: a seed fixes vanilla's tokens only
    session = selfspec.Session(qtiny, method)
    turn1 = ids_of(40, seed=9)
    answer = list(session.generate(turn1, max_new_tokens=NEW, sampling_scheme=scheme, **SAMPLED).token_ids)
    turn2 = turn1 + answer + ids_of(15, seed=10)[1:]
    got = session.generate(turn2, max_new_tokens=NEW, sampling_scheme=scheme, **SAMPLED)
    assert got.stats.reused_tokens > 0
    assert got.token_ids == fresh(qtiny, turn2, method, sampling_scheme=scheme, **SAMPLED).token_ids


def test_eviction_keeps_the_bound_and_the_outputs(qtiny):
    prompts = [ids_of(60, seed=20 + i) for i in range(4)]
    probe = prefill(qtiny, prompts[0], max_new_tokens=NEW)
    per_token = probe.cache.nbytes() / probe.cache.capacity
    bound = int(per_token * (60 + NEW) * 1.5)  # one sequence fits, two do not
    store = PrefixStore(bound)
    session = selfspec.Session(qtiny, "vanilla", prefix_cache=store)
    outs = [session.generate(p, max_new_tokens=NEW) for p in prompts]
    st = store.stats()
    assert st.entries == 1 and st.evictions == 3 and 0 < st.bytes <= bound
    assert session.generate(prompts[0], max_new_tokens=NEW).stats.reused_tokens == 1  # evicted: the <bos> only
    last = session.generate(prompts[0], max_new_tokens=NEW)  # the most recent one is held
    assert last.stats.reused_tokens == 59 and last.token_ids == outs[0].token_ids
    tiny_store = PrefixStore(int(per_token * 30))  # smaller than one sequence: its first tokens only
    selfspec.Session(qtiny, "vanilla", prefix_cache=tiny_store).generate(prompts[1], max_new_tokens=NEW)
    again = selfspec.Session(qtiny, "vanilla", prefix_cache=tiny_store).generate(prompts[1], max_new_tokens=NEW)
    assert 0 < again.stats.reused_tokens <= 30 and again.token_ids == outs[1].token_ids


def test_a_finished_decodings_cache_is_kept_without_a_copy(qtiny):
    """``save(take=True)``: the store keeps the cache's own buffers (the cache is left empty) where the tokens
    fill at least half of them, and a copy otherwise; either way a later prompt reuses the bits of a whole
    prefill, and the store counts the memory it keeps."""
    L, prompt = qtiny.num_layers, ids_of(50, seed=40)
    for room, kept_whole in ((8, True), (200, False)):
        store = PrefixStore()
        pf = prefill(qtiny, prompt, max_new_tokens=room)
        pointers = {t.data_ptr() for i in range(L) for t in pf.cache.layer(i, 1)}
        capacity_bytes = pf.cache.nbytes()
        store.save(qtiny.engine, prompt, pf.cache, take=True)
        (entry,) = store._entries.values()
        held = {t.data_ptr() for pair in entry.layers for t in pair}
        assert (held == pointers) is kept_whole and (pf.cache.nbytes() == 0) is kept_whole
        assert store.stats().bytes == (capacity_bytes if kept_whole else entry.nbytes) == entry.nbytes
        longer = prompt + ids_of(20, seed=41)[1:]
        whole = prefill(qtiny, longer, max_new_tokens=4)
        reused = prefill(qtiny, longer, max_new_tokens=4, store=store)
        assert reused.reused == 50 and torch.equal(whole.last_logits, reused.last_logits)
        assert same_bits(whole.cache, reused.cache, len(longer), L)


def test_a_zero_bound_disables_the_store(qtiny):
    session = selfspec.Session(qtiny, "vanilla", prefix_cache=0)
    prompt = ids_of(30, seed=30)
    session.generate(prompt, max_new_tokens=8)
    assert session.generate(prompt, max_new_tokens=8).stats.reused_tokens == 0
    assert session.prefix_store.stats().entries == 0


def test_the_module_path_is_refused_with_its_reason():
    """transformers' modules round a row differently with the pass's row count: no reuse there."""
    model = tiny_model("llama", seed=3)
    reason = inexact_reason(model.engine)
    assert reason is not None and "modules" in reason
    session = selfspec.Session(model, "vanilla")
    prompt = ids_of(30, seed=31)
    first = session.generate(prompt, max_new_tokens=8)
    second = session.generate(prompt, max_new_tokens=8)
    assert second.stats.reused_tokens == 0 and second.token_ids == first.token_ids
    assert session.prefix_store.stats().entries == 0


def test_the_float32_prompt_kernel_is_refused(qtiny):
    from selfspec.core.quant import activations, prefill_kernel

    with activations("float32"):
        if prefill_kernel() == "rows":
            pytest.skip("float32 activations take the row kernels here")
        assert inexact_reason(qtiny.engine) is not None
        store = PrefixStore(64 * MB)
        session = selfspec.Session(qtiny, "vanilla", prefix_cache=store)
        prompt = ids_of(30, seed=32)
        session.generate(prompt, max_new_tokens=8)
        assert session.generate(prompt, max_new_tokens=8).stats.reused_tokens == 0


def test_the_server_worker_reuses_and_reports(qtiny):
    """A second request extending the first (a chat's next turn) reuses its prefix; /metrics counts it."""
    import threading

    from selfspec.core.sampling import SamplingParams
    from selfspec.server.worker import Job, Worker

    worker = Worker(qtiny, "vanilla", allowed=("vanilla",), prefix_cache_mb=64)
    worker.start()
    try:
        def run(prompt) -> list:
            done, events = threading.Event(), []

            def emit(kind, payload):
                events.append((kind, payload))
                if kind in ("done", "error"):
                    done.set()

            worker.submit(Job(prompt, "vanilla", SamplingParams(), NEW, [], emit))
            assert done.wait(60)
            return events

        turn1 = ids_of(40, seed=40)
        run(turn1)
        run(turn1 + ids_of(10, seed=41)[1:])
        text = worker.metrics.render()
        values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
        assert values["selfspec_prefix_cache_hits_total"] == "1"
        assert int(values["selfspec_prefix_cache_reused_tokens_total"]) >= 40
        assert "selfspec_time_to_first_token_seconds_count 2" in text
        assert "selfspec_queue_wait_seconds_count 2" in text
        per_token = qtiny.engine.kv_bytes_per_token()  # 6 layers' keys and values: 2 heads of 16 values each
        assert per_token == 6 * 2 * 2 * 16 * torch.empty(0, dtype=kv_cache_dtype()).element_size()
        assert worker.prefix_cache_line() == (f"prefix cache 64 MB (about {64 * 2**20 / per_token / 1000:.0f}k "
                                              f"tokens at {per_token / 1000:.1f} KB a token)")  # fmt: skip
    finally:
        worker.stop()
    off = Worker(qtiny, "vanilla", allowed=("vanilla",), prefix_cache_mb=0)
    assert off.prefix_cache_line() == "prefix cache off"
    modules = Worker(tiny_model("llama", seed=3), "vanilla", allowed=("vanilla",))
    assert modules.prefix_cache_line().startswith("prefix cache unused (the model runs on transformers' modules")


# -- the real built-in models ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("method", ["vanilla", "auto"])
def test_smollm2_second_chat_turn(smollm2, method):
    reusing(smollm2)
    messages = [{"role": "user", "content": "Name three fruits and say one thing about each."}]
    session = selfspec.Session(smollm2, method)
    first = session.generate(messages, max_new_tokens=40)
    turn2 = messages + [{"role": "assistant", "content": first.text},
                        {"role": "user", "content": "Which of them is the sweetest?"}]  # fmt: skip
    got = session.generate(turn2, max_new_tokens=40)
    assert got.stats.reused_tokens >= len(smollm2.encode(messages))
    assert got.token_ids == fresh(smollm2, turn2, method, new=40).token_ids
    sampled = session.generate(turn2, max_new_tokens=40, **SAMPLED)  # an exact repeat, sampled
    assert sampled.stats.reused_tokens == len(smollm2.encode(turn2)) - 1
    assert sampled.token_ids == fresh(smollm2, turn2, method, new=40, **SAMPLED).token_ids


@pytest.mark.slow
def test_gemma3_prompt_longer_than_its_window(gemma3):
    from selfspec.datasets import load_prompts

    reusing(gemma3)
    text = max(load_prompts("xsum", limit=200, chat=False), key=lambda p: len(p.prompt)).prompt
    ids = gemma3.encode(text)
    assert len(ids) > 600, "the prompt must be longer than Gemma 3's sliding window (512)"
    session = selfspec.Session(gemma3, "vanilla")
    session.generate(ids[:550], max_new_tokens=16)  # a cached prefix longer than the window
    got = session.generate(ids, max_new_tokens=24)
    assert got.stats.reused_tokens >= 550
    assert got.token_ids == fresh(gemma3, ids, "vanilla").token_ids
    auto = selfspec.Session(gemma3, "auto", prefix_cache=session.prefix_store).generate(ids, max_new_tokens=24)
    assert auto.token_ids == got.token_ids


def test_bench_second_turns_with_and_without_reuse(qtiny):
    """``selfspec bench --turns 2``'s runner: the reusing session's second turn equals the re-prefilling one's."""
    from selfspec.bench import turns
    from selfspec.bench.spec import parse_methods
    from selfspec.bench.turns import Question, run_turns, summarize_turns
    from selfspec.core.sampling import SamplingParams

    questions = [Question("q1", ("Tell me about foxes and dogs, please.", "Now say it shorter."))]
    stores, timed = [], turns._timed

    def spy(session, prompt, max_new_tokens, sampling):  # what the suffix source remembers when each run starts
        if session.method == "suffix":
            stores.append([list(d) for d in session.draft_policy.store.docs])
        return timed(session, prompt, max_new_tokens, sampling)

    turns._timed = spy
    try:
        records = run_turns(qtiny, questions, parse_methods("vanilla,suffix"), 16, SamplingParams())
    finally:
        turns._timed = timed
    summary = summarize_turns(records)
    assert set(summary) == {"vanilla", "suffix"}
    for s in summary.values():
        assert s["identical"] and s["reused_tokens"] > 0 and s["ttft_ratio"] > 0
    # each side's three timed runs start from the store the first turn left, not one holding the last run's answer
    assert len(stores) == 6
    assert all(st == stores[0] for st in stores[0::2]) and all(st == stores[1] for st in stores[1::2])
