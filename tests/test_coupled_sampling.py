"""Coupled sampling: with one seed, every method emits exactly vanilla sampling's tokens.

The token at output position t is argmax(log-weights + g_t), g_t Gumbel noise
that depends on (seed, t) only; drafts use the same g_t and are verified by
exact match.  Checked here on a tiny random model for every method (chains,
token trees, S3D, prompt lookup, SWIFT's clock-driven schedule) under every
cut (top-k, top-p, min-p, repetition penalty); that the output distribution
is the model's (chi-square against transformers' enumeration, with the
penalty and min-p too) and that a deliberately wrong variant, noise shared
across positions, fails it; that a draft using other noise changes nothing
but acceptance (drafter invariance); and that our cuts equal transformers'
logits processors.  The real built-in models: tests/test_real_models.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_model
from test_sampling import BROKEN_P, CORRECT_P, SAMPLES, chi_square_p, exact_distribution, sample_outputs

import selfspec
from selfspec.core import sampling as sampling_module
from selfspec.core.sampling import REACH, WHOLE_ROWS_MAX_VOCAB, Sampler, SamplingParams, gumbel_at, scaled_logits
from selfspec.errors import InvalidInputError

# tiny models (conftest.one_torch_thread); make test runs these apart, one process per core
pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.statistical]

SETTINGS = {
    "t0.7-topp0.9": {"temperature": 0.7, "top_p": 0.9},
    "t1.0": {"temperature": 1.0},
    "t1.2-topk20-minp-penalty": {"temperature": 1.2, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.3},
    "t0.9-bias-presence-frequency": {"temperature": 0.9, "logit_bias": {10: 3.0, 11: -5.0, 12: 1.5},
                                     "presence_penalty": 0.5, "frequency_penalty": 0.3},  # OpenAI's
}

METHODS = [
    ("asd", {"draft_dtype": "same"}),
    ("static", {"skip_set": {"attention": [1, 3], "mlp": [2, 4]}, "draft_length": 4}),
    ("swift", {"context_window": 8, "draft_dtype": "same"}),  # default cost schedule: reads the clock
    ("swift", {"schedule": "paper", "epsilon": 0.0, "max_draft": 4, "skip_ratio": 0.3, "context_window": 4}),
    ("pld", {"draft_length": 3, "max_ngram": 2}),
    ("suffix", {"max_ngram": 2}),  # token trees from the history, verified by exact match
    ("auto", {"draft_dtype": "same"}),
    ("lookahead", {}),  # Jacobi guesses under the same noise as the target's tokens
]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=7)


PROMPT = "abcabcabd abcab"  # repetitive: prompt lookup finds matches


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("method, options", METHODS, ids=lambda x: x if isinstance(x, str) else "")
def test_every_method_emits_vanilla_samplings_tokens(model, method, options, setting):
    kw = SETTINGS[setting]
    for seed in (1, 2, 3):
        base = selfspec.generate(model, PROMPT, "vanilla", max_new_tokens=40, seed=seed, **kw)
        out = selfspec.generate(model, PROMPT, method, max_new_tokens=40, seed=seed, **options, **kw)
        assert out.token_ids == base.token_ids, (method, seed)
    assert out.stats.drafted > 0, "the method really drafted"
    other = selfspec.generate(model, PROMPT, "vanilla", max_new_tokens=40, seed=4, **kw)
    assert other.token_ids != base.token_ids, "the seed matters"


def test_s3d_emits_vanilla_samplings_tokens(model):
    from selfspec.drafters.s3d import S3DAdapter, S3DConfig

    adapter = S3DAdapter(model, S3DConfig(2, 4, gamma=3, rank=4))
    with torch.no_grad():
        for b in adapter.lora_b.values():
            b.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(1))
    for seed in (5, 6):
        base = selfspec.generate(model, PROMPT, "vanilla", max_new_tokens=30, seed=seed, temperature=0.8)
        out = selfspec.generate(model, PROMPT, "s3d", max_new_tokens=30, seed=seed, temperature=0.8,
                                adapter=adapter, draft_dtype="same")  # fmt: skip
        assert out.token_ids == base.token_ids
        assert out.stats.draft_forwards < out.stats.drafted


def test_a_draft_with_other_noise_changes_acceptance_not_output(model, monkeypatch):
    """Drafter invariance: the output is the full model's choice whatever was drafted; only acceptance
    drops when the draft does not share the target's noise."""
    kw = {"temperature": 0.7, "seed": 11, "max_new_tokens": 60}
    options = {"skip_set": {"attention": [3], "mlp": []}, "draft_length": 4}
    base = selfspec.generate(model, PROMPT, "vanilla", **kw)
    shared = selfspec.generate(model, PROMPT, "static", **options, **kw)
    real_tokens = sampling_module.Sampler.draft_tokens

    def other_noise(self, q, k, t, vocab=None):
        return real_tokens(self, q, k, t + 1000, vocab)  # the noise of a position far away

    monkeypatch.setattr(sampling_module.Sampler, "draft_tokens", other_noise)
    unshared = selfspec.generate(model, PROMPT, "static", **options, **kw)
    assert shared.token_ids == base.token_ids == unshared.token_ids
    assert shared.stats.acceptance_rate > unshared.stats.acceptance_rate + 0.2


# -- the distribution: chi-square against transformers' enumeration (8-token vocabulary) ----------

EXACT_SETTINGS = {
    "t1-topk3": SamplingParams(1.0, top_k=3),
    "t0.9-minp-penalty": SamplingParams(0.9, min_p=0.08, repetition_penalty=1.5),
}


@pytest.fixture(scope="module")
def small_vocab():
    return tiny_model("llama", seed=3, vocab_size=8)


@pytest.mark.parametrize("setting", list(EXACT_SETTINGS))
@pytest.mark.parametrize("method, options", [("vanilla", {}), ("swift", {"schedule": "paper", "epsilon": 0.0,
                         "max_draft": 3, "skip_ratio": 0.3, "draft_dtype": "same", "context_window": 4})],
                         ids=["vanilla", "swift-tree"])  # fmt: skip
def test_coupled_sampling_is_exact(small_vocab, method, options, setting):
    params = EXACT_SETTINGS[setting]
    counts, verified, drafted = sample_outputs(small_vocab, method, options, params)
    if method != "vanilla":
        assert drafted > SAMPLES // 2 and verified > drafted + SAMPLES, "token trees were verified"
    assert chi_square_p(counts, exact_distribution(small_vocab, params), SAMPLES) > CORRECT_P


def test_noise_shared_across_positions_is_caught(small_vocab, monkeypatch):
    """The wrong variant the test above must reject: one noise vector for every position."""
    real = sampling_module._mix
    monkeypatch.setattr(sampling_module, "_mix", lambda seed, t: real(seed, 0))  # every position's key alike
    params = EXACT_SETTINGS["t1-topk3"]
    counts, _, _ = sample_outputs(small_vocab, "vanilla", {}, params)
    assert chi_square_p(counts, exact_distribution(small_vocab, params), SAMPLES) < BROKEN_P


# -- the noise and the choice ---------------------------------------------------------------------


def _splitmix_gumbel(key: int, token: int) -> float:
    """The definition of gumbel_at, in Python integers (the torch version wraps int64 products)."""
    mask = (1 << 64) - 1
    z = (key + (token + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    u = ((z >> 40) + 0.5) / 2**24
    return -math.log(-math.log(u))


def test_noise_is_a_function_of_key_and_token_alone():
    ids = torch.tensor([0, 1, 7, 4095, 49151, 262143, 2**40 + 3])
    for key in (0, 12345, 2**63 + 99, 2**64 - 1):
        ours = gumbel_at(key, ids)
        reference = [_splitmix_gumbel(key, int(i)) for i in ids]
        assert torch.allclose(ours, torch.tensor(reference, dtype=torch.float64), rtol=0, atol=1e-12)
        assert torch.equal(gumbel_at(key, ids.flip(0)), ours.flip(0))  # order and batch do not matter
    g = gumbel_at(7, torch.arange(2_000_000))
    assert abs(g.mean().item() - 0.5772) < 0.01 and abs(g.std().item() - 1.2825) < 0.01  # Gumbel(0, 1)
    lo, hi = -math.log(-math.log(2**-25)), -math.log(-math.log(1 - 2**-25))
    assert lo <= g.min().item() and g.max().item() <= hi and hi - lo < REACH


@pytest.mark.parametrize("params", [
    SamplingParams(0.7, top_p=0.9, seed=1), SamplingParams(1.0, seed=2), SamplingParams(2.0, seed=3),
    SamplingParams(1.3, top_k=50, top_p=0.95, min_p=0.02, repetition_penalty=1.2, seed=4),
], ids=["t0.7-topp", "t1", "t2", "all-cuts"])  # fmt: skip
def test_the_choice_among_near_tokens_is_the_argmax_over_the_whole_vocabulary(params):
    """The choice looks at the tokens within REACH of a row's best only; on rows with a wide spread of
    logits (most tokens out of reach) and flat ones (all in reach), it is the argmax of the whole row's
    log-weights plus every token's noise."""
    gen = torch.Generator().manual_seed(5)
    V = WHOLE_ROWS_MAX_VOCAB + 4000  # a large vocabulary: a choice among the tokens within reach
    scales = torch.tensor([0.5, 2.0, 3.0, 4.0, 6.0, 12.0]).repeat_interleave(4)[:, None]
    logits = torch.randn(len(scales), V, generator=gen) * scales  # the bulk 5-25 below the best at 3-6
    plateau = torch.zeros(8, V)  # one token 12 above a plateau holding ~40% of the mass at temperature 1
    plateau[torch.arange(8), torch.arange(8) * 1000] = 12.0
    logits, scales = torch.cat([logits, plateau]), torch.cat([scales, torch.ones(8, 1)])
    history = [torch.randint(0, V, (30,), generator=gen).tolist() for _ in range(len(scales))]
    sampler = Sampler(params, V, prompt_len=0)
    assert not sampler.noise.whole_rows
    positions = list(range(10, 10 + len(scales)))
    ours = sampler.choose(logits, positions, history)
    seen = [torch.tensor(sorted(set(h))) for h in history] if params.penalised else None
    weights = scaled_logits(logits, params, seen).double()
    noise = torch.stack([sampler.noise.at(t, torch.arange(V)) for t in positions])
    assert ours == (weights + noise).argmax(-1).tolist()
    assert sampler.choose(logits[2:3], positions[2:3], history[2:3]) == ours[2:3]  # alone as in a batch


# -- the cuts -------------------------------------------------------------------------------------


def test_cuts_equal_transformers_logits_processors():
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 3000, generator=gen) * 3
    history = torch.randint(0, 3000, (6, 40), generator=gen)
    settings = (SamplingParams(0.7, top_p=0.9), SamplingParams(1.3, top_k=50, top_p=0.95, min_p=0.02,
                repetition_penalty=1.2), SamplingParams(1.0, min_p=0.1), SamplingParams(0.5, top_p=0.3))  # fmt: skip
    for params in settings:
        procs = LogitsProcessorList()
        if params.penalised:
            procs.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
        procs.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k:
            procs.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1:
            procs.append(TopPLogitsWarper(params.top_p))
        if params.min_p:
            procs.append(MinPLogitsWarper(params.min_p))
        theirs = procs(history, logits.clone())
        ours = scaled_logits(logits, params, list(history))
        assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs)), params
        kept = torch.isfinite(ours)
        assert torch.allclose(ours[kept], theirs[kept]), params


def test_a_row_is_cut_alike_alone_and_in_a_batch():
    """Verification cuts T rows at once, vanilla one: the kept sets and values must not differ."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(12, 50000, generator=gen) * 4
    logits[3, :2000] = 5.0  # a wide plateau: the nucleus needs more than the first 64 candidates, ties too
    params = SamplingParams(0.8, top_p=0.9, min_p=0.01)
    batch = scaled_logits(logits, params)
    for i in range(12):
        assert torch.equal(scaled_logits(logits[i : i + 1], params)[0], batch[i])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": 1.0, "min_p": 1.0}, "min_p"),
        ({"temperature": 1.0, "min_p": -0.1}, "min_p"),
        ({"temperature": 1.0, "repetition_penalty": 0.0}, "repetition_penalty"),
        ({"temperature": 1.0, "sampling_scheme": "magic"}, "scheme"),
        ({"temperature": float("inf")}, "temperature"),
    ],
)
def test_bad_sampling_options_are_clear_errors(model, kwargs, message):
    with pytest.raises(InvalidInputError, match=message):
        selfspec.generate(model, "hi", "pld", max_new_tokens=4, **kwargs)


def test_logit_bias_is_added_before_the_penalties_and_the_temperature():
    """OpenAI's logit_bias: added to the logits, then the penalties, then temperature and cuts; a draft over a
    subset of the vocabulary sees the bias at its columns; ids outside the vocabulary or biases outside
    [-100, 100] are refused."""
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    params = SamplingParams(0.5, logit_bias={0: 4.0, 3: -1.0})
    assert params.logit_bias == ((0, 4.0), (3, -1.0))
    assert torch.equal(scaled_logits(logits, params), torch.tensor([[10.0, 4.0, 6.0, -1.0]]))
    both = SamplingParams(1.0, repetition_penalty=2.0, logit_bias={1: 1.0})
    assert torch.equal(scaled_logits(logits, both, [torch.tensor([1])]), torch.tensor([[1.0, 1.5, 3.0, 0.5]]))
    greedy = Sampler(SamplingParams(logit_bias={3: 5.0}), 4)
    assert greedy.choose(logits, [0], [[]]) == [3]
    columns = lambda ids: torch.tensor([{3: 0, 2: 1}.get(int(i), -1) for i in ids])  # noqa: E731 (subset: 3, 2)
    assert torch.equal(greedy.greedy_draft_logits(torch.tensor([0.5, 3.0]), [], columns), torch.tensor([5.5, 3.0]))
    with pytest.raises(InvalidInputError, match="vocabulary"):
        Sampler(SamplingParams(logit_bias={4: 1.0}), 4)
    with pytest.raises(InvalidInputError, match="between -100 and 100"):
        SamplingParams(logit_bias={1: -101.0})
