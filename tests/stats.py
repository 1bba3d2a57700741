"""Statistical assertions for the random kernels.

Every test draws with fixed seeds, so a test is deterministic for a given implementation;
ALPHA is small so that the ~300 statistical assertions of the suite do not fail by chance
(probability ~3e-4 for the whole suite). Each assertion also checks its own power before
its statistic: that its draws see a total variation of RESOLUTION (1%) between the
sampled and the exact distribution with probability POWER, for the error hardest to see
(see detectable_tv), else it fails as too weak. A test whose point is not the
distribution (a driver loop's bookkeeping, a rare-event guard) states a coarser
resolution, and so says what it can see. tests/test_stats.py checks the claims on numpy's
own sampler.
"""

from __future__ import annotations

import os

import numpy as np
from scipy import optimize
from scipy import stats as sps

ALPHA = 1e-6
MIN_EXPECTED = 5.0
RESOLUTION = 0.01  # the total variation (or, for a rate, absolute error) a test must see
POWER = 0.9

# Sample sizes may be scaled down for a quick look (SPECFAST_TEST_SCALE=0.1, e.g. under a
# debugger or a slow mock); the power claims above hold only at the default of 1.
SCALE = float(os.environ.get("SPECFAST_TEST_SCALE", "1"))


def scaled(n: int) -> int:
    return max(int(n * SCALE), 200)


def _pool(obs, exp):
    """Bins with expected count >= MIN_EXPECTED, the rest pooled into one bin."""
    big = exp >= MIN_EXPECTED
    o, e = list(obs[big]), list(exp[big])
    ro, re = obs[~big].sum(), exp[~big].sum()
    if re > 0:
        if re >= MIN_EXPECTED or not o:
            o.append(ro)
            e.append(re)
        else:  # too small to stand alone: merge into the smallest big bin
            j = int(np.argmin(e))
            o[j] += ro
            e[j] += re
    return np.asarray(o, float), np.asarray(e, float)


def chi2_table(counts, probs):
    """Chi-square statistic and degrees of freedom of independent multinomial rows.

    counts (R, C) observed, probs (R, C) the exact cell probabilities of each row. Returns
    (stat, df, n_impossible) where n_impossible counts draws in zero-probability cells.
    """
    counts = np.atleast_2d(np.asarray(counts, float))
    probs = np.atleast_2d(np.asarray(probs, float))
    assert counts.shape == probs.shape, (counts.shape, probs.shape)
    stat, df, impossible = 0.0, 0, 0
    for c, p in zip(counts, probs):
        n = c.sum()
        if n == 0:
            continue
        zero = p <= 0
        impossible += int(c[zero].sum())
        p = np.where(zero, 0.0, p)
        p = p / p.sum()
        o, e = _pool(c[~zero], n * p[~zero])
        if len(o) < 2:
            continue
        stat += float(((o - e) ** 2 / e).sum())
        df += len(o) - 1
    return stat, df, impossible


def detectable_tv(n, df, alpha=ALPHA, power=POWER) -> float:
    """The total variation between the sampled and the exact distribution that a
    chi-square test of n draws on df degrees of freedom rejects with ``power``, for
    the error hardest to see: mass moved between two halves of the outcomes in
    proportion to their probabilities, whose noncentrality n * sum(d^2 / p) is the
    least a total variation tv can have, 4 n tv^2 (Cauchy-Schwarz). Over rows of
    a table, n is all draws and tv that of the joint distribution. An error
    inside a bin pooled for its small expected counts is not seen at all."""
    crit = sps.chi2.isf(alpha, df)
    seen = lambda tv: sps.ncx2.sf(crit, df, 4 * n * tv * tv) - power
    return 1.0 if seen(1.0) < 0 else float(optimize.brentq(seen, 1e-7, 1.0))


def tv_draws(df, resolution=RESOLUTION) -> int:
    """The draws a chi-square on ``df`` degrees of freedom needs to see a total
    variation of ``resolution`` (detectable_tv solved for the count)."""
    return int(np.ceil(optimize.brentq(lambda n: detectable_tv(n, df) - resolution,
                                       10.0, 1e9)))


def _check_power(seen, resolution, what, n, unit):
    if SCALE < 1 or seen <= resolution * (1 + 1e-9):
        return
    raise AssertionError(
        f"{what}: too weak a test: {n} draws see {unit} {seen:.4f} with power {POWER}, "
        f"not {resolution}: draw more, or state the coarser resolution it has")


def assert_counts(counts, probs, what="", alpha=ALPHA, resolution=RESOLUTION, forced=False):
    """Observed counts (C,) or (R, C) are multinomial draws from ``probs``, by a
    test that sees a total variation of ``resolution`` (detectable_tv).

    Draws in a cell of probability exactly 0 fail at once, whatever their number.
    A distribution with one possible outcome tests nothing more: ``forced`` says
    that is the point (else it fails).
    """
    stat, df, impossible = chi2_table(counts, probs)
    c2 = np.atleast_2d(np.asarray(counts, float))
    p2 = np.atleast_2d(np.asarray(probs, float))
    assert impossible == 0, (
        f"{what}: {impossible} draws landed on zero-probability outcomes "
        f"{np.argwhere((p2 <= 0) & (c2 > 0))[:10].tolist()}"
    )
    if df == 0:
        assert forced, (f"{what}: every draw falls in one bin (one possible outcome, or "
                        "too few draws to split them): no distribution to test")
        return
    _check_power(detectable_tv(c2.sum(), df, alpha), resolution, what, int(c2.sum()),
                 "a total variation of")
    pval = float(sps.chi2.sf(stat, df))
    n = c2.sum(axis=1, keepdims=True)
    freq = np.divide(c2, n, out=np.zeros_like(c2), where=n > 0)
    pn = p2 / p2.sum(axis=1, keepdims=True)
    tv = 0.5 * np.abs(freq - pn).sum(axis=1)
    worst = int(np.argmax(tv))
    assert pval > alpha, (
        f"{what}: chi-square {stat:.1f} on {df} df, p = {pval:.3g} < {alpha:g}; "
        f"n = {int(c2.sum())}; worst row {worst}: TV = {tv[worst]:.4f}\n"
        f"  observed freq {np.round(freq[worst], 4).tolist()}\n"
        f"  expected prob {np.round(pn[worst], 4).tolist()}"
    )


def assert_samples(samples, probs, what="", alpha=ALPHA, **kw):
    """Token draws (n,) follow the distribution ``probs`` (V,) (``kw``: assert_counts')."""
    samples = np.asarray(samples).astype(np.int64)
    probs = np.asarray(probs, float)
    assert samples.min() >= 0 and samples.max() < probs.size, (
        f"{what}: token outside [0, {probs.size}): {samples.min()}..{samples.max()}"
    )
    counts = np.bincount(samples, minlength=probs.size)
    assert_counts(counts, probs, what, alpha, **kw)


def assert_transitions(prev, nxt, trans, what="", alpha=ALPHA, **kw):
    """Pairs (prev[i], nxt[i]) with nxt ~ trans[prev] independently (``kw``:
    assert_counts'; the resolution is that of the joint distribution of pairs)."""
    prev = np.asarray(prev).astype(np.int64)
    nxt = np.asarray(nxt).astype(np.int64)
    V = trans.shape[1]
    assert nxt.size == 0 or (nxt.min() >= 0 and nxt.max() < V), f"{what}: token out of range"
    counts = np.zeros(trans.shape)
    np.add.at(counts, (prev, nxt), 1)
    assert_counts(counts, trans, what, alpha, **kw)


def assert_outcomes(observed, expected: dict, what="", alpha=ALPHA, **kw):
    """Hashable outcomes follow the exact distribution ``expected`` {key: prob}.

    ``observed`` is a list of outcomes or a {key: count} dict (``kw``: assert_counts').
    """
    if not isinstance(observed, dict):
        keys, observed = observed, {}
        for k in keys:
            observed[k] = observed.get(k, 0) + 1
    names = list(expected)
    unknown = {k: c for k, c in observed.items() if k not in expected}
    assert not unknown, (
        f"{what}: {sum(unknown.values())} outcomes of probability 0, "
        f"e.g. {sorted(unknown)[:5]}"
    )
    counts = np.array([observed.get(k, 0) for k in names])
    probs = np.array([expected[k] for k in names])
    total = max(int(counts.sum()), 1)
    try:
        assert_counts(counts, probs, what, alpha, **kw)
    except AssertionError as e:
        rows = sorted(zip(names, counts / total, probs), key=lambda r: -r[2])
        detail = "\n".join(f"    {k}: observed {o:.4f} expected {p:.4f}" for k, o, p in rows[:20])
        raise AssertionError(f"{e}\n  outcomes (path, token):\n{detail}") from None


def assert_rate(successes, trials, prob, what="", alpha=ALPHA, resolution=RESOLUTION):
    """A binomial count is consistent with success probability ``prob``, by a test
    that sees an absolute error of ``resolution`` in it with power POWER (normal
    approximation)."""
    successes, trials = int(successes), int(trials)
    if prob <= 0 or prob >= 1:
        expect = 0 if prob <= 0 else trials
        assert successes == expect, f"{what}: {successes}/{trials}, expected exactly {expect}"
        return
    seen = (sps.norm.isf(alpha / 2) + sps.norm.ppf(POWER)) * np.sqrt(prob * (1 - prob) / trials)
    _check_power(seen, resolution, what, trials, "an absolute error of")
    pval = sps.binomtest(successes, trials, prob).pvalue
    assert pval > alpha, (
        f"{what}: rate {successes / trials:.5f} over {trials} trials, expected {prob:.5f} "
        f"(binomial p = {pval:.3g})"
    )
