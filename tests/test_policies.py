"""ADMG (ASD Algorithm 1) and its variants, D&V's adaptive draft exit, and skip-set values, on hand-written inputs."""

from __future__ import annotations

import pytest

from selfspec.core.skipset import SkipSet
from selfspec.drafters.layerskip import AdaptiveDraftExit, FixedDraftLength
from selfspec.errors import InvalidInputError
from selfspec.model.engine import SublayerCosine
from selfspec.policies.skip import AsdPolicy, admg

# 8 layers; paper layers l = 1..8 map to indices 0..7
COS = SublayerCosine(
    attention=(0.50, 0.99, 0.97, 0.995, 0.99, 0.60, 0.999, 0.999),
    mlp=(0.1,) * 8,
)


def test_admg_full_algorithm():
    # CS: paper layers with C >= 0.985 and l <= L - n = 6  ->  {2, 4, 5}
    # rule 1 (m=3): l in {3, 6} (l <= 6)                  ->  MLP {3, 6}, and attention gets them too
    s = admg(COS, alpha=0.985, m=3, n=2)
    assert s.attention == {1, 3, 4, 2, 5}
    assert s.mlp == {2, 5}


def test_admg_cs_only_ignores_rule_2():
    s = admg(COS, alpha=0.985, m=3, n=2, variant="cs")
    assert s.attention == {1, 3, 4, 6, 7}  # the last two layers are not protected
    assert s.mlp == frozenset()


def test_admg_cs_and_rule_2():
    s = admg(COS, alpha=0.985, m=3, n=2, variant="cs+r2")
    assert s.attention == {1, 3, 4}
    assert s.mlp == frozenset()


def test_admg_rules_1_and_2_only():
    s = admg(COS, alpha=0.985, m=2, n=2, variant="r1+r2")
    assert s.attention == s.mlp == {1, 3, 5}  # paper layers 2, 4, 6


def test_admg_alpha_boundary_is_inclusive():
    s = admg(COS, alpha=0.995, m=100, n=0, variant="cs")
    assert s.attention == {3, 6, 7}


@pytest.mark.parametrize("bad", [dict(alpha=0.0), dict(alpha=1.0), dict(m=0), dict(n=-1), dict(variant="x")])
def test_asd_policy_rejects_bad_values(bad):
    with pytest.raises(InvalidInputError):
        AsdPolicy(**bad)


def test_adaptive_exit_follows_dv_update_rule():
    ex = AdaptiveDraftExit()  # gamma 0.6, AR* 0.9, eps 0.01, b1 0.5, b2 0.9
    ex.observe(drafted=4, accepted=2)  # AR = 0.5 < 0.9 -> g~ = 0.61
    assert ex.acceptance == pytest.approx(0.5)
    assert ex.gamma == pytest.approx(0.9 * 0.6 + 0.1 * 0.61)
    g = ex.gamma
    ex.observe(drafted=2, accepted=2)  # AR = 0.5*0.5 + 0.5*1 = 0.75 < 0.9 -> raise again
    assert ex.acceptance == pytest.approx(0.75)
    assert ex.gamma == pytest.approx(0.9 * g + 0.1 * (g + 0.01))
    for _ in range(5):
        ex.observe(drafted=3, accepted=3)
    assert ex.acceptance > 0.9
    g = ex.gamma
    ex.observe(drafted=3, accepted=3)  # AR above target -> lower gamma
    assert ex.gamma == pytest.approx(0.9 * g + 0.1 * (g - 0.01))


def test_adaptive_exit_ignores_drafts_stopped_by_max_length():
    ex = AdaptiveDraftExit(max_draft=4)
    ex.observe(drafted=4, accepted=0)
    assert ex.gamma == 0.6
    assert ex.acceptance == 0.0


def test_adaptive_exit_stop_rule():
    ex = AdaptiveDraftExit(gamma=0.5, max_draft=3)
    assert not ex.should_stop(1, 0.9)
    assert ex.should_stop(1, 0.4)  # low confidence: keep this token, then stop
    assert ex.should_stop(3, 0.99)  # max draft reached


def test_fixed_draft_length():
    f = FixedDraftLength(3)
    assert [f.should_stop(i, 0.0) for i in (1, 2, 3)] == [False, False, True]
    with pytest.raises(InvalidInputError):
        FixedDraftLength(0)


def test_skipset_json_round_trip(tmp_path):
    s = SkipSet.of([3, 1], [2], model="x")
    path = tmp_path / "s.json"
    s.save(path)
    loaded = SkipSet.parse(str(path))
    assert loaded == s and loaded.meta == {"model": "x"}
    assert SkipSet.parse('{"attention": [1, 3], "mlp": [2]}') == s
    assert s.skip_ratio(4) == pytest.approx(3 / 8)


@pytest.mark.parametrize("text", ["{not json", '{"foo": 1}', '{"attention": ["a"]}', "/no/such/file.json"])
def test_skipset_bad_input(text):
    with pytest.raises(InvalidInputError):
        SkipSet.parse(text)


def test_skipset_validate_range():
    with pytest.raises(InvalidInputError, match="0-based"):
        SkipSet.of([30], []).validate(30)
