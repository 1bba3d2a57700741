"""The references and the statistical helpers, checked on their own (no specfast needed).

A statistical test is only as good as its power: these prove that the helpers accept exact
samples from numpy's sampler and reject samples whose distribution is off by 1% of mass at
the sample sizes the suite uses, and that the references agree with hand-computed values.
"""

import math

import numpy as np
import pytest

from reference import (
    chain_parents,
    ref_probs_row,
    safe_params,
    sample_rows,
    tree_outcomes,
)
from stats import (RESOLUTION, assert_counts, assert_outcomes, assert_rate, assert_samples,
                   assert_transitions, detectable_tv, tv_draws)

LN2 = math.log(2.0)


@pytest.mark.parametrize(
    "logits, params, expected",
    [
        ([0.0, LN2, 2 * LN2], {}, [1 / 7, 2 / 7, 4 / 7]),
        ([0.0, LN2, 2 * LN2], dict(temperature=0.5), [1 / 21, 4 / 21, 16 / 21]),
        ([0.0, LN2, 2 * LN2], dict(top_k=2), [0, 1 / 3, 2 / 3]),
        ([0.0, LN2, 2 * LN2], dict(top_p=0.5), [0, 0, 1]),
        ([0.0, LN2, 2 * LN2], dict(top_p=0.6), [0, 1 / 3, 2 / 3]),
        ([0.0, LN2, 2 * LN2], dict(min_p=0.3), [0, 1 / 3, 2 / 3]),
        ([0.0, LN2, 2 * LN2], dict(min_p=0.2), [1 / 7, 2 / 7, 4 / 7]),
        ([0.0, LN2, 2 * LN2], dict(temperature=0), [0, 0, 1]),
        ([1.0, 3.0, 3.0, 0.0, 3.0], dict(top_k=2), [0, 0.5, 0.5, 0, 0]),
        ([0.0, 0.0, 0.0, 0.0], dict(top_p=0.4), [0.5, 0.5, 0, 0]),
        ([1.0, 5.0, 5.0], dict(temperature=0), [0, 1, 0]),
        ([-np.inf, 0.0, 0.0], {}, [0, 0.5, 0.5]),
    ],
    ids=[
        "plain",
        "T=0.5",
        "top_k=2",
        "top_p=0.5",
        "top_p=0.6",
        "min_p=0.3",
        "min_p=0.2",
        "greedy",
        "top_k-ties-lower-id",
        "top_p-ties-lower-id",
        "greedy-ties-lower-id",
        "banned",
    ],
)
def test_reference_probs_by_hand(logits, params, expected):
    np.testing.assert_allclose(
        ref_probs_row(np.array(logits), **params), expected, rtol=1e-12, atol=1e-15
    )


def test_safe_params_moves_off_the_edge():
    logits = np.array([0.0, LN2, 2 * LN2])  # cumulative masses 4/7, 6/7, 1
    tp, mp = safe_params(logits, 1.0, 0, 4 / 7, 0.5)  # both exactly on an edge
    assert abs(tp - 4 / 7) > 1e-5 and abs(mp - 0.5) > 1e-4
    assert safe_params(logits, 1.0, 0, 0.7, 0.3) == (0.7, 0.3)  # already safe: unchanged


P12 = np.array([0.2, 0.15, 0.12, 0.1, 0.1, 0.08, 0.07, 0.06, 0.05, 0.04, 0.02, 0.01])


def test_helpers_accept_exact_samples():
    rng = np.random.default_rng(1)
    for _ in range(5):
        assert_samples(rng.choice(12, size=300_000, p=P12), P12, "exact")


@pytest.mark.parametrize("n", [300_000], ids=lambda n: f"n={n}")
def test_helpers_reject_a_one_percent_error(n):
    """Move 1% of mass between two tokens: the suite's sample sizes must see it."""
    rng = np.random.default_rng(2)
    for src, dst in [(0, 1), (3, 11), (9, 10)]:
        bad = P12.copy()
        bad[src] -= 0.01
        bad[dst] += 0.01
        with pytest.raises(AssertionError, match="chi-square"):
            assert_samples(rng.choice(12, size=n, p=bad), P12, "perturbed")


def test_helpers_reject_a_one_percent_error_spread_over_every_token():
    """The hardest 1% to see: total variation 0.01 spread over all 12 tokens in
    proportion to their probabilities. 1e5 draws see it about half the time (and are
    refused as too weak for a 1% resolution); the suite draws 3e5."""
    rng = np.random.default_rng(4)
    signs = np.array([1, -1] * 6)
    for shift in (signs, -signs, np.roll(signs, 3)):
        bad = P12 * (1 + 0.02 * shift)
        bad /= bad.sum()
        assert 0.5 * np.abs(bad - P12).sum() >= 0.009
        with pytest.raises(AssertionError, match="chi-square"):
            assert_samples(rng.choice(12, size=300_000, p=bad), P12, "spread")


def test_power_is_what_detectable_tv_says():
    """At the draws detectable_tv asks for a 1% total variation, an error of that
    size placed where it is hardest to see (between two halves, in proportion to the
    probabilities) is rejected about POWER (0.9) of the time, and a smaller count
    of draws is refused as too weak before any statistic."""
    rng = np.random.default_rng(6)
    df = P12.size - 1
    n = next(n for n in range(100_000, 1_000_000, 5_000) if detectable_tv(n, df) <= 0.01)
    half = np.zeros(12, bool)
    half[[0, 3, 4, 7, 8, 11]] = True  # about half the mass each side
    d = np.where(half, P12 / P12[half].sum(), -P12 / P12[~half].sum()) * 0.01
    bad = P12 + d
    assert abs(0.5 * np.abs(bad - P12).sum() - 0.01) < 1e-12
    caught = 0
    for _ in range(200):
        try:
            assert_counts(rng.multinomial(n, bad), P12)
        except AssertionError:
            caught += 1
    assert 0.8 <= caught / 200 <= 0.97, caught
    with pytest.raises(AssertionError, match="too weak a test"):
        assert_counts(rng.multinomial(n // 2, P12), P12)
    assert_counts(rng.multinomial(n // 2, P12), P12, resolution=0.015)  # as it says
    with pytest.raises(AssertionError, match="too weak a test"):
        assert_rate(450, 1000, 0.45)
    with pytest.raises(AssertionError, match="one bin"):
        assert_counts([500, 0], [1.0, 0.0])
    assert_counts([500, 0], [1.0, 0.0], forced=True)
    with pytest.raises(AssertionError, match="zero-probability"):
        assert_counts([499, 1], [1.0, 0.0], forced=True)


@pytest.mark.parametrize("df", [1, 8, 63])
def test_tv_draws_is_the_least_count_that_sees_the_resolution(df):
    n = tv_draws(df)
    assert detectable_tv(n, df) <= RESOLUTION < detectable_tv(n - 1, df)


def test_helpers_reject_draws_on_zero_probability():
    p = np.array([0.5, 0.5, 0.0])
    with pytest.raises(AssertionError, match="zero-probability"):
        assert_samples(np.array([0] * 500 + [1] * 499 + [2]), p)


def test_transitions_and_rates():
    rng = np.random.default_rng(3)
    trans = rng.dirichlet(np.ones(5), size=5)
    prev = rng.integers(0, 5, 200_000)
    nxt = sample_rows(rng, trans[prev])
    assert_transitions(prev, nxt, trans, "exact")
    with pytest.raises(AssertionError, match="chi-square"):
        assert_transitions(prev, nxt, trans[::-1], "swapped rows")
    assert_rate(30_100, 100_000, 0.3)
    with pytest.raises(AssertionError, match="binomial"):
        assert_rate(31_000, 100_000, 0.3)


def test_tree_outcomes_marginal_is_target():
    """Averaged over drafts x ~ q, the first emitted token of verify is distributed as p.

    Checks the reference of recursive rejection sampling on its own: a chain of one with a
    dense q, a tree of three i.i.d. siblings, and three siblings drawn without replacement.
    """
    rng = np.random.default_rng(4)
    V = 6
    p = rng.dirichlet(np.ones(V))
    q = rng.dirichlet(np.ones(V))
    rows = np.vstack([p] + [rng.dirichlet(np.ones(V)) for _ in range(3)])

    def marginal(outcomes):
        m = np.zeros(V)
        for (path, tok), pr in outcomes.items():
            m[tok if not path else int(drafts[path[0]])] += pr
        return m

    # chain of one
    total = np.zeros(V)
    for x in range(V):
        drafts = np.array([x])
        total += q[x] * marginal(tree_outcomes(rows[:2], chain_parents(1), drafts, q[None]))
    np.testing.assert_allclose(total, p, atol=1e-12)
    # three i.i.d. siblings
    total = np.zeros(V)
    for x in np.ndindex(V, V, V):
        drafts = np.array(x)
        w = q[x[0]] * q[x[1]] * q[x[2]]
        qs = np.stack([q] * 3)
        total += w * marginal(tree_outcomes(rows, np.array([-1, -1, -1]), drafts, qs))
    np.testing.assert_allclose(total, p, atol=1e-12)
    # three siblings without replacement
    total = np.zeros(V)
    for x in np.ndindex(V, V, V):
        if len(set(x)) < 3:
            continue
        drafts = np.array(x)
        qs, w, left = [], 1.0, q.copy()
        for t in x:
            qi = left / left.sum()
            qs.append(qi)
            w *= qi[t]
            left[t] = 0.0
        total += w * marginal(tree_outcomes(rows, np.array([-1, -1, -1]), drafts, np.stack(qs)))
    np.testing.assert_allclose(total, p, atol=1e-12)


def test_assert_outcomes_names_unknown_outcomes():
    with pytest.raises(AssertionError, match="probability 0"):
        assert_outcomes([((), 1), ((0,), 2)], {((), 1): 1.0})
