"""Speculative (rejection) sampling is exact: every method samples from exactly the model's (warped) distribution.

(The default scheme, coupled sampling, is tested in tests/test_coupled_sampling.py with the helpers here.)

Two layers of evidence:

* the acceptance rule on hand-written p and q: deterministic facts (p == q
  keeps every draft, p(x) = 0 never keeps x) and, over many seeded trials,
  the emitted token's frequencies against p by a chi-square goodness-of-fit
  test, for a chain, for siblings drawn without replacement, and two levels
  deep;
* whole decodings on a tiny random model with an 8-token vocabulary, where the
  exact distribution of the first four generated tokens is enumerated with
  transformers' own forward pass: for each method, thousands of seeded runs
  against it (and against vanilla sampling's runs).

Each check also runs on a deliberately broken variant, which it must reject:
drafting greedily while using the softmax as q, using an unwarped q for tokens
drawn from the warped one, and resampling from p instead of the residual
norm(max(0, p - q)).  Seeds are fixed, so the tests are deterministic; the
thresholds (correct: p-value > 1e-3; broken: < 1e-6) leave wide margins.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
import torch
from conftest import tiny_model
from scipy import stats

import selfspec
from selfspec.core import sampling as sampling_module
from selfspec.core.sampling import SamplingParams, sample_without_replacement, warp
from selfspec.decoding import loop as decoding
from selfspec.decoding.acceptance import accept_sampling
from selfspec.decoding.loop import Decoder, prefill
from selfspec.decoding.trees import DraftTree
from selfspec.drafters import hybrid, suffix
from selfspec.errors import InvalidInputError
from selfspec.methods import build_policies

# tiny models (conftest.one_torch_thread); make test runs these apart, one process per core
pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.statistical]

CORRECT_P = 1e-3  # a correct method's goodness-of-fit p-value stays above this
BROKEN_P = 1e-6  # a broken variant's falls below this


def chi_square_p(counts: collections.Counter, expected: dict, n: int) -> float:
    """Goodness of fit of ``counts`` (n samples) to the exact ``expected`` probabilities.

    Outcomes expected fewer than 5 times are pooled into one cell, together
    with any outcome of probability 0 (a single one of those fails the test).
    """
    obs, exp, pooled_obs, pooled_exp = [], [], 0, 0.0
    for key, prob in expected.items():
        if prob * n >= 5:
            obs.append(counts.get(key, 0))
            exp.append(prob * n)
        else:
            pooled_obs += counts.get(key, 0)
            pooled_exp += prob * n
    impossible = sum(c for key, c in counts.items() if key not in expected)
    if impossible:
        return 0.0
    if pooled_exp > 0:
        obs.append(pooled_obs)
        exp.append(pooled_exp)
    exp_arr = np.array(exp) * (sum(obs) / sum(exp))  # float rounding of the enumerated mass
    return float(stats.chisquare(obs, exp_arr).pvalue)


def two_sample_p(a: collections.Counter, b: collections.Counter) -> float:
    """Chi-square test that two samples come from one distribution (rare outcomes pooled)."""
    keys = sorted(set(a) | set(b))
    common = [k for k in keys if a.get(k, 0) + b.get(k, 0) >= 10]
    rare = [k for k in keys if k not in common]
    table = [[a.get(k, 0) for k in common], [b.get(k, 0) for k in common]]
    if rare:
        table[0].append(sum(a.get(k, 0) for k in rare))
        table[1].append(sum(b.get(k, 0) for k in rare))
    return float(stats.chi2_contingency(np.array(table)).pvalue)


# -- the acceptance rule on hand-written distributions ---------------------------------------------

P = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
Q = torch.tensor([0.1, 0.2, 0.3, 0.3, 0.1])


def _one_level(p: torch.Tensor, q: torch.Tensor, children: list[int]) -> tuple[DraftTree, torch.Tensor]:
    tokens = (9, *children)
    tree = DraftTree(tokens, (-1,) + (0,) * len(children), (q,) + (None,) * len(children))
    target = torch.stack([p] + [p] * len(children))  # below a leaf: whatever, only the bonus is drawn there
    return tree, target


def test_identical_distributions_keep_every_draft():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        x = sample_without_replacement(Q, 1, gen)[0]
        path, _bonus = accept_sampling(*_one_level(Q, Q, [x]), gen)
        assert path == [0, 1]


def test_a_token_the_model_never_emits_is_never_kept():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        path, bonus = accept_sampling(*_one_level(P, Q, [4]), gen)  # P[4] = 0
        assert path == [0] and bonus != 4 and P[bonus] > 0


def test_a_token_the_model_wants_more_than_the_draft_is_always_kept():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        path, _ = accept_sampling(*_one_level(P, Q, [0]), gen)  # P[0] = 0.5 > Q[0] = 0.1
        assert path == [0, 1]


def test_a_drawn_token_with_draft_probability_zero_is_an_error():
    with pytest.raises(ValueError, match="draft probability 0"):
        accept_sampling(*_one_level(P, torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0]), [0]), torch.Generator())


def broken_accept(tree: DraftTree, p: torch.Tensor, generator: torch.Generator) -> tuple[list[int], int]:
    """WRONG on purpose: on rejection, the bonus comes from p instead of norm(max(0, p - q))."""
    node, path = 0, [0]
    while True:
        nxt = None
        for c in tree.children[node]:
            x = tree.tokens[c]
            if float(torch.rand((), generator=generator)) * float(tree.q[node][x]) < float(p[node][x]):
                nxt = c
                break
        if nxt is None:
            return path, int(torch.multinomial(p[node], 1, generator=generator))
        path.append(nxt)
        node = nxt


def _emitted_first(accept: Callable, siblings: int, trials: int = 20000) -> collections.Counter:
    gen = torch.Generator().manual_seed(siblings)
    counts: collections.Counter = collections.Counter()
    for _ in range(trials):
        children = sample_without_replacement(Q, siblings, gen)
        tree, target = _one_level(P, Q, children)
        path, bonus = accept(tree, target, gen)
        counts[(tree.tokens[path[1]] if len(path) > 1 else bonus,)] += 1
    return counts


@pytest.mark.parametrize("siblings", [1, 2, 4])
def test_first_token_is_distributed_as_p(siblings):
    """Chain (1 candidate) and recursive rejection over 2 and 4 siblings drawn without replacement."""
    expected = {(i,): float(P[i]) for i in range(len(P)) if P[i] > 0}
    assert chi_square_p(_emitted_first(accept_sampling, siblings), expected, 20000) > CORRECT_P


@pytest.mark.parametrize("siblings", [1, 2])
def test_resampling_from_p_instead_of_the_residual_is_caught(siblings):
    expected = {(i,): float(P[i]) for i in range(len(P)) if P[i] > 0}
    assert chi_square_p(_emitted_first(broken_accept, siblings), expected, 20000) < BROKEN_P


def test_two_levels_deep_tree_is_distributed_as_p():
    """root -> 2 siblings; the first sibling has 2 children of its own: the emitted pair follows p's chain rule."""
    p1 = P  # after the root
    p2 = {t: torch.roll(P, t) for t in range(5)}  # after token t: a different distribution per token
    q2 = torch.tensor([0.3, 0.3, 0.2, 0.1, 0.1])
    gen = torch.Generator().manual_seed(7)
    counts: collections.Counter = collections.Counter()
    n = 20000
    for _ in range(n):
        a = sample_without_replacement(Q, 2, gen)
        b = sample_without_replacement(q2, 2, gen)
        tokens = (9, a[0], a[1], b[0], b[1])
        parents = (-1, 0, 0, 1, 1)
        tree = DraftTree(tokens, parents, (Q, q2, None, None, None))
        target = torch.stack([p1, p2[a[0]], p2[a[1]], P, P])  # rows 3, 4: after the depth-2 leaves
        path, bonus = accept_sampling(tree, target, gen)
        emitted = [tokens[i] for i in path[1:]] + [bonus]
        if len(emitted) == 1:  # the root's candidates were all rejected: the next round samples from p2
            emitted.append(int(torch.multinomial(p2[emitted[0]], 1, generator=gen)))
        counts[tuple(emitted[:2])] += 1
    expected = {(x, y): float(p1[x] * p2[x][y]) for x in range(5) for y in range(5) if p1[x] * p2[x][y] > 0}
    assert chi_square_p(counts, expected, n) > CORRECT_P


# -- whole decodings on a tiny model with an 8-token vocabulary ------------------------------------

PROMPT = [3, 4, 5, 6, 7, 3, 5]  # token ids: the char tokenizer is larger than this model's vocabulary
NEW = 4  # the first comes from the prefill; a round then drafts up to 2 and verifies them with a bonus
SAMPLES = 2500
SETTINGS = {
    "t1-topk3": SamplingParams(1.0, top_k=3, scheme="rejection"),
    "t0.7-topp0.8": SamplingParams(0.7, top_p=0.8, scheme="rejection"),
}
METHODS = {
    "asd": ("asd", {"draft_dtype": "same", "preset": "paper"}),
    "selfsd-adaptive": ("static", {"skip_set": {"attention": [1, 3], "mlp": [2, 4]}, "draft_dtype": "same"}),
    "chain-3": ("static", {"skip_set": {"attention": [1, 3], "mlp": [2, 4]}, "draft_length": 3,
                           "draft_dtype": "same"}),  # fmt: skip
    "swift-tree": ("swift", {"schedule": "paper", "epsilon": 0.0, "max_draft": 3, "skip_ratio": 0.3,
                             "draft_dtype": "same", "context_window": 4}),  # fmt: skip
    "pld": ("pld", {"draft_length": 2, "max_ngram": 1}),  # point-mass drafts looked up in the history
    "suffix": ("suffix", {"max_ngram": 1}),  # the tree's most frequent chain, point masses
    "auto": ("auto", {"layerskip": "swift", "schedule": "paper", "epsilon": 0.0, "max_draft": 3, "draft_dtype": "same",
                      "context_window": 4, "max_ngram": 1}),  # fmt: skip
}


@pytest.fixture(scope="module")
def small_vocab():
    return tiny_model("llama", seed=3, vocab_size=8)


_EXACT: dict = {}


def exact_distribution(model, params: SamplingParams, prompt=PROMPT, new=NEW,
                       allowed: Callable[[tuple[int, ...]], set[int]] | None = None) -> dict[tuple[int, ...], float]:
    """P(first ``new`` tokens), enumerated with transformers' forward pass (EOS ends a sequence early);
    ``allowed``: the tokens a constraint lets follow an output (the others' logits set to -inf first)."""
    key = (id(model), params, tuple(prompt), new, allowed)
    if key in _EXACT:
        return _EXACT[key]
    out: dict[tuple[int, ...], float] = {}

    def expand(prefix: tuple[int, ...], prob: float) -> None:
        with torch.inference_mode():
            logits = model.hf(torch.tensor([list(prompt) + list(prefix)])).logits[0, -1]
        if allowed is not None:
            keep = torch.isin(torch.arange(logits.shape[-1]), torch.tensor(sorted(allowed(prefix))))
            logits = logits.masked_fill(~keep, float("-inf"))
        p = warp(logits[None], params, [torch.tensor([*prompt, *prefix])])[0]
        for t in torch.nonzero(p).flatten().tolist():
            seq = prefix + (t,)
            if t in model.eos_token_ids or len(seq) == new:
                out[seq] = out.get(seq, 0.0) + prob * float(p[t])
            else:
                expand(seq, prob * float(p[t]))

    expand((), 1.0)
    _EXACT[key] = out
    return out


def sample_outputs(model, method: str, options: dict, params: SamplingParams, n: int = SAMPLES, seed0: int = 0,
                   prompt=PROMPT, new=NEW):  # fmt: skip
    """Counts of the first ``new`` tokens over n seeded decodings (one method state across them, as a session).

    The decodings share the prompt's prefill (as the skip-set search does), so
    only the sampled continuation is recomputed.
    """
    skip_policy, drafter = build_policies(method, options)
    pf = prefill(model, list(prompt), max_new_tokens=new, max_nodes=drafter.max_nodes if drafter else 1,
                 cosine=getattr(skip_policy, "needs_cosine", False))  # fmt: skip
    counts: collections.Counter = collections.Counter()
    verified = drafted = 0
    for i in range(n):
        sampling = dataclasses.replace(params, seed=seed0 + i)
        dec = Decoder(model, list(prompt), max_new_tokens=new, method=method, skip_policy=skip_policy,
                      draft_policy=drafter, sampling=sampling, prefill=pf)  # fmt: skip
        counts[tuple(t for new_tokens in dec for t in new_tokens)] += 1
        verified += dec.stats.verified_tokens
        drafted += dec.stats.drafted
    return counts, verified, drafted


_VANILLA: dict = {}


def vanilla_counts(model, setting: str) -> collections.Counter:
    if setting not in _VANILLA:
        _VANILLA[setting] = sample_outputs(model, "vanilla", {}, SETTINGS[setting], seed0=10**6)[0]
    return _VANILLA[setting]


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_vanilla_sampling_matches_the_enumeration(small_vocab, setting):
    """The reference itself: our vanilla sampling against transformers' probabilities."""
    expected = exact_distribution(small_vocab, SETTINGS[setting])
    assert chi_square_p(vanilla_counts(small_vocab, setting), expected, SAMPLES) > CORRECT_P


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", list(METHODS))
def test_speculative_sampling_is_exact(small_vocab, monkeypatch, name, setting):
    method, options = METHODS[name]
    params = SETTINGS[setting]
    if name == "auto":  # whether a losing layer-skip source sits a round out follows measured times: never here
        monkeypatch.setattr(hybrid, "EXPLORE_EVERY", 0)
    if name == "suffix":  # whether a draft pays follows measured times: here it always drafts
        monkeypatch.setattr(suffix, "MIN_GAIN", 0.0)
    counts, verified, drafted = sample_outputs(small_vocab, method, options, params)
    assert drafted > SAMPLES // 2, "the method really drafted"
    if name == "swift-tree":
        assert verified > drafted + SAMPLES, "token trees with several candidates per depth were verified"
    expected = exact_distribution(small_vocab, params)
    assert chi_square_p(counts, expected, SAMPLES) > CORRECT_P
    assert two_sample_p(counts, vanilla_counts(small_vocab, setting)) > CORRECT_P


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_s3d_sampling_is_exact(small_vocab, setting):
    """S3D drafts every position from mask tokens in one pass; each position's q is still exact."""
    from selfspec.drafters.s3d import S3DAdapter, S3DConfig

    adapter = S3DAdapter(small_vocab, S3DConfig(2, 4, gamma=3, rank=4))
    with torch.no_grad():  # an untrained but non-trivial draft
        for b in adapter.lora_b.values():
            b.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(1))
    params = SETTINGS[setting]
    counts, _, drafted = sample_outputs(small_vocab, "s3d", {"adapter": adapter, "draft_dtype": "same"}, params)
    assert drafted > SAMPLES
    assert chi_square_p(counts, exact_distribution(small_vocab, params), SAMPLES) > CORRECT_P


def _greedy_draws(q, k, generator):
    return q.topk(min(k, int((q > 0).sum()))).indices.tolist()


@pytest.mark.parametrize(
    "broken",
    ["greedy draft, softmax q", "q without the warping", "bonus from p, not the residual"],
)
@pytest.mark.parametrize("name", ["chain-3", "swift-tree"])
def test_broken_variants_are_caught(small_vocab, monkeypatch, broken, name):
    """The same test rejects each known wrong way of doing speculative sampling."""
    params = SETTINGS["t1-topk3"]
    if broken == "greedy draft, softmax q":
        monkeypatch.setattr(sampling_module, "sample_without_replacement", _greedy_draws)
    elif broken == "q without the warping":
        # tokens drawn from the warped draft distribution, but q recorded as the plain softmax
        monkeypatch.setattr(sampling_module.Sampler, "draft_distribution",
                            lambda self, logits, history: logits.float().softmax(-1))  # fmt: skip
        monkeypatch.setattr(
            sampling_module,
            "sample_without_replacement",
            lambda q, k, gen: sample_without_replacement(warp(q.log(), params), k, gen),
        )
    else:
        monkeypatch.setattr(decoding, "accept_sampling", broken_accept)
    method, options = METHODS[name]
    counts, _, _ = sample_outputs(small_vocab, method, options, params)
    assert chi_square_p(counts, exact_distribution(small_vocab, params), SAMPLES) < BROKEN_P


# -- the API: options, seeds, errors ---------------------------------------------------------------


# Under the rejection scheme, draft lengths and tree widths decided from measured times (SWIFT's default cost
# schedule) change how many draws a round takes, so there a seed fixes the distribution, not the exact sample;
# with a schedule that does not read the clock, a seed fixes the exact output.  (Coupled sampling, the
# default, fixes the exact output whatever the schedule: tests/test_coupled_sampling.py.)
DETERMINISTIC_SCHEDULES = [
    ("vanilla", {}),
    ("asd", {"draft_dtype": "same", "preset": "paper"}),
    ("swift", {"schedule": "paper", "epsilon": 0.3, "budget": 1000.0, "context_window": 8, "draft_dtype": "same"}),
    ("swift", {"context_window": 8, "sampling_scheme": "coupled"}),
]


@pytest.mark.parametrize("method, options", DETERMINISTIC_SCHEDULES, ids=lambda x: x if isinstance(x, str) else "")
def test_a_seed_makes_a_sampled_run_reproducible(tiny_llama, method, options):
    prompt = "Once upon a time"
    torch.manual_seed(123)
    before = torch.get_rng_state()
    options = {"sampling_scheme": "rejection", **options}
    runs = [selfspec.generate(tiny_llama, prompt, method, max_new_tokens=30, temperature=1.0, seed=s, **options)
            for s in (5, 5, 6)]  # fmt: skip
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].token_ids != runs[2].token_ids
    assert torch.equal(torch.get_rng_state(), before), "the global RNG is neither read nor advanced"
    greedy = selfspec.generate(tiny_llama, prompt, "vanilla", max_new_tokens=30)
    assert runs[0].token_ids != greedy.token_ids


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
        ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
        ({"temperature": 1.0, "top_k": -1}, "top_k"),
    ],
)
def test_bad_sampling_options_are_clear_errors(tiny_llama, kwargs, message):
    with pytest.raises(InvalidInputError, match=message):
        selfspec.generate(tiny_llama, "hi", "asd", max_new_tokens=4, **kwargs)


def test_warp_cuts_and_renormalises():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    assert torch.count_nonzero(warp(logits, SamplingParams(1.0, top_k=2))) == 2
    nucleus = warp(logits, SamplingParams(1.0, top_p=0.8))
    full = logits.softmax(-1)
    kept = int(torch.count_nonzero(nucleus))
    assert full[: kept - 1].sum() < 0.8 <= full[:kept].sum()  # the smallest prefix reaching top_p
    for params in (SamplingParams(0.5), SamplingParams(2.0, top_k=3, top_p=0.9)):
        assert float(warp(logits, params).sum()) == pytest.approx(1.0)
    assert warp(logits, SamplingParams(0.5))[0] > full[0]  # a low temperature sharpens


def test_sampling_params_spell_out_every_keyword_of_generate():
    """One spelling of the parameters as ``Session.generate``'s keywords (the CLI and ``whatif`` use it): a new
    sampling keyword of ``generate`` that the parameters do not carry fails here."""
    import inspect

    from selfspec.api import Session

    p = SamplingParams(0.7, top_k=5, top_p=0.9, seed=3, min_p=0.05, repetition_penalty=1.1, scheme="rejection",
                       presence_penalty=0.5, frequency_penalty=-0.25, logit_bias={3: 1.5},
                       grammar=selfspec.grammar.regex("[a-z]+"))  # fmt: skip
    kw = p.as_kwargs()
    not_sampling = {"self", "prompt", "max_new_tokens", "logprobs"}
    assert set(kw) == set(inspect.signature(Session.generate).parameters) - not_sampling
    assert SamplingParams(kw["temperature"], kw["top_k"], kw["top_p"], kw["seed"], kw["min_p"],
                          kw["repetition_penalty"], kw["sampling_scheme"], kw["presence_penalty"],
                          kw["frequency_penalty"], kw["logit_bias"], kw["grammar"]) == p  # fmt: skip
