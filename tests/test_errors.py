"""Bad input raises ValueError or TypeError with a message that names the problem; it never
crashes the process. One test per category of the contract; every case changes exactly one
thing of a valid call (checked first by test_base_cases_are_valid).

The bad value is always placed where the kernel must read it: row 0 of a request (always
read), node 0 of a request (always tried), and the same for draft probabilities.
"""

import re

import numpy as np
import pytest

import specfast as sf
from reference import BF16, to_dtype

V = 8
ERRORS = (ValueError, TypeError)


def base_verify():
    """Three requests with 2, 0 and 1 drafts (rows 0-2, 3, 4-5), dense q."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, V)).astype(np.float32)
    draft_tokens = np.array([1, 2, 3], np.int32)
    num_draft = np.array([2, 0, 1], np.int32)
    q = np.full((3, V), 1.0 / V, np.float32)
    return dict(target_logits=logits, draft_tokens=draft_tokens, num_draft=num_draft,
                draft_probs=q)


def base_sparse():
    kw = base_verify()
    ids = np.array([[1, 4, -1], [2, 0, 5], [3, -1, -1]], np.int32)
    vals = np.array([[0.5, 0.5, 0.0], [0.25, 0.25, 0.5], [1.0, 0.0, 0.0]], np.float32)
    return kw, ids, vals


def base_rows():
    rng = np.random.default_rng(1)
    return rng.standard_normal((4, V)).astype(np.float32)


def raises(fn, pattern):
    with pytest.raises(ERRORS) as exc:
        fn()
    msg = str(exc.value)
    assert msg, "empty error message"
    assert re.search(pattern, msg, re.I), f"message {msg!r} does not match {pattern!r}"


def test_base_cases_are_valid():
    sf.verify(**base_verify())
    kw, ids, vals = base_sparse()
    kw["draft_probs"] = sf.SparseProbs(ids, vals)
    sf.verify(**kw)
    kw["parents"] = np.array([-1, 0, -1], np.int32)
    sf.verify(**kw)
    sf.sample(base_rows())
    sf.probs(base_rows())
    # -inf alone is a banned token, not an error
    x = base_rows()
    x[:, 0] = -np.inf
    sf.probs(x)
    sf.sample(x)
    kw = base_verify()
    kw["target_logits"][:, 5] = -np.inf
    sf.verify(**kw)


# ---------------------------------------------------------------------------------------
# Logits values
# ---------------------------------------------------------------------------------------

BAD_VALUES = {
    "nan": (np.nan, r"nan|finite|logit"),
    "+inf": (np.inf, r"inf|finite|logit"),
}


@pytest.mark.parametrize("row", [0, 3, 4], ids=lambda r: f"row={r}")
@pytest.mark.parametrize("value", list(BAD_VALUES), ids=list(BAD_VALUES))
def test_verify_bad_logit_values(value, row):
    v, pattern = BAD_VALUES[value]
    kw = base_verify()
    kw["target_logits"][row, 2] = v  # rows 0, 3, 4 are the row 0 of a request
    request = {0: 0, 3: 1, 4: 2}[row]  # the message names the request, not the row
    raises(lambda: sf.verify(**kw), pattern)
    raises(lambda: sf.verify(**kw), rf"\(request {request}\)")
    raises(lambda: sf.verify(**kw, method="coupled"), rf"\(request {request}\)")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("at", [0, 24_000, 24_001, 39_999], ids=lambda a: f"at={a}")
@pytest.mark.parametrize("value", list(BAD_VALUES) + ["all -inf"])
def test_lone_request_split_row_bad_values(value, at, dtype):
    """A lone request's wide rows are read by several threads, each a part:
    a bad value in any part is still an error, in every kind of max pass
    (greedy; the top-k reservoir; with the bound of the mass, plain
    sampling), at even and odd positions (bfloat16 is read in halves)."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 40_000)).astype(np.float32)
    if value == "all -inf":
        logits[1] = -np.inf
        pattern = r"inf|mask|all|finite|logit"
    else:
        logits[1, at], pattern = BAD_VALUES[value]
    logits[0, 3] = 60.0  # p = 1: the first draft is accepted, so row 1 is reached
    logits = to_dtype(logits, dtype)
    tokens = np.array([3, 5], np.int32)
    raises(lambda: sf.verify(logits, tokens, np.array([2]), temperature=0.0), pattern)
    raises(lambda: sf.verify(logits, tokens, np.array([2]), top_k=50), pattern)
    raises(lambda: sf.verify(logits, tokens, np.array([2]), seed=1), pattern)


@pytest.mark.parametrize("value", list(BAD_VALUES), ids=list(BAD_VALUES))
@pytest.mark.parametrize("fn", ["sample", "probs"])
def test_rows_bad_logit_values(fn, value):
    v, pattern = BAD_VALUES[value]
    x = base_rows()
    x[2, 5] = v
    raises(lambda: getattr(sf, fn)(x), pattern)
    raises(lambda: getattr(sf, fn)(x), r"\(row 2\)")


@pytest.mark.parametrize("fn", ["verify", "sample", "probs"])
def test_all_masked_row(fn):
    pattern = r"inf|mask|all|finite|logit"
    if fn == "verify":
        kw = base_verify()
        kw["target_logits"][3] = -np.inf
        raises(lambda: sf.verify(**kw), pattern)
    else:
        x = base_rows()
        x[1] = -np.inf
        raises(lambda: getattr(sf, fn)(x), pattern)


@pytest.mark.parametrize("value", list(BAD_VALUES), ids=list(BAD_VALUES))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_bad_logit_values_lower_precision(dtype, value):
    v, pattern = BAD_VALUES[value]
    x = base_rows()
    x[0, 0] = v
    low = to_dtype(x, dtype)
    raises(lambda: sf.probs(low), pattern)
    raises(lambda: sf.sample(low), pattern)
    kw = base_verify()
    kw["target_logits"][0, 0] = v
    kw["target_logits"] = to_dtype(kw["target_logits"], dtype)
    raises(lambda: sf.verify(**kw), pattern)


def forced_first_accept():
    """Request 0's node 0 is accepted for sure (p = 1 on its token): its row 1 is read."""
    kw = base_verify()
    kw["target_logits"][0] = -np.inf
    kw["target_logits"][0, 1] = 0.0
    return kw


@pytest.mark.parametrize("value", list(BAD_VALUES), ids=list(BAD_VALUES))
def test_bad_logits_in_a_row_reached_by_acceptance(value):
    v, pattern = BAD_VALUES[value]
    kw = forced_first_accept()
    kw["target_logits"][1, 6] = v
    raises(lambda: sf.verify(**kw), pattern)


def test_malformed_draft_probs_of_a_node_reached_by_acceptance():
    """Node 1 of request 0 is tried after node 0 is accepted for sure, and is rejected for
    sure (its token is banned in row 1): its residual's first try reads q at a token of
    row 1, where q is bad at every token but node 1's own."""
    kw = forced_first_accept()
    kw["target_logits"][1, 2] = -np.inf  # node 1 drafts token 2
    kw["draft_probs"][1] = -0.5
    kw["draft_probs"][1, 2] = 0.5
    raises(lambda: sf.verify(**kw), r"malformed draft probabilities \(request 0\)")


# ---------------------------------------------------------------------------------------
# Draft tokens and counts
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("token", [V, -1, 2**31 - 1], ids=lambda t: f"token={t}")
@pytest.mark.parametrize("node", [0, 2], ids=lambda n: f"node={n}")
def test_draft_token_out_of_range(token, node):
    kw = base_verify()
    kw["draft_tokens"][node] = token
    request = {0: 0, 2: 2}[node]  # the index names the request that owns the node
    raises(lambda: sf.verify(**kw), rf"draft token out of range \(request {request}\)")


SHAPES = {
    "sum(num_draft)!=N": lambda kw: kw.update(num_draft=np.array([2, 1, 1], np.int32)),
    "too-few-tokens": lambda kw: kw.update(draft_tokens=kw["draft_tokens"][:2]),
    "rows!=sum(num_draft+1)": lambda kw: kw.update(target_logits=kw["target_logits"][:5]),
    "too-many-rows": lambda kw: kw.update(
        target_logits=np.vstack([kw["target_logits"], kw["target_logits"][:1]])
    ),
    "negative-num_draft": lambda kw: kw.update(
        num_draft=np.array([4, -1, 0], np.int32),  # sums agree: only the sign is wrong
        target_logits=kw["target_logits"][:6],
    ),
    "logits-1d": lambda kw: kw.update(target_logits=kw["target_logits"].reshape(-1)),
    "logits-3d": lambda kw: kw.update(target_logits=kw["target_logits"][None]),
    "draft_tokens-2d": lambda kw: kw.update(draft_tokens=kw["draft_tokens"][None]),
}


@pytest.mark.parametrize("case", list(SHAPES))
def test_inconsistent_shapes(case):
    kw = base_verify()
    if case == "negative-num_draft":
        kw["draft_probs"] = None
    SHAPES[case](kw)
    raises(lambda: sf.verify(**kw), r"num_draft|shape|row|draft|token|sum|length|size|dim|neg")


# ---------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------

BAD_PARAMS = {
    "temperature=-1": ("temperature", -1.0),
    "temperature=nan": ("temperature", float("nan")),
    "temperature=1e31": ("temperature", 1e31),
    "top_p=0": ("top_p", 0.0),
    "top_p=1.5": ("top_p", 1.5),
    "top_p=-0.1": ("top_p", -0.1),
    "top_p=nan": ("top_p", float("nan")),
    "min_p=-0.1": ("min_p", -0.1),
    "min_p=1.5": ("min_p", 1.5),
    "min_p=nan": ("min_p", float("nan")),
    "top_k=-1": ("top_k", -1),
}


@pytest.mark.parametrize("fn", ["verify", "sample", "probs"])
@pytest.mark.parametrize("case", list(BAD_PARAMS))
def test_invalid_parameters(case, fn):
    name, value = BAD_PARAMS[case]
    if fn == "verify":
        kw = base_verify()
        call = lambda **p: sf.verify(**kw, **p)  # noqa: E731
        n = 3
    else:
        x = base_rows()
        call = lambda **p: getattr(sf, fn)(x, **p)  # noqa: E731
        n = 4
    raises(lambda: call(**{name: value}), name)
    # per-request / per-row: one bad entry among good ones
    good = {"temperature": 1.0, "top_p": 1.0, "min_p": 0.0, "top_k": 0}[name]
    arr = np.full(n, good, np.int32 if name == "top_k" else np.float32)
    arr[n - 1] = value
    raises(lambda: call(**{name: arr}), name)


@pytest.mark.parametrize("name, value, shown", [
    ("top_p", 1e-46, "top_p=1e-46 (float32 0.0)"),
    ("temperature", 1e39, "temperature=1e+39 (float32 inf)"),
    ("top_p", 1.5, "top_p=1.5, "),
])
def test_a_value_that_float32_rounds_out_of_range_says_so(name, value, shown):
    """The rules hold for the float32 values the kernels read: a value that
    rounds to 0 or inf is shown with its float32 value (1e-46 > 0 was refused
    as breaking 0 < top_p)."""
    raises(lambda: sf.sample(base_rows(), **{name: value}), re.escape(shown))


@pytest.mark.parametrize("method", ["greedy", ["rejection"], None, 1], ids=str)
@pytest.mark.parametrize("fn", ["verify", "sample"])
def test_unknown_method(fn, method):
    """Named in the message (a list was an 'unhashable type' error)."""
    if fn == "verify":
        raises(lambda: sf.verify(**base_verify(), method=method), "method must be")
    else:
        raises(lambda: sf.sample(base_rows(), method=method), "method must be")


LENGTH_CASES = [
    (fn, name)
    for fn in ["verify", "sample", "probs"]
    for name in ["temperature", "top_k", "top_p", "min_p", "seed", "position"]
    if not (fn == "probs" and name in ("seed", "position"))  # probs takes neither
]


@pytest.mark.parametrize("length", [2, 4], ids=lambda n: f"len={n}")
@pytest.mark.parametrize("fn, name", LENGTH_CASES, ids=["-".join(c) for c in LENGTH_CASES])
def test_parameter_array_of_wrong_length(fn, name, length):
    value = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 1,
             "position": 0}[name]
    # verify has 3 requests, sample / probs have 4 rows; 2 and 4 / 2 and 5 are wrong
    n = length if fn == "verify" else length + (length > 3)
    arr = np.full(n, value)
    if fn == "verify":
        call = lambda: sf.verify(**base_verify(), **{name: arr})  # noqa: E731
    else:
        call = lambda: getattr(sf, fn)(base_rows(), **{name: arr})  # noqa: E731
    raises(call, rf"{name}|length|shape|size|request|row")


# ---------------------------------------------------------------------------------------
# Parents
# ---------------------------------------------------------------------------------------

BAD_PARENTS = {
    "self": [0, 0, -1],  # node 0 of request 0 is its own parent
    "later": [1, -1, -1],  # parent after the child
    "equal-index": [-1, 1, -1],  # node 1's parent is node 1
    "below-minus-one": [-1, -2, -1],
    "other-request": [-1, 0, 1],  # request 2 has one node: parent 1 does not exist
    "too-short": [-1, 0],
    "too-long": [-1, 0, -1, -1],
}


@pytest.mark.parametrize("case", list(BAD_PARENTS))
def test_invalid_parents(case):
    kw = base_verify()
    kw["parents"] = np.array(BAD_PARENTS[case], np.int32)
    raises(lambda: sf.verify(**kw), r"parent|shape|length")
    raises(lambda: sf.verify(**kw, method="coupled"), r"parent|shape|length")


# ---------------------------------------------------------------------------------------
# Draft probabilities
# ---------------------------------------------------------------------------------------


def _neg(q):
    q[0, 3] = -0.1
    q[0, 4] += 0.1


def _nan(q):
    q[0, 3] = np.nan


def _inf(q):
    q[0, 5] = np.inf


def _sum(q):
    q[0] *= 0.9  # sums to 0.9: outside 1 +- 1e-3


def _sum2(q):
    q[0] *= 1.01


BAD_DENSE = {"negative": _neg, "nan": _nan, "inf": _inf, "sum=0.9": _sum, "sum=1.01": _sum2}


@pytest.mark.parametrize("case", list(BAD_DENSE))
def test_malformed_dense_draft_probs(case):
    """The bad row is node 0's, whose draft has target probability 0 and is rejected for
    sure; node 1, its later sibling, is tried against the residual max(0, p - q), which is
    therefore formed whole, reading every q of the row."""
    kw = base_verify()
    kw["parents"] = np.array([-1, -1, -1], np.int32)
    kw["target_logits"][0, 1] = -np.inf  # request 0, node 0 drafts token 1
    BAD_DENSE[case](kw["draft_probs"])
    raises(lambda: sf.verify(**kw), r"malformed draft probabilities \(request 0\)")


@pytest.mark.parametrize("value", [-0.1, np.nan, np.inf, 1.5],
                         ids=["negative", "nan", "inf", "above-one"])
def test_malformed_dense_draft_probs_at_a_token_a_residual_try_draws(value):
    """The last sibling's residual is drawn by tries from p, each reading q at the token it
    drew: a row bad at every token but the drafted one (p = 0, never drawn) always fails."""
    for seed in range(8):
        kw = base_verify()
        kw["target_logits"][4, 3] = -np.inf  # request 2, node 2 drafts token 3
        kw["draft_probs"][2] = value
        kw["draft_probs"][2, 3] = 1 / V
        raises(lambda: sf.verify(**kw, seed=seed),
               r"malformed draft probabilities \(request 2\)")


@pytest.mark.parametrize("kw", [dict(top_k=2), dict(top_p=0.9999), dict(min_p=0.01)],
                         ids=["top_k", "top_p", "min_p"])
def test_dense_draft_probs_over_the_kept_tokens_checked_where_the_residual_is_empty(kw):
    """Under a filter q's sum is not read whole, but a residual left empty (q >= p at
    every kept token) shows q's kept mass: above 1 + 1e-3 q is no distribution, an
    error, not a rejected draft emitted again as its own correction."""
    logits = np.zeros((2, 4), np.float32)
    logits[:, 2:] = -np.inf  # p = [.5, .5, 0, 0]
    q = np.array([[1.0, 1.0, 0.0, 0.0]], np.float32)  # sums to 2
    errors = 0
    for seed in range(64):
        try:
            r = sf.verify(logits, [0], [1], draft_probs=q, seed=seed, **kw)
        except sf.RequestError as e:
            assert "malformed draft probabilities" in str(e) and e.index == 0
            errors += 1
        else:
            assert r.num_accepted[0] == 1, r  # accepted (p/q = 1/2), never emitted again
    assert 0 < errors < 64


@pytest.mark.parametrize("scale, bad", [(1.01, True), (1.0005, False)])
def test_dense_draft_probs_sum_checked_where_no_try_keeps_a_token(scale, bad):
    """Where q covers p (q >= p at every token, by 0.05% or more) the residual is empty:
    no try keeps a token, the residual is formed whole and q's sum is checked."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((2, V)).astype(np.float32)
    logits[0, 1] = -np.inf  # the draft (token 1), q(x) = 0 below: rejected for sure
    p = np.exp(logits[0].astype(np.float64) - logits[0].max())
    q = (scale * p / p.sum()).astype(np.float32)[None]
    for seed in range(8):
        kw = dict(target_logits=logits, draft_tokens=np.array([1], np.int32),
                  num_draft=np.array([1], np.int32), draft_probs=q, seed=seed)
        if bad:
            raises(lambda: sf.verify(**kw), r"malformed draft probabilities \(request 0\)")
        else:
            assert sf.verify(**kw).tokens[0, 0] not in (-1, 1)


@pytest.mark.parametrize("value", [-0.01, np.nan, np.inf], ids=["negative", "nan", "inf"])
@pytest.mark.parametrize("filt", [dict(top_k=5), dict(top_p=0.5), dict(min_p=0.1)],
                         ids=["top_k", "top_p", "min_p"])
def test_malformed_dense_draft_probs_at_a_kept_token_under_a_filter(filt, value):
    """Under a filter a residual formed whole (for a later sibling) reads q only where a
    token is kept: a bad value there is an error (the most probable token is kept by
    every filter)."""
    rng = np.random.default_rng(11)
    logits = rng.standard_normal((3, 64)).astype(np.float32)
    logits[0, 1] = -np.inf  # node 0's draft (token 1) has p = 0: rejected, the residual formed
    q = np.full((2, 64), 1 / 64, np.float32)
    q[0, int(np.argmax(logits[0]))] = value
    kw = dict(target_logits=logits, draft_tokens=np.array([1, 2], np.int32),
              num_draft=np.array([2], np.int32), parents=np.array([-1, -1], np.int32),
              draft_probs=q, **filt)
    raises(lambda: sf.verify(**kw), r"malformed draft probabilities \(request 0\)")


def test_a_large_top_k_is_a_filter_for_the_sum_check():
    """Any top_k below the vocabulary cuts the row, so q's sum is not checked where a
    residual is formed whole: top_k past 4096 (the kernel's scan, not its reservoir)
    too, where the tokens not kept all weigh 0 (logits 1000 below the max), and the
    tokens drawn are the same whatever top_k past the weighted ones."""
    vocab = 6000
    rng = np.random.default_rng(5)
    logits = np.full((3, vocab), -1000.0, np.float32)
    logits[:, :20] = rng.standard_normal((3, 20))
    logits[0, 1] = -np.inf  # node 0's draft: rejected, the residual formed for node 1
    q = np.full((2, vocab), 0.9 / vocab, np.float32)  # sums to 0.9
    q[:, 1] = 0.0
    kw = dict(target_logits=logits, draft_tokens=np.array([1, 2], np.int32),
              num_draft=np.array([2], np.int32), parents=np.array([-1, -1], np.int32),
              draft_probs=q)
    for seed in range(4):
        got = {k: sf.verify(**kw, top_k=k, seed=seed).tokens.tolist()
               for k in (50, 4000, 4097, 5000, vocab - 1)}
        assert len(set(map(str, got.values()))) == 1, got
    raises(lambda: sf.verify(**kw), r"malformed draft probabilities \(request 0\)")


MASS_ONE = 1 << 40
MASS_TOL = MASS_ONE // 1000


def _q_with_mass(vocab, mass):
    """A float32 q row whose sum of floor(q 2^40), the exact quantity the 1 +- 1e-3 check
    tests (on every backend), is `mass`: equal values, and a last one below 2^-16, whose
    ulp is 2^-40, taking up the difference."""
    rest = mass - 12_000_000
    c = np.float32(rest / (vocab - 1) / MASS_ONE)
    q = np.full(vocab, c, np.float32)
    d = mass - (vocab - 1) * int(np.floor(np.float64(c) * MASS_ONE))
    assert 0 <= d < 1 << 24
    q[-1] = np.float32(d / MASS_ONE)
    assert sum(int(v) for v in np.floor(q.astype(np.float64) * MASS_ONE)) == mass
    return q


@pytest.mark.parametrize("vocab", [1000, 40003])  # 40003: a lone request's row is split
@pytest.mark.parametrize("offset,bad", [
    (MASS_TOL, False), (MASS_TOL + 1, True), (-MASS_TOL, False), (-MASS_TOL - 1, True)])
def test_dense_draft_probs_sum_at_the_edge_of_the_tolerance(vocab, offset, bad):
    """q may sum to 1 within 1e-3, judged on the exact sum: one 2^-40 past the edge fails."""
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((3, vocab)).astype(np.float32)
    logits[0, 1] = -np.inf  # node 0's draft (token 1) has p = 0: rejected,
    # and q read whole for node 1, its later sibling
    q = np.stack([_q_with_mass(vocab, MASS_ONE + offset), np.full(vocab, 1 / vocab, np.float32)])
    kw = dict(target_logits=logits, draft_tokens=np.array([1, 2], np.int32),
              num_draft=np.array([2], np.int32), parents=np.array([-1, -1], np.int32),
              draft_probs=q)
    if bad:
        raises(lambda: sf.verify(**kw), r"malformed draft probabilities \(request 0\)")
    else:
        assert sf.verify(**kw).tokens[0, 0] != 1


BAD_AT_TOKEN = {"negative": -0.1, "nan": np.nan, "inf": np.inf, "above-one": 1.5}


@pytest.mark.parametrize("case", list(BAD_AT_TOKEN))
def test_malformed_draft_prob_of_the_drafted_token(case):
    """q(x) of node 0's own token is read by every outcome: always detected."""
    for seed in range(8):
        kw = base_verify()
        kw["draft_probs"][0, 1] = BAD_AT_TOKEN[case]  # request 0, node 0 drafts token 1
        raises(lambda: sf.verify(**kw, seed=seed),
               r"malformed draft probabilities \(request 0\)")


@pytest.mark.parametrize("shape", [(3, V + 1), (3, V - 1), (2, V), (4, V), (3 * V,)],
                         ids=lambda s: "x".join(map(str, s)))
def test_dense_draft_probs_wrong_shape(shape):
    kw = base_verify()
    kw["draft_probs"] = np.full(shape, 1.0 / shape[-1], np.float32)
    raises(lambda: sf.verify(**kw), r"draft|prob|shape|size|vocab")


def _row0(delta):
    """A change to the sparse probabilities of node 0 (request 0) only."""
    return np.array([delta, [0, 0, 0], [0, 0, 0]], np.float32)


BAD_SPARSE = {
    "values-wider": lambda ids, vals: (ids, np.hstack([vals, np.zeros((3, 1), np.float32)])),
    "fewer-rows": lambda ids, vals: (ids[:2], vals[:2]),
    "id>=vocab": lambda ids, vals: (np.where(ids == 4, V, ids), vals),
    "id<-1": lambda ids, vals: (np.where(ids == 4, -2, ids), vals),
    "unused-slot-has-mass": lambda ids, vals: (ids, vals + _row0([0, -0.1, 0.1])),
    "negative": lambda ids, vals: (ids, vals + _row0([0.6, -0.6, 0])),
    "nan": lambda ids, vals: (ids, np.where(ids == 1, np.nan, vals).astype(np.float32)),
    "sum=0.9": lambda ids, vals: (ids, vals * np.array([[0.9], [1], [1]], np.float32)),
    "ids-1d": lambda ids, vals: (ids.reshape(-1), vals.reshape(-1)),
}


@pytest.mark.parametrize("case", list(BAD_SPARSE))
def test_malformed_sparse_probs(case):
    kw, ids, vals = base_sparse()
    ids, vals = BAD_SPARSE[case](ids.copy(), vals.copy())

    def call():
        kw["draft_probs"] = sf.SparseProbs(ids, vals)
        return sf.verify(**kw)

    raises(call, r"sparse|draft|prob|shape|id|ind|range|vocab|sum|negative|nan|finite|slot")


# ---------------------------------------------------------------------------------------
# Dtypes
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_, np.complex64])
def test_non_float_logits(dtype):
    kw = base_verify()
    kw["target_logits"] = (kw["target_logits"] * 3).astype(dtype)
    raises(lambda: sf.verify(**kw), r"dtype|float|logit|type")
    raises(lambda: sf.sample(base_rows().astype(dtype)), r"dtype|float|logit|type")
    raises(lambda: sf.probs(base_rows().astype(dtype)), r"dtype|float|logit|type")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_float_draft_tokens(dtype):
    kw = base_verify()
    kw["draft_tokens"] = kw["draft_tokens"].astype(dtype)
    raises(lambda: sf.verify(**kw), r"dtype|int|token|type")


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_torch_tensors_numpy_cannot_read_are_type_errors():
    """Nested tensors (whose layout says strided), tensors on devices that are neither
    the CPU nor CUDA, and dtypes numpy lacks: a TypeError naming the argument. They
    raised torch's internal RuntimeError, NotImplementedError ("CPU tensors only"),
    and a TypeError naming only the dtype."""
    torch = pytest.importorskip("torch")
    kw = base_verify()
    rows = torch.from_numpy(base_rows())
    nested = torch.nested.nested_tensor([rows[0], rows[1, :4]])
    meta, f8 = rows.to("meta"), rows.to(torch.float8_e4m3fn)
    for fn in (sf.probs, sf.sample):
        raises(lambda: fn(nested), r"logits must be a regular tensor")
        raises(lambda: fn(torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)),
               r"logits must be a dense tensor, got layout torch.jagged")
        raises(lambda: fn(meta), r"logits is on meta")
        raises(lambda: fn(f8), r"logits must be float32.*float8")
        raises(lambda: fn(rows, temperature=torch.ones(4).to("meta")), r"temperature is on meta")
    raises(lambda: sf.verify(**dict(kw, draft_tokens=torch.nested.nested_tensor(
        [torch.tensor([1, 2]), torch.tensor([3])]))), r"draft_tokens must be a regular")
    q = torch.from_numpy(kw["draft_probs"])
    raises(lambda: sf.verify(**dict(kw, draft_probs=q.to(torch.float8_e4m3fn))),
           r"draft_probs has dtype torch.float8")
    raises(lambda: sf.verify(**dict(kw, draft_probs=q.to("meta"))), r"draft_probs is on meta")


def test_float_sparse_ids():
    kw, ids, vals = base_sparse()

    def call():
        kw["draft_probs"] = sf.SparseProbs(ids.astype(np.float32), vals)
        return sf.verify(**kw)

    raises(call, r"dtype|int|ind|id|sparse|type")


def test_library_survives_errors():
    """After every kind of error the library still gives correct results."""
    kw = base_verify()
    a = sf.verify(**kw, seed=5)
    bad = base_verify()
    bad["target_logits"][0, 0] = np.nan
    for _ in range(3):
        with pytest.raises(ERRORS):
            sf.verify(**bad, seed=5)
    b = sf.verify(**kw, seed=5)
    np.testing.assert_array_equal(a.tokens, b.tokens)


@pytest.mark.parametrize("call, match", [
    (lambda: sf.probs(base_rows(), temperature=10**400), "temperature.*too large"),
    (lambda: sf.sample(base_rows(), top_p=10**400), "top_p.*too large"),
    (lambda: sf.set_num_threads(2**31), "set_num_threads"),
    (lambda: sf.SparseProbs([[5]], [[1.0]]).dense(3), "ids must be in"),
    (lambda: sf.SparseProbs([[5, 5]], [[0.5, 0.5]]).dense(9), "repeats"),
], ids=["huge-int-temperature", "huge-int-top_p", "threads", "dense-id", "dense-duplicate"])
def test_out_of_range_numbers_are_value_errors(call, match):
    """Numbers no C type holds are ValueErrors, not OverflowError or IndexError."""
    with pytest.raises(ValueError, match=match):
        call()


def test_long_double_and_big_endian_are_taken():
    """np.longdouble parameters and non-native byte orders mean what they say."""
    x = base_rows()
    ref = sf.sample(x, temperature=0.5, seed=5)
    np.testing.assert_array_equal(sf.sample(x, temperature=np.longdouble(0.5), seed=np.longdouble(5)), ref)
    np.testing.assert_array_equal(sf.sample(x.astype(">f4"), temperature=0.5, seed=5), ref)
    np.testing.assert_array_equal(sf.probs(x.astype(">f2")), sf.probs(x.astype(np.float16)))
    assert sf.sample(np.zeros((0, V), np.float32), top_k=np.array([], np.int32)).shape == (0,)


def at_odd_address(a):
    """A copy of `a` whose data starts one byte past an aligned address (numpy
    makes such arrays of a buffer at an odd offset)."""
    a = np.asarray(a)
    u = np.frombuffer(bytearray(a.nbytes + 1), a.dtype, a.size, offset=1).reshape(a.shape)
    u[...] = a
    assert not u.flags.aligned
    return u


def test_arrays_at_odd_addresses_are_taken():
    """Arrays whose data is not aligned to their type are copied before the C
    core (which refuses them) reads them, every input of every call."""
    odd = at_odd_address
    kw, ids, vals = base_sparse()
    ref = sf.verify(**kw, seed=3)
    for name in kw:
        got = sf.verify(**dict(kw, **{name: odd(kw[name])}), seed=3)
        np.testing.assert_array_equal(got.tokens, ref.tokens, err_msg=name)
    x16 = kw["target_logits"].astype(np.float16)
    np.testing.assert_array_equal(sf.verify(**dict(kw, target_logits=odd(x16)), seed=3).tokens,
                                  sf.verify(**dict(kw, target_logits=x16), seed=3).tokens)
    strided = np.zeros((6, V + 1), np.float32)  # rows read in place, at a stride
    strided[:, :V] = kw["target_logits"]
    got = sf.verify(**dict(kw, target_logits=odd(strided)[:, :V]), seed=3)
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    sparse = dict(kw, draft_probs=sf.SparseProbs(ids, vals))
    np.testing.assert_array_equal(
        sf.verify(**dict(sparse, draft_probs=sf.SparseProbs(odd(ids), odd(vals))), seed=3).tokens,
        sf.verify(**sparse, seed=3).tokens)
    parents = np.array([-1, -1, -1], np.int32)
    np.testing.assert_array_equal(sf.verify(**kw, parents=odd(parents), seed=3).tokens,
                                  sf.verify(**kw, parents=parents, seed=3).tokens)
    params = dict(temperature=np.float32([0.5, 0.7, 0.9]), top_k=np.int32([0, 3, 5]),
                  top_p=np.float32([1, 0.8, 0.9]), min_p=np.float32([0, 0.1, 0]),
                  seed=np.uint64([1, 2, 3]), position=np.int64([4, 5, 6]))
    ref = sf.verify(**kw, **params)
    for name, v in params.items():
        got = sf.verify(**kw, **dict(params, **{name: odd(v)}))
        np.testing.assert_array_equal(got.tokens, ref.tokens, err_msg=name)
    x = base_rows()
    np.testing.assert_array_equal(sf.sample(odd(x), seed=odd(np.uint64([1, 2, 3, 4]))),
                                  sf.sample(x, seed=np.uint64([1, 2, 3, 4])))
    np.testing.assert_array_equal(sf.probs(odd(x), top_k=odd(np.int32([1, 2, 3, 4]))),
                                  sf.probs(x, top_k=np.int32([1, 2, 3, 4])))
    tree = np.array([-1, 0, 0, -1], np.int32), np.array([3, 1], np.int32)
    want = sf.tree_mask(*tree, packed=True)
    for got, expected in zip(sf.tree_mask(*map(odd, tree), packed=True), want):
        np.testing.assert_array_equal(got, expected)
    cache = np.arange(2 * 6 * 4, dtype=np.float32).reshape(2, 6, 4)
    paths = np.array([[0, 1], [-1, -1]], np.int32), np.array([2, 0], np.int32), np.int64([1, 0])
    want = cache.copy()
    sf.kv_compact(want, *paths, seq_axis=1)
    got = odd(cache)
    sf.kv_compact(got, *map(odd, paths), seq_axis=1)
    np.testing.assert_array_equal(got, want)


def test_c_entries_refuse_misaligned_pointers():
    """C callers get SF_ERR_ARGUMENT for a pointer not aligned to its type
    (reading through one is undefined in C; on a GPU it faults)."""
    from specfast._lib import ffi, lib

    L = lib()
    logits = np.zeros((3, 8), np.float32)
    buf = ffi.from_buffer(logits)
    mem = ffi.new("char[]", 64)
    vals = dict(temperature=("float", 0.8), top_k=("int32_t", 0), top_p=("float", 1.0),
                min_p=("float", 0.0), seed=("uint64_t", 1), position=("int64_t", 0))

    def params(odd=None):
        ptrs = []
        for i, (name, (t, v)) in enumerate(vals.items()):
            p = ffi.cast(t + " *", mem + 8 * i + (1 if name == odd else 0))
            p[0] = v
            ptrs += [p, 1]
        return ffi.new("sf_params *", ptrs)

    toks, nd = ffi.new("int32_t[]", [7, 6]), ffi.new("int32_t[]", [2])
    out_tok, out_acc, out_nodes = (ffi.new("int32_t[]", 4) for _ in range(3))
    err = ffi.new("sf_error *")

    def shift(p, odd):
        t = ffi.getctype(ffi.typeof(p).item, "*")
        return ffi.cast(t, ffi.cast("char *", p) + 2) if odd else p

    def verify(odd="", par=None):
        d = ffi.new("sf_draft *")
        d.tokens, d.n, d.num_draft, d.batch = shift(toks, odd == "tokens"), 2, \
            shift(nd, odd == "num_draft"), 1
        d.parents = ffi.NULL if par is None else par
        out = ffi.new("sf_verify_out *", (shift(out_tok, odd == "out"), out_acc, out_nodes, 2))
        data = ffi.cast("char *", buf) + (2 if odd == "logits" else 0)
        lg = ffi.new("sf_logits *", (data, 0, 3, 8, 8))
        return L.sf_verify(lg, d, params(odd), 0, out, err)

    assert verify() == 0
    for odd in ("logits", "tokens", "num_draft", "out", *vals):
        assert verify(odd) == L.SF_ERR_ARGUMENT, odd
    par = ffi.new("int32_t[]", [-1, 0, 0])
    assert verify(par=par) == 0
    assert verify(par=shift(par, True)) == L.SF_ERR_ARGUMENT
    bf16 = ffi.new("sf_logits *", (ffi.cast("char *", buf) + 1, 2, 3, 8, 8))
    assert L.sf_sample(bf16, params(), 0, out_tok, err) == L.SF_ERR_ARGUMENT
    lg = ffi.new("sf_logits *", (buf, 0, 3, 8, 8))
    assert L.sf_sample(lg, params(), 0, shift(out_tok, True), err) == L.SF_ERR_ARGUMENT
    probs = ffi.new("float[]", 25)
    assert L.sf_probs(lg, params(), shift(probs, True), err) == L.SF_ERR_ARGUMENT
    assert L.sf_probs(lg, params(), probs, err) == 0
    assert L.sf_tree_mask(ffi.NULL, shift(nd, True), 1, 2, ffi.NULL, ffi.NULL, ffi.NULL,
                          err) == L.SF_ERR_ARGUMENT


def test_lists_of_python_ints_stay_integers():
    """numpy makes float64 of an empty list and of ints mixing [0, 2^63) with
    [2^63, 2^64), as random 64-bit seeds do half the time: refused as floats."""
    x = base_rows()[:2]
    seeds = [12345, 2**63 + 7]
    alone = [sf.sample(x[i:i + 1], seed=s)[0] for i, s in enumerate(seeds)]
    np.testing.assert_array_equal(sf.sample(x, seed=seeds), alone)
    np.testing.assert_array_equal(sf.sample(x, seed=np.array(seeds, np.uint64)), alone)
    kw = base_verify()
    ref = sf.verify(**kw, seed=np.array([1, 2**63, 2**64 - 1], np.uint64))
    got = sf.verify(**kw, seed=[1, 2**63, 2**64 - 1])
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    empty = np.zeros((0, V), np.float32)
    for name in ("seed", "position", "top_k", "temperature"):
        assert sf.sample(empty, **{name: []}).shape == (0,)
        r = sf.verify(empty, [], [], **{name: []})
        assert r.tokens.shape == (0, 1)
    raises(lambda: sf.sample(x, seed=[-1, 2**63]), r"seed.*out of range")
    raises(lambda: sf.verify(**kw, parents=[-1, 2**63, 0]), r"parents.*out of range")
    raises(lambda: sf.verify(**dict(kw, draft_tokens=[1, 2, 2**64])),
           r"draft_tokens.*out of range")


def test_per_request_parameter_errors_name_the_request():
    """A bad value in a per-request array checked in Python names its request and
    the value, as the core's checks of temperature and the filters do."""
    kw = base_verify()
    raises(lambda: sf.verify(**kw, seed=[1, 2, -5]), r"seed must be non-negative \(request 2: -5\)")
    raises(lambda: sf.verify(**kw, top_k=np.array([5, -1, 2])), r"top_k.*\(request 1: -1\)")
    raises(lambda: sf.verify(**kw, position=np.array([1, 2, 2**63], np.uint64)),
           r"position must be below 2\^63 \(request 2: 9223372036854775808\)")
    raises(lambda: sf.verify(**kw, seed=np.array([-3])), r"seed must be non-negative \(got -3\)")


def test_arguments_numpy_would_misread_are_refused():
    """A masked array (numpy drops the mask), booleans in a list (numpy makes 0 and
    1 of them) and a ragged list: errors naming the argument."""
    x = np.zeros((6, 8), np.float32)
    kw = base_verify()
    raises(lambda: sf.probs(np.ma.masked_array(x, mask=x == 0)), "logits is a masked array")
    raises(lambda: sf.verify(**dict(kw, draft_probs=np.ma.masked_array(kw["draft_probs"]))),
           "draft_probs is a masked array")
    raises(lambda: sf.sample(x, seed=[True, 2, 3, 4, 5, 6]), "seed must hold numbers, not bool")
    raises(lambda: sf.verify(**dict(kw, num_draft=[np.True_] + list(kw["num_draft"][1:]))),
           "num_draft must hold numbers, not bool")
    raises(lambda: sf.sample(x, temperature=[1.0, [2.0, 3.0], 1, 1, 1, 1]), "^temperature: ")
    raises(lambda: sf.SparseProbs(np.zeros((1, 2), np.int32),
                                  np.full((1, 2), 0.5, np.float32)).dense(-5),
           r"vocab must be in \[1, \d+\], got -5")


def test_sample_and_probs_count_rows_in_parameter_errors():
    """sample and probs name rows, as the core's messages of the same call do."""
    x = np.zeros((6, 8), np.float32)
    raises(lambda: sf.sample(x, seed=np.array([0, -1, 0, 0, 0, 0])),
           r"seed must be non-negative \(row 1: -1\)")
    raises(lambda: sf.sample(x, top_k=[0, 0, -2, 0, 0, 0]), r"top_k.*\(row 2: -2\)")
    raises(lambda: sf.probs(x, temperature=[1.0, 2.0]),
           r"temperature must be a scalar or have one value per row \(6\)")
    raises(lambda: sf.sample(x, temperature=[1.0] * 5 + [-1.0]),
           r"out of range \(row 5\)")


def test_an_error_of_one_request_says_which_as_an_attribute():
    """What concerns one request (a row of sample) is a RequestError, a ValueError
    whose index names it, so a server can drop it without reading the message:
    whether the core met it (a NaN row, a bad draft, a parameter) or Python did (a
    per-request array). What concerns the whole call is a plain ValueError."""
    kw = base_verify()
    rows = kw["target_logits"].shape[0]
    logits = kw["target_logits"].copy()
    logits[rows - 2, 0] = np.nan  # the last request's first row
    for call, index in [
        (lambda: sf.verify(**dict(kw, target_logits=logits)), len(kw["num_draft"]) - 1),
        (lambda: sf.verify(**kw, top_p=np.array([1.0, 2.0, 1.0])), 1),
        (lambda: sf.verify(**kw, seed=[1, 2, -5]), 2),
        (lambda: sf.sample(np.zeros((3, 8), np.float32), temperature=[1.0, 1.0, -1.0]), 2),
    ]:
        with pytest.raises(sf.RequestError) as e:
            call()
        assert isinstance(e.value, ValueError) and e.value.index == index, e.value
    for call in (lambda: sf.verify(**kw, seed=np.array([-3])),  # one value for all
                 lambda: sf.verify(**kw, temperature=-1.0),  # the core's checks too
                 lambda: sf.verify(**kw, top_p=np.array([0.0], np.float32),
                                   temperature=[1.0, 1.0, -1.0]),  # before any request's
                 lambda: sf.sample(np.zeros((3, 8), np.float32), min_p=2.0),
                 lambda: sf.probs(np.zeros((3, 8), np.float32), top_p=0.0),
                 lambda: sf.verify(**dict(kw, num_draft=[1, 1]))):  # the batch's shape
        with pytest.raises(ValueError) as e:
            call()
        assert not isinstance(e.value, sf.RequestError), e.value


def test_draft_errors_name_the_node_and_what_was_wrong():
    """A bad draft token, parent or draft probability names the node of the failed
    request and the rule it broke, not only the request."""
    kw = base_verify()  # request 0: nodes 0, 1; request 2: node 0 (row 2 of q)
    raises(lambda: sf.verify(**dict(kw, draft_tokens=[1, V + 3, 3])),
           rf"request 0\): node 1: token {V + 3} is not in \[0, {V}\)")
    raises(lambda: sf.verify(**kw, parents=[-1, 1, -1]),
           r"request 0\): node 1: parent 1 is not in \[-1, 1\)")
    q = kw["draft_probs"].copy()
    q[2, 3] = np.nan  # at request 2's drafted token
    raises(lambda: sf.verify(**dict(kw, draft_probs=q)),
           r"request 2\): node 0: draft_probs at its token 3 is nan")
    q = kw["draft_probs"].copy()
    q[0] *= 1.5  # read whole where node 0, rejected, leaves a residual for its sibling
    logits = kw["target_logits"].copy()
    logits[0, 1] = -1e4  # the target never takes node 0's token
    raises(lambda: sf.verify(**dict(kw, draft_probs=q, target_logits=logits,
                                    parents=[-1, -1, -1])),
           r"request 0\): node 0: draft_probs sums to 1.5")
    ids = np.array([[1, -1], [2, -1], [3, 3]])
    raises(lambda: sf.verify(**dict(kw, draft_probs=sf.SparseProbs(ids, np.full((3, 2), 0.5)))),
           r"request 0\): node 0: slot 1 holds token -1 with probability 0.5")
    vals = np.array([[1.0, 0.0], [1.0, 0.0], [0.5, 0.5]])
    raises(lambda: sf.verify(**dict(kw, draft_probs=sf.SparseProbs(ids, vals))),
           r"request 2\): node 0: a token id appears twice")
    vals = np.array([[1.0, 0.0], [0.5, 0.0], [0.0, 0.0]])
    raises(lambda: sf.verify(**dict(kw, draft_probs=sf.SparseProbs(ids, vals))),
           r"request 0\): node 1: the probabilities sum to 0.5, not 1 within 1e-3")


def test_ml_dtypes_bfloat16_parameters_and_draft_probs():
    """numpy's bfloat16 (ml_dtypes) is taken wherever floats are, as torch's is."""
    if BF16 is None:
        pytest.skip("numpy bfloat16 needs ml_dtypes")
    bf16 = BF16
    kw = base_verify()
    ref = sf.verify(**kw, temperature=np.array([0.5, 1.0, 2.0], np.float32), seed=3)
    got = sf.verify(**dict(kw, draft_probs=kw["draft_probs"].astype(bf16)),
                    temperature=np.array([0.5, 1.0, 2.0], bf16), seed=3)
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    raises(lambda: sf.sample(base_rows(), top_k=np.array([2] * 4, bf16)), r"top_k.*integers")


def _bf16_row_off_by(vocab, lo, hi):
    """A float32 distribution whose bfloat16 rounding sums to 1 + d, lo < |d| < hi."""
    torch = pytest.importorskip("torch")
    for seed in range(1000):
        z = np.random.default_rng(seed).standard_normal(vocab) * 2
        q = np.exp(z - z.max())
        q = torch.tensor(q / q.sum(), dtype=torch.float32).to(torch.bfloat16)
        if lo < abs(q.double().sum().item() - 1) < hi:
            return q
    raise AssertionError("no such row")


def test_bfloat16_draft_probs_rows_are_rescaled():
    """bfloat16 keeps 8 significant bits, so a q row rounded to it can sum to 1 +- 2e-3,
    past the 1e-3 check: such a row (within 2^-8 of 1) is rescaled to sum to 1, as
    sampling from it does; dense and sparse, from torch or ml_dtypes. It raised
    "malformed draft probabilities" for most seeds. A row further off still does."""
    torch = pytest.importorskip("torch")
    vocab = 64
    row = _bf16_row_off_by(vocab, 1.2e-3, 2 ** -8)
    logits = np.random.default_rng(1).standard_normal((3, vocab)).astype(np.float32)
    logits[0, 1] = -np.inf  # node 0's draft (token 1) is rejected: q's sum is checked
    q = torch.stack([row, torch.full((vocab,), 1 / vocab, dtype=torch.bfloat16)])
    q[0, 1] = 0
    q32 = q.float().numpy()
    q32 *= (1 / q32.sum(axis=1, dtype=np.float64, keepdims=True)).astype(np.float32)
    kw = dict(target_logits=logits, draft_tokens=np.array([1, 2], np.int32),
              num_draft=np.array([2], np.int32), parents=np.array([-1, -1], np.int32))
    ids = torch.arange(vocab, dtype=torch.int32).repeat(2, 1)
    for seed in range(8):
        want = sf.verify(**kw, draft_probs=q32, seed=seed).tokens
        np.testing.assert_array_equal(sf.verify(**kw, draft_probs=q, seed=seed).tokens, want)
        sparse = sf.verify(**kw, draft_probs=sf.SparseProbs(ids, q), seed=seed).tokens
        np.testing.assert_array_equal(sparse, want)
        if BF16 is not None:
            got = sf.verify(**kw, draft_probs=q.float().numpy().astype(BF16), seed=seed)
            np.testing.assert_array_equal(got.tokens, want)
    off = q.clone()
    off[0] *= 1.01
    raises(lambda: sf.verify(**kw, draft_probs=off), r"malformed draft probabilities")
    raises(lambda: sf.verify(**kw, draft_probs=sf.SparseProbs(ids, off)),
           r"malformed draft probabilities")


def test_c_entries_refuse_sizes_whose_extent_wraps():
    """Sizes no buffer can have are statuses from the C core itself (C callers have no
    Python checks before it): row offsets that wrap read before the buffer and
    returned SF_OK; a width max_draft + 1 that overflows wrote out of bounds; a batch
    far above SF_MAX_BATCH had its parameters checked request by request first."""
    from specfast._api import _MAX_DRAFT
    from specfast._lib import ffi, lib

    L = lib()
    logits = np.zeros((3, 8), np.float32)
    buf = ffi.from_buffer(logits)
    T, tk, tp, mp, seed, pos = (ffi.new(t, v) for t, v in (
        ("float *", 0.8), ("int32_t *", 0), ("float *", 1.0), ("float *", 0.0),
        ("uint64_t *", 1), ("int64_t *", 0)))
    params = ffi.new("sf_params *", (T, 1, tk, 1, tp, 1, mp, 1, seed, 1, pos, 1))
    toks, nd = ffi.new("int32_t[]", [7, 6]), ffi.new("int32_t[]", [2])
    out_tok, out_acc, out_nodes = (ffi.new("int32_t[]", 3) for _ in range(3))
    err = ffi.new("sf_error *")

    def verify(row_stride=8, max_draft=2, batch=1):
        d = ffi.new("sf_draft *")
        d.tokens, d.n, d.num_draft, d.batch = toks, 2, nd, batch
        out = ffi.new("sf_verify_out *", (out_tok, out_acc, out_nodes, max_draft))
        lg = ffi.new("sf_logits *", (buf, 0, 3, 8, row_stride))
        return L.sf_verify(lg, d, params, 0, out, err)

    assert verify() == 0
    assert verify(row_stride=2**62) == L.SF_ERR_SHAPE
    assert verify(max_draft=2**63 - 1) == L.SF_ERR_ARGUMENT
    assert verify(max_draft=_MAX_DRAFT + 1) == L.SF_ERR_ARGUMENT
    assert verify(batch=2**62) == L.SF_ERR_SHAPE
    lg = ffi.new("sf_logits *", (buf, 0, 3, 8, 2**62))
    assert L.sf_sample(lg, params, 0, out_tok, err) == L.SF_ERR_SHAPE
    assert L.sf_probs(lg, params, ffi.cast("float *", buf), err) == L.SF_ERR_SHAPE


def test_a_library_variable_naming_another_library_is_an_import_error(monkeypatch):
    """$SPECFAST_LIBRARY naming a library that is not specfast's (no version symbol)
    is the ImportError of a missing one, which says the variable chose it; the CUDA
    library's variable likewise gives the NotImplementedError of a build without it."""
    import subprocess
    import sys
    env = dict(__import__("os").environ, SPECFAST_LIBRARY="libm.so.6")
    r = subprocess.run([sys.executable, "-c", "import specfast"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "AttributeError" not in r.stderr
    assert "ImportError: specfast: cannot load" in r.stderr
    assert "SPECFAST_LIBRARY names it" in r.stderr
    import importlib
    from specfast import _cuda
    cpu_library = importlib.import_module("specfast._lib")._library_path()
    monkeypatch.setenv("SPECFAST_CUDA_LIBRARY", cpu_library)
    _cuda.lib.cache_clear()
    try:
        with pytest.raises(NotImplementedError, match="SPECFAST_CUDA_LIBRARY names it"):
            _cuda.lib()
    finally:
        _cuda.lib.cache_clear()


def test_torch_entry_points_without_torch_name_what_to_install():
    """HFModel and the CUDA backend, called where torch is not installed, raise an
    ImportError that says what to install (not torch's bare ModuleNotFoundError)."""
    import subprocess
    import sys
    code = """if True:
        import sys
        sys.modules["torch"] = None  # as if torch were not installed
        import numpy as np
        import specfast.cuda
        from specfast.adapters.hf import HFModel
        for call in (lambda: HFModel(object()),
                     lambda: specfast.cuda.verify(np.zeros((2, 4), np.float32),
                                                  np.array([1], np.int32), [1])):
            try:
                call()
            except ImportError as e:
                print(e)
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and "pip install 'specfast[hf]'" in lines[0]
    assert "pip install torch" in lines[1]
