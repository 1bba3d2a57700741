"""specfast.probs against the float64 reference (tests/reference.py)."""

import math

import numpy as np
import pytest

import specfast as sf
from reference import TOLERANCES, as_f64, ref_probs, ref_probs_row, safe_params, to_dtype

VOCABS = [1, 7, 111, 32000, 128256]
DTYPES = ["float32", "float16", "bfloat16"]
TEMPERATURES = [1.0, 0.6, 2.5, 1e-3, 0.0]
FILTERS = {
    "no-filter": dict(),
    "top_k=5": dict(top_k=5),
    "top_k=1": dict(top_k=1),
    "top_p=0.8": dict(top_p=0.8),
    "min_p=0.05": dict(min_p=0.05),
    "all-three": dict(top_k=50, top_p=0.9, min_p=0.02),
}


def make_logits(rng, rows, vocab, dtype, temperature):
    """Rows of logits whose probabilities are neither flat nor one-hot at ``temperature``.

    Row 0 is plain Gaussian; row 1 (when there is one) bans a third of the vocabulary with
    -inf; row 2 has many exact ties (integers). An offset of 5 checks that the maximum is
    subtracted before dividing by a tiny temperature.
    """
    t = temperature if temperature > 0 else 1.0
    spread = 3.0 * t if t < 0.1 else (3.0 if vocab >= 32000 else 2.0)
    # bfloat16 has 8 significant bits: around 5 its step (1/32) is 10 times the spread of
    # the tiny-temperature rows, which would make them all equal.
    offset = 0.0 if dtype == "bfloat16" and t < 0.1 else 5.0
    x = offset + rng.standard_normal((rows, vocab)) * spread
    if rows > 1 and vocab > 1:
        banned = rng.random(vocab) < 1 / 3
        banned[rng.integers(vocab)] = False
        x[1, banned] = -np.inf
    if rows > 2:
        x[2] = offset + np.round(rng.standard_normal(vocab) * 2) * (spread / 2)
    return to_dtype(x.astype(np.float32), dtype)


def check_probs(got, ref, dtype, what=""):
    got = np.asarray(got)
    assert got.dtype == np.float32 and got.shape == ref.shape, (got.dtype, got.shape)
    assert np.all(np.isfinite(got)), f"{what}: non-finite output"
    np.testing.assert_allclose(got, ref, err_msg=what, **TOLERANCES[dtype])
    # Filtered and banned tokens are exactly 0; kept tokens of any weight are not dropped.
    zero_ref = ref == 0
    assert np.all(got[zero_ref] == 0), f"{what}: filtered tokens got mass"
    kept = ref >= 2.0**-30 * ref.max(axis=1, keepdims=True)
    assert np.all(got[kept] > 0), f"{what}: kept tokens were dropped"
    np.testing.assert_allclose(got.astype(np.float64).sum(axis=1), 1.0, rtol=0, atol=1e-5)


@pytest.mark.parametrize("filters", list(FILTERS.values()), ids=list(FILTERS))
@pytest.mark.parametrize("temperature", TEMPERATURES, ids=lambda t: f"T={t:g}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS, ids=lambda v: f"V={v}")
def test_probs_matches_reference(vocab, dtype, temperature, filters, rng):
    rows = 2 if vocab >= 32000 else 4
    logits = make_logits(rng, rows, vocab, dtype, temperature)
    top_k = filters.get("top_k", 0)
    tp, mp = zip(
        *[
            safe_params(r, temperature, top_k, filters.get("top_p", 1.0), filters.get("min_p", 0.0))
            for r in as_f64(logits)
        ]
    )
    tp, mp = np.array(tp), np.array(mp)
    ref = ref_probs(logits, temperature, top_k, tp, mp)
    got = sf.probs(logits, temperature=temperature, top_k=top_k, top_p=tp, min_p=mp)
    assert isinstance(got, np.ndarray)
    check_probs(got, ref, dtype)


LN2 = math.log(2.0)


@pytest.mark.parametrize(
    "logits, params, expected",
    [
        ([0.0, LN2, 2 * LN2], {}, [1 / 7, 2 / 7, 4 / 7]),
        ([0.0, LN2, 2 * LN2], dict(top_k=2), [0, 1 / 3, 2 / 3]),
        ([0.0, LN2, 2 * LN2], dict(top_p=0.5), [0, 0, 1]),
        ([0.0, LN2, 2 * LN2], dict(top_p=0.6), [0, 1 / 3, 2 / 3]),
        ([0.0, LN2, 2 * LN2], dict(min_p=0.3), [0, 1 / 3, 2 / 3]),
        ([0.0, LN2, 2 * LN2], dict(temperature=0), [0, 0, 1]),
        ([1.0, 3.0, 3.0, 0.0, 3.0], dict(top_k=2), [0, 0.5, 0.5, 0, 0]),
        ([1.0, 3.0, 3.0, 0.0, 3.0], dict(top_k=1), [0, 1, 0, 0, 0]),
        ([0.0, 0.0, 0.0, 0.0], dict(top_p=0.4), [0.5, 0.5, 0, 0]),
        ([0.0, 0.0, 0.0, 0.0], dict(top_p=0.2), [1, 0, 0, 0]),
        ([2.0, 2.0, 1.0], dict(min_p=1.0), [0.5, 0.5, 0]),
        ([1.0, 5.0, 5.0], dict(temperature=0), [0, 1, 0]),
        ([-np.inf, 2.0, -np.inf], dict(temperature=0), [0, 1, 0]),
        ([-np.inf, 0.0, 0.0, -np.inf], {}, [0, 0.5, 0.5, 0]),
        ([-np.inf, 7.0, -np.inf], dict(top_p=0.1, min_p=0.9), [0, 1, 0]),
        ([0.0, 0.0, 0.0], dict(top_k=7), [1 / 3, 1 / 3, 1 / 3]),
        ([0.0, -100.0], {}, [1.0, 0.0]),  # e^-100 < 2^-40: flushed to exactly 0
        ([0.0, 0.0, 0.0, 0.0], dict(top_p=0.5), [0.5, 0.5, 0, 0]),  # 0.5 reaches 0.5
        ([0.0, 0.0, 0.0, 0.0], dict(top_p=0.25), [1, 0, 0, 0]),
        ([-np.inf, 1.0, -np.inf, 1.0 + LN2], dict(top_k=3), [0, 1 / 3, 0, 2 / 3]),
        ([0.0, 1.0, 2.0], dict(temperature=1e6), [1 / 3, 1 / 3, 1 / 3]),
        ([-6e4, -6e4, -6e4], {}, [1 / 3, 1 / 3, 1 / 3]),  # finite in float16 too
        ([5.0, 5.0, 5.0, 4.0], dict(top_k=2, top_p=0.4), [1, 0, 0, 0]),
        ([1.0, 2.0, 2.0, 0.0], dict(temperature=1e-30), [0, 0.5, 0.5, 0]),
        ([1.0, 2.0, 2.0, 0.0], dict(temperature=3e-39), [0, 0.5, 0.5, 0]),  # subnormal T
    ],
    ids=[
        "plain",
        "top_k=2",
        "top_p=0.5",
        "top_p=0.6",
        "min_p=0.3",
        "greedy",
        "top_k-ties-lower-id",
        "top_k=1-ties-lower-id",
        "top_p-ties-lower-id",
        "top_p-ties-one",
        "min_p=1-keeps-ties",
        "greedy-ties-lower-id",
        "greedy-banned",
        "banned",
        "single-finite",
        "top_k>vocab",
        "flush-below-2^-40",
        "top_p-reached-exactly",
        "top_p-reached-exactly-one",
        "top_k-more-than-finite",
        "T=1e6",
        "all-very-negative",
        "top_k-then-top_p-ties",
        "T=1e-30-ties",
        "T=3e-39-subnormal",
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_probs_by_hand(logits, params, expected, dtype):
    x = to_dtype(np.array([logits], np.float32), dtype)
    got = sf.probs(x, **params)
    # float16 / bfloat16 round ln 2: compare with the reference of the rounded values, and
    # with the hand-computed values where the input is exact.
    np.testing.assert_allclose(got[0], ref_probs_row(x[0], **params), **TOLERANCES[dtype])
    if dtype == "float32":
        np.testing.assert_allclose(got[0], expected, **TOLERANCES[dtype])
    assert np.all(got[0][np.array(expected) == 0] == 0)


def test_probs_per_row_parameters_equal_single_rows(rng):
    """Per-row parameters give each row what a call with that row alone gives."""
    rows, vocab = 6, 111
    logits = make_logits(rng, rows, vocab, "float32", 1.0)
    temperature = np.array([1.0, 0.5, 2.0, 0.0, 1.3, 0.8], np.float32)
    top_k = np.array([0, 5, 50, 3, 0, 20], np.int32)
    top_p = np.array([1.0, 0.9, 0.7, 0.5, 0.95, 1.0], np.float32)
    min_p = np.array([0.0, 0.0, 0.05, 0.1, 0.01, 0.2], np.float32)
    got = sf.probs(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    for r in range(rows):
        one = sf.probs(
            logits[r : r + 1],
            temperature=float(temperature[r]),
            top_k=int(top_k[r]),
            top_p=float(top_p[r]),
            min_p=float(min_p[r]),
        )
        np.testing.assert_array_equal(got[r], one[0], err_msg=f"row {r}")


def test_probs_scalar_parameters_broadcast(rng):
    logits = make_logits(rng, 5, 111, "float32", 1.0)
    a = sf.probs(logits, temperature=0.7, top_k=20, top_p=0.9, min_p=0.01)
    b = sf.probs(
        logits,
        temperature=np.full(5, 0.7),
        top_k=np.full(5, 20),
        top_p=np.full(5, 0.9),
        min_p=np.full(5, 0.01),
    )
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_probs_strided_and_reordered_input(rng, dtype):
    """Views (a column slice of a wider array, reversed rows) read the right elements."""
    wide = make_logits(rng, 5, 140, dtype, 1.0)
    view = wide[:, 3:114]
    dense = np.ascontiguousarray(view)
    np.testing.assert_array_equal(sf.probs(view, top_k=30), sf.probs(dense, top_k=30))
    np.testing.assert_array_equal(
        sf.probs(dense[::-1], top_p=0.9), sf.probs(dense, top_p=0.9)[::-1]
    )


def cut_rows(rng, vocab):
    """Rows on which the filters' cuts take their other paths: ties on a grid of 1/8
    (16-bit logits tie like this), a flat row, a few finite logits among -inf, one
    spike over a Gaussian tail."""
    plateaus = np.round(rng.standard_normal(vocab) * 24) / 8
    flat = np.zeros(vocab)
    few = np.full(vocab, -np.inf)
    few[rng.choice(vocab, 12, replace=False)] = rng.standard_normal(12)
    spike = rng.standard_normal(vocab)
    spike[rng.integers(vocab)] = 9.0
    return np.stack([plateaus, flat, few, spike]).astype(np.float32)


@pytest.mark.parametrize(
    "filters",
    [dict(top_p=0.5), dict(top_p=0.9), dict(top_p=0.999), dict(top_k=1000), dict(top_k=4096),
     dict(top_k=4097), dict(top_k=25000), dict(top_k=39999), dict(top_k=6000, top_p=0.95)],
    ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()),
)
def test_cuts_on_ties_flat_and_sparse_rows_match_reference(filters, rng):
    """top_p's search of the row's weights, and top_k's reservoir (up to 4096) and
    counting scan past it, cut where the sorted reference cuts (ties by lower id) on
    rows of many ties, a flat row and a row of few finite logits."""
    V = 40000
    logits = cut_rows(rng, V)
    top_k = filters.get("top_k", 0)
    for r, row in enumerate(logits):
        tp = filters.get("top_p", 1.0)
        if r != 1:  # the flat row's masses are all equal steps: no top_p is safe
            tp, _ = safe_params(as_f64(row), 1.0, top_k, tp)
        got = sf.probs(row[None], top_k=top_k, top_p=tp)
        if r == 1:  # the lowest ids, as many as reach top_p of the mass
            n = min(top_k or V, V)
            n = math.ceil(float(np.float32(tp)) * n)
            want = np.zeros((1, V))
            want[0, :n] = 1 / n
            np.testing.assert_array_equal(got > 0, want > 0)
        else:
            want = ref_probs(row[None], 1.0, top_k, tp, 0.0)
        check_probs(got, want, "float32", f"row {r}, {filters}")


@pytest.mark.parametrize("half", [False, True], ids=["e=1/2", "e-just-below-1/2"])
def test_top_p_cut_inside_a_large_tie_at_a_power_of_two(rng, half):
    """One token of weight 1, 10000 of 1/2, 29999 of 1/4 (logits -1, -2 at T = 1/ln 2,
    so e lies on, or a rounding below, the powers of two where the top-p search's
    buckets of e begin): top_p=0.5 keeps the max, every 1/2 and the 4998 lowest ids of
    the 1/4s (the prefix mass 1 + 5000 + 4998/4 first reaches half of 12500.75)."""
    V = 40000
    logits = np.full(V, -2.0, np.float32)
    ids = rng.permutation(V)
    logits[ids[0]] = 0.0
    logits[ids[1:10001]] = -1.0
    temperature = np.float32(1 / math.log(2.0))
    if half:
        temperature = np.nextafter(temperature, np.float32(0))  # c a hair above 1
    got = sf.probs(logits[None], temperature=float(temperature), top_p=0.5)[0]
    quarters = np.sort(ids[10001:])
    kept = np.zeros(V, bool)
    kept[ids[:10001]] = True
    kept[quarters[:4998]] = True
    np.testing.assert_array_equal(got > 0, kept)
    np.testing.assert_allclose(got[kept].sum(), 1.0, rtol=0, atol=1e-5)


@pytest.mark.parametrize("vocab", [7, 32000], ids=lambda v: f"V={v}")
def test_probs_lower_precision_input_is_exact(rng, vocab):
    """float16 / bfloat16 logits give what float32 logits of the same values give."""
    x = make_logits(rng, 3, vocab, "float32", 1.0)
    for dtype in ["float16", "bfloat16"]:
        low = to_dtype(x, dtype)
        same = as_f64(low).astype(np.float32)
        np.testing.assert_array_equal(
            sf.probs(low, top_k=20, top_p=0.95), sf.probs(same, top_k=20, top_p=0.95))


def test_probs_extreme_logits(rng):
    """Large finite logits (no overflow) and a huge spread (no underflow of the maximum)."""
    x = np.array([[3e4, 3e4 - 1.0, -3e4], [-1e30, 0.0, 1e30], [1e-30, 0.0, -1e-30]], np.float32)
    got = sf.probs(x)
    np.testing.assert_allclose(got, ref_probs(x), rtol=1e-5, atol=2.0**-36)
    assert np.all(np.isfinite(got))


def test_probs_tiny_temperature_keeps_relative_precision():
    """T = 1e-3 on logits of size ~20: (x - max) / T, not x / T - max / T, in float32."""
    x = np.array([[20.0, 20.001, 20.002, 20.0035, 19.99]], np.float32)
    ref = ref_probs_row(x[0], 1e-3)
    got = sf.probs(x, temperature=1e-3)[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2.0**-36)


@pytest.mark.parametrize("T", [1e-46, 1e-300, np.float64(5e-324)])
def test_temperature_too_small_for_float32_is_not_greedy(T):
    """A positive temperature that float32 rounds to 0 acts as every tiny one does
    (the mass split between the tokens tied at the top), not as 0 (greedy: the
    lower id alone), whether passed as a number or in a float64 array or tensor."""
    x = np.array([[1.0, 3.0, 3.0], [3.0, 1.0, 0.0]], np.float32)
    want = np.array([[0, 0.5, 0.5], [1, 0, 0]], np.float32)
    np.testing.assert_array_equal(sf.probs(x, temperature=T), want)
    np.testing.assert_array_equal(sf.probs(x, temperature=np.array([T, T])), want)
    np.testing.assert_array_equal(sf.probs(x, temperature=[T, 0.0]), want)
    np.testing.assert_array_equal(sf.probs(x[:1], temperature=0.0), [[0, 1, 0]])
    seeds = np.arange(400, dtype=np.uint64)
    tied = np.repeat(x[:1], 400, axis=0)
    drawn = sf.sample(tied, temperature=T, seed=seeds)
    assert set(drawn.tolist()) == {1, 2}  # both tied tokens drawn, token 1 not always
    torch = pytest.importorskip("torch")
    t = torch.tensor([float(T), float(T)], dtype=torch.float64)
    np.testing.assert_array_equal(sf.probs(torch.from_numpy(x), temperature=t).numpy(), want)
