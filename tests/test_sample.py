"""specfast.sample: distribution (chi-square against the reference), keys, greedy, coupling.

Many draws of one distribution are made in ONE call: the same row repeated n times, each
copy with its own position (or seed), which is how the random streams are keyed.
"""

import numpy as np
import pytest

import specfast as sf
from reference import (
    as_f64,
    order_of,
    philox4x32_10,
    ref_probs,
    ref_probs_row,
    safe_params,
    to_dtype,
)
from stats import assert_counts, assert_rate, assert_samples, scaled, tv_draws

METHODS = ["rejection", "coupled"]
DTYPES = ["float32", "float16", "bfloat16"]
FILTERS = {
    "no-filter": dict(),
    "T=0.7,top_k=5": dict(temperature=0.7, top_k=5),
    "top_p=0.8": dict(top_p=0.8),
    "T=1.5,min_p=0.1": dict(temperature=1.5, min_p=0.1),
    "all-three": dict(temperature=0.9, top_k=12, top_p=0.9, min_p=0.02),
}
N = scaled(300_000)


def row_logits(rng, vocab, dtype, banned=True):
    x = rng.standard_normal(vocab) * 1.5
    if banned and vocab > 3:
        x[rng.choice(vocab, size=vocab // 5, replace=False)] = -np.inf
    return to_dtype(x.astype(np.float32)[None], dtype)


def resolved(row, filters):
    """The filters with top_p / min_p moved off decision edges for this row."""
    f = dict(filters)
    t, k = f.get("temperature", 1.0), f.get("top_k", 0)
    f["top_p"], f["min_p"] = safe_params(row, t, k, f.get("top_p", 1.0), f.get("min_p", 0.0))
    return f


@pytest.mark.parametrize("filters", list(FILTERS.values()), ids=list(FILTERS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 7, 20], ids=lambda v: f"V={v}")
@pytest.mark.parametrize("method", METHODS)
def test_sample_distribution(method, vocab, dtype, filters, rng):
    row = row_logits(rng, vocab, dtype)
    f = resolved(row[0], filters)
    expected = ref_probs_row(row[0], **f)
    logits = np.repeat(row, N, axis=0)
    tokens = sf.sample(logits, **f, seed=1234, position=np.arange(N), method=method)
    assert isinstance(tokens, np.ndarray) and tokens.dtype == np.int32 and tokens.shape == (N,)
    assert_samples(tokens, expected, f"sample({method}, V={vocab}, {dtype}, {f})",
                   forced=np.count_nonzero(expected) == 1)  # V=1, or a filter leaving one


@pytest.mark.parametrize("method", METHODS)
def test_sample_distribution_over_seeds(method, rng):
    """Varying the seed at a fixed position gives independent draws too."""
    row = row_logits(rng, 11, "float32")
    tokens = sf.sample(
        np.repeat(row, N, axis=0), seed=np.arange(N, dtype=np.uint64) * 7919 + 3, position=42,
        method=method,
    )
    assert_samples(tokens, ref_probs_row(row[0]), f"sample({method}) over seeds")


@pytest.mark.parametrize("method", METHODS)
def test_sample_rare_token_rate(method):
    """A token of probability 1e-4 beside two heavy ones is drawn at its rate (inverse-CDF
    edges, the last bucket) and a token with p = 0 after filtering never is."""
    p = np.array([0.6, 0.3999, 1e-4, 0.0])
    x = np.log(np.where(p > 0, p, 1.0)).astype(np.float32)
    x[3] = -np.inf
    n = scaled(400_000)
    tokens = sf.sample(np.repeat(x[None], n, axis=0), seed=5, position=np.arange(n), method=method)
    expected = ref_probs_row(x)
    assert_samples(tokens, expected, f"rare token ({method})")
    assert_rate((tokens == 2).sum(), n, expected[2], "rate of the rare token")


LARGE_FILTERS = {
    "no-filter": dict(),
    "top_k=2": dict(top_k=2),
    "top_p=0.9,min_p=0.01": dict(top_p=0.9, min_p=0.01),
    "T=0.5,top_k=1000,top_p=0.95": dict(temperature=0.5, top_k=1000, top_p=0.95),
}


@pytest.mark.parametrize("method", METHODS)
def test_sample_large_vocab_distribution(method, rng):
    """3e5 draws from one V = 32000 row (a flat tail under 40 graded tokens): the 40 and
    the tail follow p closely enough to see a 1% error (test_sample_large_vocab below
    checks the support of every filter at V = 128256 with few draws)."""
    V, chunk, n = 32000, 1000, scaled(300_000)
    x = rng.standard_normal(V).astype(np.float32)
    graded = rng.choice(V, 40, replace=False)
    x[graded] += np.linspace(7.0, 3.0, 40, dtype=np.float32)
    p = ref_probs_row(x, temperature=0.9)
    rows = np.repeat(x[None], chunk, axis=0)
    tokens = np.concatenate([
        sf.sample(rows, temperature=0.9, seed=21, position=np.arange(s, s + chunk),
                  method=method) for s in range(0, n, chunk)])
    counts = np.array([(tokens == c).sum() for c in graded] + [(~np.isin(tokens, graded)).sum()])
    assert_counts(counts, np.append(p[graded], 1 - p[graded].sum()), f"{method} V={V}")


@pytest.mark.parametrize("filters", list(LARGE_FILTERS.values()), ids=list(LARGE_FILTERS))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("vocab", [32000, 128256], ids=lambda v: f"V={v}")
@pytest.mark.parametrize("method", METHODS)
def test_sample_large_vocab(method, vocab, dtype, filters, rng):
    """Three strong tokens over a long tail: draws stay in the support of the filtered
    distribution, and the three and the tail as a whole get their mass (~32 MB of rows
    per call: 62 to 500 draws, which see only a gross error; the support check is
    exact). The tail holds most of the mass, so top_p and min_p move to the nearest
    values no cumulative mass comes near (top_p=0.9 to between 0.44 and 0.81)."""
    x = rng.standard_normal(vocab).astype(np.float32) * 1.5
    strong = rng.choice(vocab, 3, replace=False)
    x[strong] += [9.0, 8.5, 8.0]
    row = to_dtype(x[None], dtype)
    f = resolved(row[0], filters)
    p = ref_probs_row(row[0], **f)
    n = max(32_000_000 // (vocab * row.itemsize), 100)
    tokens = sf.sample(np.repeat(row, n, axis=0), **f, seed=9, position=np.arange(n), method=method)
    assert tokens.min() >= 0 and tokens.max() < vocab
    outside = np.unique(tokens[p[tokens] == 0])
    assert outside.size == 0, f"drew tokens outside the support: {outside[:10]}"
    cats = order_of(row[0])[:3]
    counts = np.array([(tokens == c).sum() for c in cats] + [(~np.isin(tokens, cats)).sum()])
    assert_counts(counts, np.append(p[cats], max(1 - p[cats].sum(), 0.0)), f"V={vocab} {f}",
                  resolution=0.35, forced=True)  # at V=128256 the 62 draws may fill one bin


# Each filter alone at V = 32000, cutting to 7 to 10 of 20 graded tokens (top_p's cut
# counts the tail's mass, a fifth of the row's at T = 0.8).
LARGE_FILTERED = {
    "top_k=8": dict(top_k=8),
    "T=0.8,top_p=0.6": dict(temperature=0.8, top_p=0.6),
    "T=1.3,min_p=0.3": dict(temperature=1.3, min_p=0.3),
}


@pytest.mark.parametrize("filters", list(LARGE_FILTERED.values()), ids=list(LARGE_FILTERED))
def test_sample_large_vocab_filtered_distribution(filters, rng):
    """At V = 32000 each filter keeps a few of 20 graded tokens over a flat tail of
    all the others (logits near -5.2, 3 and more below the graded ones): rejection
    draws follow the filtered distribution of tests/reference.py (float64) to a total
    variation of 1%. 128 copies of the row per call, each at its own position; 1.3e5
    to 1.4e5 draws, ~12 us each, top_p's ~60 us (its cut scan's passes). The coupled
    method makes the same cut; test_sample_large_vocab_distribution holds its draw at
    this vocabulary to 1%, and test_sample_large_vocab its filtered support."""
    method = "rejection"
    V, chunk = 32000, 128
    x = (rng.standard_normal(V) * 0.5 - 5.2).astype(np.float32)
    graded = rng.choice(V, 20, replace=False)
    x[graded] = np.linspace(3.0, 0.0, 20, dtype=np.float32)
    f = resolved(x, filters)
    p = ref_probs_row(x, **f)
    kept = np.flatnonzero(p)
    assert 5 <= kept.size <= 12 and np.isin(kept, graded).all(), kept
    if "top_p" in filters:  # the tail's mass moves the cut
        tempered = ref_probs_row(x, temperature=f["temperature"])
        assert tempered[np.setdiff1d(np.arange(V), graded)].sum() > 0.15
        assert np.count_nonzero(ref_probs_row(x[graded], **f)) < kept.size
    n = scaled(tv_draws(kept.size - 1))
    rows = np.repeat(x[None], chunk, axis=0)
    tokens = np.concatenate([
        sf.sample(rows, **f, seed=31, position=np.arange(s, s + chunk), method=method)
        for s in range(0, n, chunk)])
    assert_samples(tokens, p, f"{method} V={V} {f}")


@pytest.mark.parametrize("vocab", [8, 3000], ids=lambda v: f"V={v}")
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("method", METHODS)
def test_min_p_keeps_tokens_just_above_its_edge(method, temperature, vocab, rng):
    """Tokens a relative 0.5% and 2% above min_p * max(p) are drawn at their rate and
    those as far below never are (min_p applies to the tempered probabilities; at
    V = 3000 among a tail far below the edge, where the SIMD passes run)."""
    min_p = 0.3
    rel = np.array([1.0, 0.6, 1.005 * min_p, 0.995 * min_p, 1.02 * min_p, 0.98 * min_p, 0.1, 0.45])
    x = np.full(vocab, -30.0, np.float32)
    at = rng.choice(vocab, rel.size, replace=False)
    x[at] = (temperature * np.log(rel)).astype(np.float32)  # p ∝ rel after the temperature
    p = ref_probs_row(x, temperature=temperature, min_p=min_p)
    assert np.count_nonzero(p) == 5 and p[at[3]] == 0 and p[at[2]] > 0
    n, chunk = scaled(150_000), 15_000
    rows = np.repeat(x[None], chunk, axis=0)
    tokens = np.concatenate([
        sf.sample(rows, temperature=temperature, min_p=min_p, seed=17,
                  position=np.arange(s, s + chunk), method=method) for s in range(0, n, chunk)])
    assert_samples(tokens, p, f"min_p edge ({method}, T={temperature}, V={vocab})")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sample_greedy_is_argmax(method, dtype, rng):
    x = rng.standard_normal((300, 111)).astype(np.float32)
    x[:100, 40] = x[:100, 60] = 9.0  # ties: the lower id wins
    x[100:150, :] = -np.inf
    x[100:150, 77] = 0.0
    logits = to_dtype(x, dtype)
    tokens = sf.sample(logits, temperature=0.0, seed=3, position=np.arange(300), method=method)
    np.testing.assert_array_equal(tokens, np.argmax(as_f64(logits), axis=1))
    assert np.all(tokens[:100] == 40)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [9000, 40001, 151936], ids=lambda v: f"V={v}")
def test_greedy_first_max_on_large_rows(vocab, dtype, rng):
    """The max pass tells the argmax scan which block to start in: the first of tied
    maxima wins wherever they lie (block edges, the tail, a lone request's split row)."""
    spots = [0, 4095, 4096, 8191, 8192, vocab // 2, vocab - 17, vocab - 1]
    x = rng.standard_normal((len(spots) + 3, vocab)).astype(np.float32)
    for r, at in enumerate(spots):  # row r: its max first at spots[r], tied later
        later = [s for s in spots[r + 1:] if s > at]
        x[r, [at] + later[:2]] = 8.0
    x[len(spots), rng.choice(vocab, 5, replace=False)] = 8.0  # five tied anywhere
    x[len(spots) + 1, -40:] = 8.0  # all in the tail
    x[len(spots) + 2] = -np.inf
    x[len(spots) + 2, vocab - 1] = -1.0  # one token left, the last
    logits = to_dtype(x, dtype)
    want = np.argmax(as_f64(logits), axis=1)
    np.testing.assert_array_equal(sf.sample(logits, temperature=0.0), want)
    for r in range(logits.shape[0]):  # a lone request: the max pass may split its row
        res = sf.verify(logits[r:r + 1], np.zeros(0, np.int32), np.array([0]),
                        temperature=0.0)
        assert res.tokens[0, 0] == want[r], f"row {r}"
    n = logits.shape[0]  # and one chain whose every draft is its row's argmax
    res = sf.verify(logits, want[:-1].astype(np.int32), np.array([n - 1]), temperature=0.0)
    np.testing.assert_array_equal(res.tokens[0], want)


@pytest.mark.parametrize("method", METHODS)
def test_sample_reproducible_and_keyed(method, rng):
    """Same inputs -> same tokens; another seed or position -> other tokens; a row's token
    depends only on its own inputs (not on the other rows)."""
    x = rng.standard_normal((4000, 50)).astype(np.float32)
    pos = rng.integers(0, 2**40, 4000)
    a = sf.sample(x, seed=77, position=pos, method=method)
    np.testing.assert_array_equal(a, sf.sample(x, seed=77, position=pos, method=method))
    b = sf.sample(x, seed=78, position=pos, method=method)
    c = sf.sample(x, seed=77, position=pos + 1, method=method)
    assert (a != b).mean() > 0.5 and (a != c).mean() > 0.5
    perm = rng.permutation(4000)
    np.testing.assert_array_equal(
        sf.sample(x[perm], seed=77, position=pos[perm], method=method), a[perm]
    )
    for r in [0, 1234, 3999]:
        one = sf.sample(x[r : r + 1], seed=77, position=int(pos[r]), method=method)
        assert one.shape == (1,) and one[0] == a[r]


def test_sample_per_row_parameters(rng):
    """Per-row parameters give each row what a call with that row alone gives."""
    rows = 40
    x = rng.standard_normal((rows, 30)).astype(np.float32)
    params = dict(
        temperature=rng.uniform(0.0, 2.0, rows).astype(np.float32),
        top_k=rng.integers(0, 10, rows).astype(np.int32),
        top_p=rng.uniform(0.3, 1.0, rows).astype(np.float32),
        min_p=rng.uniform(0.0, 0.3, rows).astype(np.float32),
        seed=rng.integers(0, 2**63, rows).astype(np.uint64),
        position=rng.integers(0, 2**40, rows),
    )
    params["temperature"][:5] = 0.0
    for method in METHODS:
        all_rows = sf.sample(x, **params, method=method)
        for r in range(rows):
            one = sf.sample(
                x[r : r + 1], **{k: v[r].item() for k, v in params.items()}, method=method
            )
            assert one[0] == all_rows[r], f"row {r} ({method})"


def test_sample_rows_of_different_distributions(rng):
    """Many different rows in one call, each repeated: every row's draws follow its own p."""
    vocab, rows, reps = 9, 8, scaled(40_000)
    x = (rng.standard_normal((rows, vocab)) * 1.5).astype(np.float32)
    temps = np.array([1.0, 0.5, 2.0, 1.0, 0.8, 1.0, 1.2, 0.7])
    top_k = np.array([0, 0, 0, 4, 0, 3, 0, 6])
    top_p = np.array([1.0, 1.0, 1.0, 1.0, 0.8, 1.0, 0.9, 0.95])
    min_p = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.1, 0.05, 0.0])
    for r in range(rows):
        top_p[r], min_p[r] = safe_params(x[r], temps[r], top_k[r], top_p[r], min_p[r])
    idx = np.tile(np.arange(rows), reps)
    for method in METHODS:
        tokens = sf.sample(
            x[idx], temperature=temps[idx], top_k=top_k[idx], top_p=top_p[idx],
            min_p=min_p[idx], seed=11, position=np.arange(idx.size), method=method,
        )
        ref = ref_probs(x, temps, top_k, top_p, min_p)
        counts = np.zeros((rows, vocab))
        np.add.at(counts, (idx, tokens), 1)
        assert_counts(counts, ref, f"mixed rows ({method})")


def coupled_agreement(p, q):
    """P(argmin E/p == argmin E/q) for shared Exp(1) noise E per token (the exponential race).

    Both pick v iff E_w > E_v * max(p_w / p_v, q_w / q_v) for every w != v, so the
    probability is 1 / sum_w max(p_w / p_v, q_w / q_v), summed over v with p_v, q_v > 0.
    """
    total = 0.0
    for v in range(p.size):
        if p[v] > 0 and q[v] > 0:
            total += 1.0 / np.maximum(p / p[v], q / q[v]).sum()
    return total


@pytest.mark.parametrize(
    "case", ["random", "close", "filtered", "temperature"],
)
def test_coupled_noise_is_shared_per_token_id(case, rng):
    """Two different rows at the same (seed, position) agree exactly as often as Gumbel-max
    with one noise value per (seed, position, token id) predicts; at different positions
    they agree only as often as independent draws do."""
    vocab, n = 10, scaled(100_000)
    a = (rng.standard_normal(vocab) * 1.5).astype(np.float32)
    b = (rng.standard_normal(vocab) * 1.5).astype(np.float32)
    ta = tb = 1.0
    ka = kb = 0
    if case == "close":
        b = (a + rng.standard_normal(vocab) * 0.3).astype(np.float32)
    if case == "filtered":
        ka, kb = 4, 6
    if case == "temperature":
        b, ta, tb = a.copy(), 1.0, 0.5
    p = ref_probs_row(a, ta, ka)
    q = ref_probs_row(b, tb, kb)
    logits = np.concatenate([np.repeat(a[None], n, 0), np.repeat(b[None], n, 0)])
    pos = np.tile(np.arange(n), 2)
    temps = np.repeat([ta, tb], n)
    ks = np.repeat([ka, kb], n)
    tok = sf.sample(logits, temperature=temps, top_k=ks, seed=2024, position=pos, method="coupled")
    agree = (tok[:n] == tok[n:]).sum()
    assert_rate(agree, n, coupled_agreement(p, q), f"coupled agreement ({case})")
    # And the coupling must not be an accident of the positions: shifted positions are
    # independent draws, agreeing with probability sum_v p_v q_v.
    pos2 = np.concatenate([np.arange(n), np.arange(n) + n])
    tok2 = sf.sample(
        logits, temperature=temps, top_k=ks, seed=2024, position=pos2, method="coupled"
    )
    assert_rate((tok2[:n] == tok2[n:]).sum(), n, float(p @ q), f"independent ({case})")


def test_sample_default_method_is_rejection(rng):
    x = rng.standard_normal((500, 20)).astype(np.float32)
    np.testing.assert_array_equal(
        sf.sample(x, seed=5, position=np.arange(500)),
        sf.sample(x, seed=5, position=np.arange(500), method="rejection"),
    )


def test_coupled_noise_words_are_philox(rng):
    """On a flat row every token ties, so the coupled token is the one with the largest
    Gumbel noise: the smallest Philox word (ALGORITHMS.md: token v takes word
    (v >> 4) & 3 of block (v >> 6) * 16 + (v & 15) under purpose NOISE = 3). This pins
    the vectorised Philox of the noise pass to the definition, lane by lane."""
    vocab = 300
    checked = 0
    for _ in range(60):
        seed = int(rng.integers(0, 2**64, dtype=np.uint64))
        pos = int(rng.integers(-(2**62), 2**62))
        words = np.array([philox4x32_10(seed, pos % 2**64, 3, (v >> 6) * 16 + (v & 15))
                          [(v >> 4) & 3] for v in range(vocab)], np.int64)
        low = np.sort(words)[:2]
        if low[0] >> 8 == low[1] >> 8:  # the noise rounds them alike: a tie, skip
            continue
        tok = sf.sample(np.zeros((1, vocab), np.float32), seed=seed, position=pos,
                        method="coupled")
        assert tok[0] == int(np.argmin(words)), f"seed={seed} position={pos}"
        checked += 1
    assert checked >= 50
