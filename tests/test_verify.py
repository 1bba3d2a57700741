"""specfast.verify: exactness of rejection sampling (chains and trees; no, dense and sparse
draft probabilities), coupled verification, greedy, keys and batch invariance.

Statistical tests replicate one request many times in ONE call, each copy with its own
seed and position. Two kinds:
- fixed drafts: the exact distribution of (accepted path, emitted token) is computed by
  tests/reference.py:tree_outcomes and compared by chi-square;
- random drafts from a toy drafter (reference.ToyLM): the emitted text must follow the
  target alone (first token ~ p(row 0); given the prefix, the next ~ p(that row)), and
  depth-0 acceptance must be sum_x min(p(x), q(x)).
"""

import numpy as np
import pytest

import specfast as sf
from reference import (
    ToyLM,
    acceptance_ratios,
    accept_uniform,
    as_f64,
    build_toy_batch,
    call_verify,
    chain_parents,
    check_structure,
    children_of,
    coins_decide,
    draft_arg,
    node_depths,
    one_hot,
    outcome_counts,
    pack,
    random_request,
    ref_probs,
    ref_probs_row,
    request_slices,
    safe_params,
    safe_top_p,
    simulate_coupled,
    sparse_to_dense,
    to_dtype,
    tree_outcomes,
)
from scipy import stats as sps
from stats import (ALPHA, POWER, RESOLUTION, SCALE, assert_outcomes, assert_rate,
                   assert_samples, assert_transitions, chi2_table, detectable_tv, scaled,
                   tv_draws)

B_FIXED = scaled(300_000)  # copies of one request with fixed drafts
B_TOY = scaled(150_000)  # requests with random drafts


def replicate(rows, tokens, parents, q, batch, rng, *, kind, dtype="float32", chain=False):
    """``batch`` copies of one request, each with its own seed and position."""
    n = len(tokens)
    logits = to_dtype(np.tile(np.asarray(rows, np.float32), (batch, 1)), dtype)
    kw = dict(
        parents=None if chain else np.tile(np.asarray(parents, np.int32), batch),
        seed=(np.arange(batch, dtype=np.uint64) * 2654435761 + 17).astype(np.uint64),
        position=rng.integers(0, 2**40, batch),
    )
    if kind == "none":
        kw["draft_probs"] = None
    elif kind == "dense":
        kw["draft_probs"] = ("dense", np.tile(np.asarray(q, np.float32), (batch, 1)))
    else:
        ids, vals = q
        kw["draft_probs"] = (
            "sparse",
            np.tile(np.asarray(ids, np.int32), (batch, 1)),
            np.tile(np.asarray(vals, np.float32), (batch, 1)),
        )
    draft_tokens = np.tile(np.asarray(tokens, np.int32), batch)
    num_draft = np.full(batch, n, np.int32)
    return (logits, draft_tokens, num_draft), kw


def dirichlet32(rng, vocab, n, alpha=0.7):
    q = rng.dirichlet(np.full(vocab, alpha), size=n)
    return (q / q.sum(axis=1, keepdims=True)).astype(np.float32)


# ---------------------------------------------------------------------------------------
# Fixed drafts: exact outcome distribution
# ---------------------------------------------------------------------------------------


def fixed_case(name, rng):
    """(rows (n+1, V) float32 logits, parents, tokens, kind, q, q_dense (n, V), params)."""
    V = 8
    params = {}
    tree3 = np.array([-1, -1, -1, 0, 0, 1, 3], np.int32)
    if name.startswith("chain0"):
        rows = rng.standard_normal((1, V)) * 1.5
        empty = np.zeros(0, np.int32)
        return rows, empty, empty, "none", None, np.zeros((0, V)), params
    if name.startswith("chain"):
        n = int(name[5])
        parents = chain_parents(n)
    else:
        parents = tree3
        n = len(parents)
    rows = rng.standard_normal((n + 1, V)) * 1.5
    if "filters" in name:
        params = dict(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05)
    if "greedy" in name:
        params = dict(temperature=0.0)
    ch = children_of(parents, n)
    kind = "none" if "none" in name else ("sparse" if "sparse" in name else "dense")
    # Drafts: a mix of likely and unlikely tokens of the parent's row.
    tokens = np.zeros(n, np.int32)
    q = dirichlet32(rng, V, n)
    for par, kids in ch.items():
        order = np.argsort(-rows[par + 1])
        for j, c in enumerate(kids):
            tokens[c] = order[[1, 0, 3, 5][j % 4]]
            # The drafter favours its token (as it would, having drawn it): q(x) near or
            # above p(x), so coins decide and residuals form.
            w = rng.uniform(0.3, 0.7)
            q[c] *= 1 - w
            q[c, tokens[c]] += w
    if "iid" in name and len(ch[-1]) >= 2:
        # i.i.d. siblings may repeat a token
        tokens[ch[-1][1]] = tokens[ch[-1][0]]
        for c in ch[-1]:
            q[c] = q[ch[-1][0]]
    if "distinct" in name:
        for par, kids in ch.items():
            base = q[kids[0]].astype(np.float64) if kids else None
            for j, c in enumerate(kids):
                left = base.copy()
                left[tokens[kids[:j]]] = 0.0
                q[c] = (left / left.sum()).astype(np.float32)
    if "q0" in name:
        q[0, tokens[0]] = 0.0  # a draft its drafter could not have drawn: always rejected
        q[0] /= q[0].sum()
    if "banned" in name:
        rows[0, tokens[0]] = -np.inf  # p(x) = 0: never accepted, whatever the coin
    if "filtered-draft" in name:
        tokens[0] = np.argsort(-rows[0])[6]  # outside top_k = 5
    q = q.astype(np.float32)
    if kind == "none":
        q_dense = one_hot(tokens, V)
        qarg = None
    elif kind == "dense":
        q_dense = q.astype(np.float64)
        qarg = q
    else:
        K = 4
        ids = np.full((n, K), -1, np.int32)
        vals = np.zeros((n, K), np.float32)
        for i in range(n):
            top = np.argsort(-q[i], kind="stable")[:3]  # 3 ids in 4 slots: one -1 slot
            if i != 2 and tokens[i] not in top:
                top[-1] = tokens[i]
            # node 2 keeps a draft outside its ids: q(x) = 0, rejected
            w = q[i, top].astype(np.float64)
            ids[i, [0, 1, 3]] = top
            vals[i, [0, 1, 3]] = (w / w.sum()).astype(np.float32)
        qarg = (ids, vals)
        q_dense = sparse_to_dense(ids, vals, V)
    return rows.astype(np.float32), parents, tokens, kind, qarg, q_dense, params


FIXED_CASES = [
    "chain0",
    "chain1-dense",
    "chain3-none",
    "chain3-dense",
    "chain3-sparse",
    "chain2-dense-q0",
    "chain2-none-banned",
    "chain2-dense-banned",
    "chain4-dense-filters",
    "chain3-none-filters-filtered-draft",
    "chain3-dense-greedy",
    "tree-none",
    "tree-dense-iid",
    "tree-dense-distinct",
    "tree-sparse",
    "tree-dense-distinct-filters",
    "tree-none-greedy",
]


FIXED_PARAMS = [(name, "float32") for name in FIXED_CASES] + [
    (name, dtype)
    for name in ["chain3-dense", "tree-dense-distinct-filters"]
    for dtype in ["float16", "bfloat16"]
]


@pytest.mark.parametrize("name, dtype", FIXED_PARAMS, ids=["-".join(p) for p in FIXED_PARAMS])
def test_fixed_drafts_exact_outcomes(name, dtype, rng):
    """P(accepted path, emitted token) for fixed drafts is exactly what recursive rejection
    sampling gives (acceptance min(1, p'/q), residual max(0, p' - q) carried over
    siblings, bonus token after an accepted leaf)."""
    rows, parents, tokens, kind, qarg, q_dense, params = fixed_case(name, rng)
    logits_low = to_dtype(rows, dtype)
    rows64 = as_f64(logits_low)
    if "top_p" in params:
        params["top_p"], params["min_p"] = safe_params(
            rows64, params["temperature"], params["top_k"], params["top_p"], params["min_p"]
        )
    p_rows = ref_probs(rows64, **params)
    expected = tree_outcomes(p_rows, parents, tokens, q_dense)
    by_fiat = ("chain0", "none", "greedy", "q0", "banned")  # cases of foregone decisions
    if not any(f in name for f in by_fiat):  # the case decides by coins
        assert coins_decide(acceptance_ratios(p_rows, parents, tokens, q_dense), 0.05, 0.95)
    chain = name.startswith("chain")
    args, kw = replicate(
        rows, tokens, parents, qarg, B_FIXED, rng, kind=kind, dtype=dtype, chain=chain
    )
    res = call_verify(args, kw, **params)
    assert isinstance(res.tokens, np.ndarray)
    check_structure(res, args[1], args[2], kw["parents"], rows.shape[1])
    assert_outcomes(outcome_counts(res), expected, f"{name} ({dtype}, {params})",
                    forced=len(expected) == 1)  # greedy: one outcome, always


def test_fixed_drafts_per_request_parameters(rng):
    """Copies of one request under two parameter sets in one call (per-request arrays):
    each group follows the exact outcome distribution of its own parameters."""
    rows, parents, tokens, kind, qarg, q_dense, _ = fixed_case("chain3-dense", rng)
    groups = [dict(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0),
              dict(temperature=1.3, top_k=4, top_p=0.95, min_p=0.05)]
    groups[1]["top_p"], groups[1]["min_p"] = safe_params(rows, 1.3, 4, 0.95, 0.05)
    args, kw = replicate(rows, tokens, parents, qarg, 2 * B_FIXED, rng, kind=kind, chain=True)
    g = np.arange(2 * B_FIXED) % 2
    for k in groups[0]:
        kw[k] = np.array([groups[0][k], groups[1][k]])[g].astype(
            np.int32 if k == "top_k" else np.float32
        )
    res = call_verify(args, kw)
    for j, params in enumerate(groups):
        expected = tree_outcomes(ref_probs(rows, **params), parents, tokens, q_dense)
        assert_outcomes(outcome_counts(res, g == j), expected, f"group {j}")


@pytest.mark.parametrize("kind", ["dense", "sparse", "none"])
def test_fixed_drafts_exact_outcomes_wide_vocab(kind, rng):
    """V = 1031 (odd, many SIMD blocks and a tail): a root with two siblings and one grand
    child; p concentrated enough that the outcome table is well populated. Outcomes of
    probability below 2e-3 are pooled per path, and 3e5 copies drawn in chunks."""
    V, B, chunk = 1031, scaled(300_000), 20_000
    parents = np.array([-1, -1, 0], np.int32)
    rows = (rng.standard_normal((4, V)) * 3.0).astype(np.float32)
    order0 = np.argsort(-rows[0])
    tokens = np.array([order0[1], order0[0], np.argsort(-rows[1])[2]], np.int32)
    q = rng.dirichlet(np.full(V, 0.05), size=3)
    q[:, tokens] += 0.05  # each draft has weight under its q
    q = (q / q.sum(1, keepdims=True)).astype(np.float32)
    if kind == "dense":
        qarg, q_dense = q, q.astype(np.float64)
    elif kind == "sparse":
        K = 16
        ids = np.argsort(-q, axis=1)[:, :K].astype(np.int32)
        vals = np.take_along_axis(q, ids, 1).astype(np.float64)
        vals = (vals / vals.sum(1, keepdims=True)).astype(np.float32)
        qarg, q_dense = (ids, vals), sparse_to_dense(ids, vals, V)
    else:
        qarg, q_dense = None, one_hot(tokens, V)
    exact = tree_outcomes(ref_probs(rows), parents, tokens, q_dense)
    pool = lambda key: key if exact.get(key, 0) > 2e-3 else (key[0], "rest")
    expected, observed = {}, {}
    for key, v in exact.items():
        expected[pool(key)] = expected.get(pool(key), 0.0) + v
    for start in range(0, B, chunk):
        args, kw = replicate(rows, tokens, parents, qarg, min(chunk, B - start), rng, kind=kind)
        res = call_verify(args, kw)
        check_structure(res, args[1], args[2], kw["parents"], V)
        for key, c in outcome_counts(res).items():
            observed[pool(key)] = observed.get(pool(key), 0) + c
    assert_outcomes(observed, expected, f"V=1031 {kind}")


@pytest.mark.usefixtures("restore_threads")
@pytest.mark.parametrize("filters", [{}, dict(top_k=50, top_p=0.9)], ids=["plain", "filtered"])
def test_lone_request_at_a_wide_vocabulary_follows_the_residual(filters, rng):
    """One request per call at V = 40003: its rows are split across the pool's threads
    (max, bound and exact passes, the residual and the draw). The outcome (accepted or
    not, emitted token) follows recursive rejection sampling exactly. Four strong
    tokens over a tail of 2/3 of the mass (which the filters cut: they keep the four);
    tokens of probability below 2e-3 (the tail's) are pooled into one outcome per
    path, so the table has 9 outcomes (7 filtered) and 1.3e5 draws (one call each)
    see a total variation of 1% in it."""
    sf.set_num_threads(2)
    V = 40003
    row = rng.standard_normal(V).astype(np.float32)
    hot = rng.choice(V, 4, replace=False)
    row[hot] = np.array([9.5, 9.1, 8.8, 8.5], np.float32)
    x = int(hot[0])
    logits = np.stack([row, row])
    if filters:
        filters = dict(filters, top_p=safe_params(row, 1.0, 50, 0.9)[0])
    p = ref_probs_row(row, **filters)
    q = np.full(V, (1 - 2 * p[x]) / (V - 1))
    q[x] = 2 * p[x]  # accepted half the time
    q = (q / q.sum()).astype(np.float32)
    exact = tree_outcomes(np.stack([p, p]), chain_parents(1), np.array([x]),
                          q[None].astype(np.float64))
    assert 0.2 < sum(v for (path, _), v in exact.items() if not path) < 0.8
    assert np.count_nonzero(p) == (4 if filters else V)
    pool = lambda key: key if exact.get(key, 0) > 2e-3 else (key[0], "rest")
    expected = {}
    for key, v in exact.items():
        expected[pool(key)] = expected.get(pool(key), 0.0) + v
    n = scaled(tv_draws(len(expected) - 1))
    tokens, nd, q = np.array([x], np.int32), np.array([1], np.int32), q[None]
    observed = {}
    for i in range(n):
        r = sf.verify(logits, tokens, nd, draft_probs=q, seed=i, position=11, **filters)
        a = int(r.num_accepted[0])
        key = pool((tuple(range(a)), int(r.tokens[0, a])))
        observed[key] = observed.get(key, 0) + 1
    assert_outcomes(observed, expected, f"lone V={V} {filters}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mass", [0.01, 0.05, 0.4], ids=lambda m: f"residual={m}")
def test_residual_drawn_by_tries_or_formed_whole_is_exact(mass, dtype, rng):
    """A last sibling's residual max(0, p - q) is drawn by up to 16 tries from p, each
    keeping its token y with probability max(0, 1 - q(y) / p(y)), and formed whole when
    none keeps one. With a residual of mass 0.01 most draws are formed whole (0.99^16),
    with 0.05 about half, with 0.4 nearly none: each mixture must give the residual
    exactly. The residual is shaped unlike p (a ramp over the tokens), and the draft's
    token x has q(x) = p(x) + mass."""
    V = 8
    rows = rng.standard_normal((2, V)).astype(np.float32) * 0.5
    rows[0, 0] = rows[0].min() - 1.0  # x = token 0, p(x) small: most drafts are rejected
    rows = as_f64(to_dtype(rows, dtype)).astype(np.float32)
    p = ref_probs(as_f64(rows))
    ramp = np.arange(V, dtype=np.float64)  # 0 at x
    shape = p[0] * ramp / (p[0] * ramp).sum()
    assert mass * shape.max() < p[0].max()  # q >= 0
    q = p[0] - mass * shape
    q[0] = p[0, 0] + mass
    q = q.astype(np.float32)[None]
    expected = tree_outcomes(p, np.array([-1], np.int32), np.array([0], np.int32),
                             q.astype(np.float64))
    args, kw = replicate(rows, [0], [-1], q, scaled(1_000_000), rng, kind="dense", dtype=dtype,
                         chain=True)
    res = call_verify(args, kw)
    assert_outcomes(outcome_counts(res), expected, f"residual mass {mass} ({dtype})")
    # the rejected requests' tokens alone: the residual itself, seen to 1% (in the
    # whole outcome table an error there is diluted by the acceptances)
    rejected = np.asarray(res.num_accepted) == 0
    residual = np.maximum(p[0] - q[0].astype(np.float64), 0.0)
    assert_samples(np.asarray(res.tokens)[rejected, 0], residual / residual.sum(),
                   f"residual mass {mass} ({dtype}), rejected requests")


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_drafts_drawn_by_sample_at_the_verify_seed_stay_exact(kind):
    """A drafter that draws its token with specfast.sample at the very seed and position
    that verify then gets: the residual after a rejection must not reuse the uniform
    that chose the token (it did, and a rejected draft of token 0 always became token
    1). The residual has mass 0.1 (drawn whole after 16 failed tries 19% of the time
    with a dense q; always with a sparse one) and is spread evenly over tokens 1 and 2."""
    p = np.array([0.25, 0.375, 0.375])
    q = np.array([0.35, 0.325, 0.325])
    n = scaled(1_000_000)
    seeds = np.arange(n, dtype=np.uint64)
    q_rows = np.tile(q.astype(np.float32), (n, 1))
    drafts = sf.sample(np.log(q_rows), seed=seeds, position=7)
    draft_q = (q_rows if kind == "dense" else
               sf.SparseProbs(np.tile(np.arange(3, dtype=np.int32), (n, 1)), q_rows))
    res = sf.verify(np.tile(np.log(p).astype(np.float32), (2 * n, 1)), drafts,
                    np.ones(n, np.int32), draft_probs=draft_q, seed=seeds, position=7)
    assert_samples(res.tokens[:, 0], p, f"{kind}: the first token")
    rejected = res.num_accepted == 0
    residual = np.maximum(p - q, 0.0)
    assert_samples(res.tokens[rejected, 0], residual / residual.sum(),
                   f"{kind}: the tokens of rejected drafts")


@pytest.mark.parametrize("siblings", ["iid", "distinct"])
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_later_siblings_decide_by_their_own_coin(kind, siblings, rng):
    """Three drafted siblings where the second and third are tried against the residual
    left by the ones before them and accepted with a probability strictly between 0 and 1
    (with q near p, residuals mostly make that a foregone 0 or 1; the case is searched
    for, and the search asserts what it found)."""
    V, k = 8, 3
    parents = np.full(k, -1, np.int32)
    for _ in range(20_000):
        rows = (rng.standard_normal((k + 1, V)) * 1.5).astype(np.float32)
        q0 = rng.dirichlet(np.full(V, 0.7))
        tokens = rng.choice(V, size=k, replace=False, p=q0).astype(np.int32)
        q = np.tile(q0, (k, 1))
        if siblings == "distinct":  # drawn without replacement
            for j in range(1, k):
                q[j, tokens[:j]] = 0.0
                q[j] /= q[j].sum()
        q = q.astype(np.float32)
        q_dense = q.astype(np.float64) / q.astype(np.float64).sum(1, keepdims=True)
        ratios = acceptance_ratios(ref_probs(rows), parents, tokens, q_dense)
        if all(coins_decide([r for r in ratios if r[1] == j], 0.15, 0.85, 0.05)
               for j in (1, 2)):
            break
    else:
        pytest.fail("no case found where the later siblings' coins decide")
    if kind == "dense":
        qarg = q
    else:  # every id listed: the same distribution, by the sparse path
        ids = np.tile(np.arange(V, dtype=np.int32), (k, 1))
        qarg = (ids, q)
    expected = tree_outcomes(ref_probs(rows), parents, tokens, q_dense)
    args, kw = replicate(rows, tokens, parents, qarg, B_FIXED, rng, kind=kind)
    res = call_verify(args, kw)
    check_structure(res, args[1], args[2], kw["parents"], V)
    assert_outcomes(outcome_counts(res), expected, f"{kind} {siblings} siblings")


@pytest.mark.parametrize("kind", ["none", "dense", "sparse"])
def test_zero_probability_draft_is_never_accepted(kind, rng):
    """p(x) = 0 (banned or filtered) or q(x) = 0 means rejection, whatever the coin: the
    comparison is strict and the uniform never 0 (the SGLang coin == 0 bug)."""
    V, n = 6, 200_000
    rows = rng.standard_normal((2, V)).astype(np.float32)
    rows[0, 2] = -np.inf
    ids = np.array([[2, 4, -1]], np.int32)
    vals = np.array([[0.5, 0.5, 0.0]], np.float32)
    q = np.full((1, V), 1 / V, np.float32)
    qarg = {"none": None, "dense": q, "sparse": (ids, vals)}[kind]
    args, kw = replicate(rows, [2], [-1], qarg, n, rng, kind=kind, chain=True)
    res = call_verify(args, kw)
    assert np.all(res.num_accepted == 0)
    assert np.all(res.tokens[:, 0] != 2)
    # filtered by top_k = 2 (token 2 is not banned here)
    rows[0] = [0.0, 3.0, 1.0, 2.0, -1.0, 0.5]
    args, kw = replicate(rows, [2], [-1], qarg, n, rng, kind=kind, chain=True)
    res = call_verify(args, kw, top_k=2)
    assert np.all(res.num_accepted == 0)
    assert set(np.unique(res.tokens[:, 0])) <= {1, 3}


# ---------------------------------------------------------------------------------------
# Random drafts from a toy drafter: the emitted text follows the target alone
# ---------------------------------------------------------------------------------------

STRUCTURES = {
    "chain1": [-1],
    "chain4": [-1, 0, 1, 2],
    "tree": [-1, -1, -1, 0, 0, 1, 3, 6],
    "wide4": [-1, -1, -1, -1],
}
TOY_FILTERS = {
    "no-filter": dict(),
    "filters": dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05),
}
TOY_CASES = [
    (s, k, sib)
    for s in STRUCTURES
    for k in ["none", "dense", "sparse"]
    for sib in (["distinct"] if s.startswith("chain") or k == "none" else ["iid", "distinct"])
]


def toy_params(lm, filters, batch, per_request):
    f = dict(filters)
    if "top_p" in f:
        f["top_p"], f["min_p"] = safe_params(
            lm.all_rows(), f["temperature"], f["top_k"], f["top_p"], f["min_p"]
        )
    if per_request:  # the same values as per-request arrays
        f = {
            k: np.full(batch, v, np.int32 if k == "top_k" else np.float32) for k, v in f.items()
        }
        ref = {k: v[0].item() for k, v in f.items()}
    else:
        ref = f
    return f, ref


def toy_verify(lm, parents, kind, siblings, filters, batch, rng):
    """One call of ``batch`` requests drafted by ``lm``'s drafter, under the
    TOY_FILTERS named ``filters`` (as per-request arrays): (batch, result)."""
    b = build_toy_batch(lm, batch, parents, kind=kind, siblings=siblings, rng=rng)
    f, _ = toy_params(lm, TOY_FILTERS[filters], batch, per_request=(filters == "filters"))
    res = sf.verify(
        b["logits"], b["draft_tokens"], b["num_draft"],
        draft_probs=draft_arg(b["draft_probs"]), parents=b["parents"],
        seed=rng.integers(0, 2**63, batch).astype(np.uint64),
        position=rng.integers(0, 2**40, batch), **f,
    )
    check_structure(res, b["draft_tokens"], b["num_draft"], b["parents"], lm.vocab)
    return b, res


def later_pairs(res, depth):
    """(previous token, token) of every token emitted after the first, all depths."""
    tokens, nacc = np.asarray(res.tokens), np.asarray(res.num_accepted)
    m = [nacc >= d for d in range(1, depth + 1)]
    return (np.concatenate([tokens[m[d - 1], d - 1] for d in range(1, depth + 1)]),
            np.concatenate([tokens[m[d - 1], d] for d in range(1, depth + 1)]))


@pytest.mark.parametrize("filters", list(TOY_FILTERS), ids=list(TOY_FILTERS))
@pytest.mark.parametrize(
    "structure, kind, siblings", TOY_CASES, ids=["-".join(c) for c in TOY_CASES]
)
def test_random_drafts_emit_target_text(structure, kind, siblings, filters, rng):
    vocab = 10
    lm = ToyLM(vocab, seed=7)
    parents = np.array(STRUCTURES[structure], np.int32)
    _, ref = toy_params(lm, TOY_FILTERS[filters], 1, per_request=(filters == "filters"))
    p_root, p_trans = lm.target(**ref)
    b, res = toy_verify(lm, parents, kind, siblings, filters, B_TOY, rng)
    what = f"{structure}/{kind}/{siblings}/{filters}"
    tokens, nacc = np.asarray(res.tokens), np.asarray(res.num_accepted)
    # (a) the first emitted token follows the target's row 0
    assert_samples(tokens[:, 0], p_root, f"{what}: first token")
    # (b) given the prefix, every later token follows the target's row for that prefix.
    # Depth by depth, the fewer requests that get deep see 5% of the pairs' joint
    # distribution (deterministic drafts under the filters can leave one possible
    # next token: one bin). All depths' pairs in one table see 1%: given all that came
    # before it, each later token is drawn from the row of its previous token, so the
    # table is that of transition counts (chi-square by Anderson and Goodman, 1957);
    # where one call's requests do not reach deep enough for that, more calls follow.
    depth = int(node_depths(parents).max()) + 1
    for d in range(1, depth + 1):
        m = nacc >= d
        assert_transitions(tokens[m, d - 1], tokens[m, d], p_trans, f"{what}: token {d}",
                           resolution=0.05, forced=True)
    prev, nxt = later_pairs(res, depth)
    for _ in range(4):
        counts = np.zeros(p_trans.shape)
        np.add.at(counts, (prev, nxt), 1)
        df = chi2_table(counts, p_trans)[1]
        if SCALE < 1 or detectable_tv(prev.size, df) <= RESOLUTION:
            break
        more = scaled(int(B_TOY * (tv_draws(df) / prev.size - 1) * 1.05) + 1000)
        _, extra = toy_verify(lm, parents, kind, siblings, filters, more, rng)
        prev, nxt = map(np.concatenate, zip((prev, nxt), later_pairs(extra, depth)))
    assert_transitions(prev, nxt, p_trans, f"{what}: tokens after the first, all depths")
    # (c) the first child of the root is accepted with probability sum_x min(p(x), q(x))
    first = children_of(parents, len(parents))[-1][0]
    beta = np.minimum(p_root[None], b["q_first"]).sum(axis=1).mean()
    hit = (np.asarray(res.accepted_nodes)[:, 0] == first) if len(parents) else np.zeros(0)
    assert_rate(hit.sum(), B_TOY, beta, f"{what}: acceptance of the first draft")


def test_acceptance_rate_catches_always_reject(rng):
    """With a drafter close to the target, most first drafts are accepted (a kernel that
    always rejects and samples the residual would pass (a) and (b) but not this)."""
    lm = ToyLM(10, seed=3, draft_noise=0.05)
    b = build_toy_batch(lm, 20_000, chain_parents(3), kind="dense", siblings="distinct", rng=rng)
    res = sf.verify(
        b["logits"], b["draft_tokens"], b["num_draft"], draft_probs=b["draft_probs"][1],
        seed=np.arange(20_000, dtype=np.uint64), position=0,
    )
    assert np.asarray(res.num_accepted).mean() > 2.5


# A cut of the filters found by the reservoir (top_k <= 4096), by the scan past it
# (top_k 5000 of 6000), or from the kept mass (top_p, min_p), at a temperature != 1.
_BOUND_CASES = {
    "batch": (2000, {}), "lone": (70_000, {}), "top_k": (2000, {"top_k": 500}),
    "top_k_scan": (6000, {"top_k": 5000, "temperature": 1.1}),
    "top_p": (2000, {"top_p": 0.9, "temperature": 0.9}),
    "min_p": (2000, {"min_p": 0.002, "temperature": 1.2}),
}


def rate_trials(prob, resolution=RESOLUTION):
    """The trials assert_rate needs to see an absolute error of ``resolution`` in a
    rate near ``prob`` (its normal approximation, solved for the count)."""
    z = sps.norm.isf(ALPHA / 2) + sps.norm.ppf(POWER)
    return int(np.ceil(prob * (1 - prob) * (z / resolution) ** 2))


@pytest.mark.parametrize("case", list(_BOUND_CASES))
@pytest.mark.parametrize("kind", ["none", "dense"])
def test_acceptance_decided_from_a_mass_bound_is_exact(kind, case, rng):
    """Most acceptances are decided from an upper bound on the row's mass (about
    6% loose on a flat row; split across threads for a lone request; with a
    cut of the filters) before the exact pass: the acceptance
    rate must still be min(1, p(x) / q(x)) exactly, on rows where the bound is
    loosest (a wide flat tail) and u q(x) often lands in its slack. (A bound
    taken 3% tighter than it is fails the top_p case; a reference sum's margin
    of 0.95 fails the batch and lone cases.) 8e4 to 1e5 decisions (7e4 with the
    dense q, whose rate of ~0.77 varies less) see an absolute error of 0.01 in it;
    the bonus rows, drawn from only after an acceptance, hold four finite logits
    to keep them cheap."""
    vocab, params = _BOUND_CASES[case]
    batch = 1 if case == "lone" else 8_000_000 // vocab
    row = rng.standard_normal(vocab).astype(np.float32) * 0.5
    x = 7
    row[x] = np.log(np.exp(row).sum() - np.exp(row[x])) + np.log(0.45 / 0.55)  # p(x) ~ 0.45
    if "top_p" in params or "min_p" in params:
        params = dict(params)
        params["top_p"], params["min_p"] = safe_params(
            row[None], params["temperature"], 0, params.get("top_p", 1.0), params.get("min_p", 0.0))
    p_x = ref_probs(as_f64(row[None]), **params)[0, x]
    kept = np.count_nonzero(ref_probs(as_f64(row[None]), **params)[0])
    assert params == {} or 1 < kept < vocab - 100  # the filter cuts the tail, not the row
    logits = np.tile(row, (2 * batch, 1))
    logits[1::2] = -np.inf
    logits[1::2, 100:104] = 0.0
    q = None
    want = p_x
    if kind == "dense":
        q_x = min(0.98, 1.3 * p_x)  # rejects 1 - 1 / 1.3 of the time
        q = np.full((batch, vocab), (1 - q_x) / (vocab - 1), np.float32)
        q[:, x] = q_x
        want = p_x / float(np.float32(q_x))
    calls = -(-scaled(rate_trials(want)) // batch)
    first = int(rng.integers(0, 2**62))  # each case its own uniforms
    accepted = 0
    for c in range(calls):
        res = sf.verify(logits, np.full(batch, x, np.int32), np.ones(batch, np.int32),
                        draft_probs=q, seed=np.arange(batch, dtype=np.uint64) + (first + c * batch),
                        position=3, **params)
        accepted += int(np.asarray(res.num_accepted).sum())
    assert_rate(accepted, batch * calls, want, f"acceptance ({kind} q, {case})")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("lone", [True, False], ids=["lone", "batch"])
@pytest.mark.parametrize("kind", ["none", "dense"])
def test_acceptance_near_the_bound_margin_is_the_exact_test(kind, lone, dtype, rng):
    """The first draft's acceptance is decided from a bound of the row's mass when the
    bound allows (formed in the max pass from the draft's own logit; split across
    threads for a lone request), else from the exact mass; either way it must be
    u q(x) < p(x). Each row is built so that p(x) lies a relative 1e-5 to 1e-2 above
    or below u q(x), inside and around the bound's 1e-3 slack, and every decision is
    checked against u (Philox, from its definition) and p(x) in float64."""
    vocab, n = 40_003, 96  # odd: each pass ends on a partial chunk
    seeds = rng.integers(0, 2**63, n).astype(np.uint64)
    positions = rng.integers(0, 2**40, n).astype(np.int64)
    rows = to_dtype(rng.standard_normal((2 * n, vocab)).astype(np.float32) * 2.0, dtype)
    x = rng.integers(0, vocab, n)
    qx = 0.6 if kind == "dense" else 1.0
    rel = rng.choice([1e-5, 1e-4, 5e-4, 1e-3, 2e-3, 1e-2], n) * rng.choice([-1, 1], n)
    want = np.zeros(n, bool)
    keep = np.zeros(n, bool)
    for i in range(n):
        u = accept_uniform(int(seeds[i]), int(positions[i]))
        row = as_f64(rows[2 * i])
        rest = np.exp(np.delete(row, x[i]) - row.max())
        target = u * qx * (1 + rel[i])  # p(x) to aim at
        if not 1e-4 < target < 0.999:
            continue
        rows[2 * i, x[i]] = to_dtype(np.array([row.max() + np.log(target / (1 - target) * rest.sum())],
                                              np.float32), dtype)[0]
        p = as_f64(rows[2 * i][None])[0]
        p = np.exp(p - p.max())
        p_x = p[x[i]] / p.sum()
        if abs(u * qx - p_x) < 3e-6 * p_x:  # too close for float32 logits to say
            continue
        want[i], keep[i] = u * qx < p_x, True
    check_first_decisions(rows, x, qx, seeds, positions, lone, want, keep)


def check_first_decisions(rows, x, qx, seeds, positions, lone, want, keep, top_p=None):
    """Request i (target rows 2i and 2i + 1, one draft x[i]; a dense q of qx at x[i]
    where qx < 1) accepts its draft exactly where want[i], among the requests
    `keep` marks: the requests in one call, or (lone) one call each."""
    n, vocab = x.shape[0], rows.shape[1]
    q = None
    if qx < 1.0:
        q = np.full((n, vocab), (1 - qx) / (vocab - 1), np.float32)
        q[np.arange(n), x] = qx
    tokens = x.astype(np.int32)
    tp = np.ones(n, np.float32) if top_p is None else np.asarray(top_p, np.float32)
    if lone:
        got = np.array([sf.verify(rows[2 * i:2 * i + 2], tokens[i:i + 1], np.ones(1, np.int32),
                                  draft_probs=None if q is None else q[i:i + 1],
                                  seed=seeds[i:i + 1], position=positions[i:i + 1],
                                  top_p=tp[i]).num_accepted[0] for i in range(n)])
    else:
        got = sf.verify(rows, tokens, np.ones(n, np.int32), draft_probs=q, seed=seeds,
                        position=positions, top_p=tp).num_accepted
    assert keep.sum() > n // 2
    np.testing.assert_array_equal(np.asarray(got)[keep] == 1, want[keep])
    assert 0 < want[keep].sum() < keep.sum()


@pytest.mark.parametrize("lone", [True, False], ids=["lone", "batch"])
@pytest.mark.parametrize("kind", ["none", "dense"])
def test_acceptance_under_top_p_alone_is_the_exact_test(kind, lone, rng):
    """Under top_p alone the first draft's acceptance is decided from the mass the
    cut keeps, which the search for the cut sums exactly (no pass of its own): it
    must still be u q(x) < p(x), p over the kept tokens. Each row's x is set so that
    p(x) lies a relative 1e-5 to 1e-2 above or below u q(x) (with the cut moving as
    x does), and every decision is checked against u and p(x) in float64."""
    vocab, n = 40_003, 48
    seeds = rng.integers(0, 2**63, n).astype(np.uint64)
    positions = rng.integers(0, 2**40, n).astype(np.int64)
    rows = (rng.standard_normal((2 * n, vocab)) * 2.0).astype(np.float32)
    x = rng.integers(0, vocab, n)
    qx = 0.6 if kind == "dense" else 1.0
    rel = rng.choice([1e-5, 1e-4, 5e-4, 1e-3, 2e-3, 1e-2], n) * rng.choice([-1, 1], n)
    top_p = np.full(n, 0.9)
    want = np.zeros(n, bool)
    keep = np.zeros(n, bool)
    for i in range(n):
        u = accept_uniform(int(seeds[i]), int(positions[i]))
        target = u * qx * (1 + rel[i])  # p(x) to aim at
        if not 1e-3 < target < 0.8:
            continue
        row = rows[2 * i]
        for _ in range(4):  # x's own mass moves the cut: aim again from the kept set
            top_p[i] = safe_top_p(row, 1.0, 0, 0.9)
            p = ref_probs_row(row, top_p=top_p[i])
            e = np.exp(as_f64(row) - as_f64(row).max())
            rest = e[p > 0].sum() - e[x[i]] * (p[x[i]] > 0)
            row[x[i]] = np.float32(row.max() + np.log(target / (1 - target) * rest))
        top_p[i] = safe_top_p(row, 1.0, 0, 0.9)
        p_x = ref_probs_row(row, top_p=top_p[i])[x[i]]
        if not p_x > 0 or abs(u * qx - p_x) < 3e-6 * p_x:  # too close for float32 to say
            continue
        want[i], keep[i] = u * qx < p_x, True
    check_first_decisions(rows, x, qx, seeds, positions, lone, want, keep, top_p)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bound_from_the_draft_logit_at_a_tiny_temperature(dtype):
    """At T = 1e-33 a logit gap of 1e-32 is a factor e^10: p(x) = 1 / (1 + e^10). The
    bound formed from the draft's logit must not lose the term of the token above it
    when c = log2(e) / T is too large to scale (a capped factor once shrank it, and
    drafts were accepted 41% of the time)."""
    n, vocab = 20_000, 64
    row = np.full(vocab, -np.inf, np.float32)
    row[5], row[9] = 0.0, 1e-32
    logits = to_dtype(np.tile(row, (2 * n, 1)), dtype)
    p_x = as_f64(logits[:1])[0]
    p_x = 1.0 / (1.0 + np.exp((p_x[9] - p_x[5]) / 1e-33))
    res = sf.verify(logits, np.full(n, 5, np.int32), np.ones(n, np.int32), temperature=1e-33,
                    seed=np.arange(n, dtype=np.uint64), position=7)
    assert_rate(int(np.asarray(res.num_accepted).sum()), n, p_x, "acceptance at T = 1e-33")


# ---------------------------------------------------------------------------------------
# Keys: the bonus token is sample()'s token at the same (seed, position)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [12, 32000], ids=lambda v: f"V={v}")
@pytest.mark.parametrize("kind", ["none", "dense", "sparse"])
@pytest.mark.parametrize("layout", ["chain", "tree"])
def test_bonus_token_equals_sample(layout, kind, vocab, rng):
    """All drafts accepted (their target probability is 1) -> the bonus token is
    sample(row of the last accepted node, seed, position + depth, method="rejection")."""
    V, B = vocab, (3000 if vocab < 1000 else 40)
    reqs = []
    for b in range(B):
        nd = int(rng.integers(0, 5))
        logits = (rng.standard_normal((nd + 1, V)) * 1.5).astype(np.float32)
        if layout == "chain":
            parents = chain_parents(nd)
            path = list(range(nd))
        else:  # the path is 0 -> 2 -> 3 -> ...; node 1, a sibling of 0, is never tried
            parents = np.array([-1, -1, 0] + list(range(2, nd - 1)), np.int32)[:nd]
            path = [0] + list(range(2, nd)) if nd else []
        tokens = rng.integers(0, V, nd).astype(np.int32)
        for i in path:  # force acceptance along the path
            row = parents[i] + 1
            logits[row] = -np.inf
            logits[row, tokens[i]] = 0.0
        q = one_hot(tokens, V).astype(np.float32)
        reqs.append(
            dict(
                logits=logits, tokens=tokens, parents=parents, dense=q,
                sparse_ids=np.stack([tokens, np.full(nd, -1)], 1).astype(np.int32),
                sparse_vals=np.stack([np.ones(nd), np.zeros(nd)], 1).astype(np.float32),
                temperature=float(rng.choice([0.7, 1.0, 1.3])), top_k=int(rng.choice([0, 5])),
                top_p=float(rng.choice([1.0, 0.9])), min_p=0.0,
                seed=int(rng.integers(0, 2**63)), position=int(rng.integers(0, 2**40)),
                path=path,
            )
        )
    args, kw = pack(reqs, kind, with_parents=(layout == "tree"))
    res = call_verify(args, kw)
    check_structure(res, args[1], args[2], kw["parents"], V)
    depth = np.array([len(r["path"]) for r in reqs])
    np.testing.assert_array_equal(res.num_accepted, depth)
    row_off, _ = request_slices(args[2])
    last_row = np.array([r["path"][-1] + 1 if r["path"] else 0 for r in reqs]) + row_off
    want = sf.sample(
        args[0][last_row], temperature=kw["temperature"], top_k=kw["top_k"], top_p=kw["top_p"],
        min_p=kw["min_p"], seed=kw["seed"], position=kw["position"] + depth, method="rejection",
    )
    np.testing.assert_array_equal(np.asarray(res.tokens)[np.arange(B), depth], want)


# ---------------------------------------------------------------------------------------
# Coupled verification
# ---------------------------------------------------------------------------------------


def row_positions(num_draft, parents, position):
    """Absolute position predicted by every logits row of a batch (row 0: position)."""
    out = []
    _, node_off = request_slices(num_draft)
    for b, nd in enumerate(num_draft):
        par = parents[node_off[b] : node_off[b] + nd] if parents is not None else chain_parents(nd)
        out.append(position[b] + np.concatenate([[0], node_depths(par) + 1]))
    return np.concatenate(out)


@pytest.mark.parametrize("vocab", [6, 32000], ids=lambda v: f"V={v}")
@pytest.mark.parametrize("kind", ["none", "dense", "sparse"])
def test_coupled_equals_sample_walk(kind, vocab, rng):
    """Coupled verify emits, at depth i, sample(row reached, seed, position + i, "coupled"),
    accepting a child iff its token equals that sample (siblings in order)."""
    V, B = vocab, (2000 if vocab < 1000 else 40)
    reqs = [random_request(rng, V, 7, tree=bool(i % 2)) for i in range(B)]
    args, kw = pack(reqs, kind)
    nd = args[2]
    rep = np.repeat(np.arange(B), nd + 1)
    row_tok = sf.sample(
        args[0], temperature=kw["temperature"][rep], top_k=kw["top_k"][rep],
        top_p=kw["top_p"][rep], min_p=kw["min_p"][rep], seed=kw["seed"][rep],
        position=row_positions(nd, kw["parents"], kw["position"]), method="coupled",
    )
    # Redraw the drafts so that most match the target's coupled token of their parent row.
    row_off, node_off = request_slices(nd)
    drafts = args[1].copy()
    for b in range(B):
        for i in range(nd[b]):
            par = kw["parents"][node_off[b] + i]
            if rng.random() < 0.7:
                drafts[node_off[b] + i] = row_tok[row_off[b] + par + 1]
    res = call_verify((args[0], drafts, nd), kw, method="coupled")
    check_structure(res, drafts, nd, kw["parents"], V)
    tokens = np.asarray(res.tokens)
    nodes = np.asarray(res.accepted_nodes)
    for b in range(B):
        par = kw["parents"][node_off[b] : node_off[b] + nd[b]]
        emitted, path = simulate_coupled(
            row_tok[row_off[b] : row_off[b] + nd[b] + 1],
            par,
            drafts[node_off[b] : node_off[b] + nd[b]],
        )
        a = len(path)
        assert res.num_accepted[b] == a, f"request {b}: accepted {res.num_accepted[b]}, want {a}"
        assert tokens[b, : a + 1].tolist() == emitted, f"request {b}"
        assert nodes[b, :a].tolist() == path, f"request {b}"


def test_coupled_ignores_draft_probs(rng):
    V, B = 8, 500
    reqs = [random_request(rng, V, 6, tree=True) for _ in range(B)]
    outs = []
    for kind in ["none", "dense", "sparse"]:
        args, kw = pack(reqs, kind)
        outs.append(call_verify(args, kw, method="coupled"))
    for o in outs[1:]:
        np.testing.assert_array_equal(o.tokens, outs[0].tokens)
        np.testing.assert_array_equal(o.accepted_nodes, outs[0].accepted_nodes)


def target_text(lm, seeds, pos, length, method="coupled", **params):
    """The text the target alone samples (coupled: the same noise as verify)."""
    B = len(seeds)
    y = np.zeros((B, length), np.int64)
    row = np.broadcast_to(lm.root_logits, (B, lm.vocab))
    for d in range(length):
        y[:, d] = sf.sample(
            np.ascontiguousarray(row), seed=seeds, position=pos + d, method=method, **params
        )
        row = lm.trans_logits[y[:, d]]
    return y


def expected_walk(y, parents, drafts_b):
    """Accepted path when the target's text is y (coupled or greedy)."""
    ch = children_of(parents, len(parents))
    node, path = -1, []
    for d in range(len(y)):
        nxt = next((c for c in ch[node] if int(drafts_b[c]) == int(y[d])), None)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    return path


DRAFTERS = ["chain4-dense", "chain2-none", "tree-sparse", "perfect4", "none0", "chain6-dense"]


@pytest.mark.parametrize("filters", ["no-filter", "filters"])
def test_coupled_drafter_invariance(filters, rng):
    """Whatever the drafter (kind, length, tree, perfect, none), coupled verification emits
    a prefix of the one text the target alone samples with the same seed and positions."""
    lm = ToyLM(10, seed=11)
    B = 20_000
    f, ref = toy_params(lm, TOY_FILTERS[filters], B, per_request=False)
    seeds = rng.integers(0, 2**63, B).astype(np.uint64)
    pos = rng.integers(0, 2**40, B)
    y = target_text(lm, seeds, pos, 8, **f)
    for drafter in DRAFTERS:
        if drafter == "perfect4":
            drafts = y[:, :4].astype(np.int32)
            parents = chain_parents(4)
            logits = np.concatenate(
                [lm.root_logits[None].repeat(B, 0)[:, None], lm.trans_logits[drafts]], axis=1
            ).reshape(-1, lm.vocab)
            args = (logits, drafts.reshape(-1), np.full(B, 4, np.int32))
            dp, par_arg = None, None
        elif drafter == "none0":
            root = np.repeat(lm.root_logits[None], B, 0)
            args = (root, np.zeros(0, np.int32), np.zeros(B, np.int32))
            dp, par_arg, parents = None, None, np.zeros(0, np.int32)
        else:
            shape, kind = drafter.split("-")
            parents = (
                chain_parents(int(shape[5:])) if shape.startswith("chain")
                else np.array(STRUCTURES["tree"], np.int32)
            )
            b = build_toy_batch(lm, B, parents, kind=kind, siblings="distinct", rng=rng)
            args = (b["logits"], b["draft_tokens"], b["num_draft"])
            dp, par_arg = draft_arg(b["draft_probs"]), b["parents"]
        res = sf.verify(*args, draft_probs=dp, parents=par_arg, seed=seeds, position=pos,
                        method="coupled", **f)
        tokens, nacc = np.asarray(res.tokens), np.asarray(res.num_accepted)
        n = len(parents)
        dr = np.asarray(args[1]).reshape(B, n) if n else np.zeros((B, 0), np.int32)
        for i in range(B):
            a = int(nacc[i])
            assert tokens[i, : a + 1].tolist() == y[i, : a + 1].tolist(), (
                f"{drafter}, request {i}: emitted {tokens[i, :a + 1]}, target text {y[i]}"
            )
            if i < 2000:
                want = expected_walk(y[i], parents, dr[i])
                assert np.asarray(res.accepted_nodes)[i, :a].tolist() == want, f"{drafter} {i}"
        if drafter == "perfect4":
            assert np.all(nacc == 4)


# ---------------------------------------------------------------------------------------
# Greedy (temperature 0): both methods accept a draft iff it is the argmax
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["none", "dense", "sparse"])
@pytest.mark.parametrize("method", ["rejection", "coupled"])
def test_greedy_is_exact_argmax_chain(method, kind, rng):
    lm = ToyLM(12, seed=5)
    B = 5000
    b = build_toy_batch(lm, B, chain_parents(5), kind=kind, siblings="distinct", rng=rng)
    # greedy text: argmax chain (ties: lower id)
    g = np.zeros((B, 6), np.int64)
    g[:, 0] = np.argmax(lm.root_logits)
    for d in range(1, 6):
        g[:, d] = np.argmax(lm.trans_logits[g[:, d - 1]], axis=1)
    drafts = b["tokens"]
    # make half the drafts the greedy token so that long acceptances happen
    use = rng.random((B, 5)) < 0.6
    drafts = np.where(use, g[:, :5], drafts).astype(np.int32)
    logits = np.concatenate(
        [np.repeat(lm.root_logits[None, None], B, 0), lm.trans_logits[drafts]], axis=1
    ).reshape(-1, lm.vocab)
    dp = b["draft_probs"]
    if kind == "dense":  # the drafts changed: give q some mass on them
        q = dp[1].astype(np.float64) + one_hot(drafts.reshape(-1), lm.vocab) * 0.3
        dp = ("dense", (q / q.sum(1, keepdims=True)).astype(np.float32))
    if kind == "sparse":
        ids, vals = dp[1].copy(), dp[2].copy()
        ids[:, 0] = drafts.reshape(-1)
        ids[:, 1:] = np.where(ids[:, 1:] == ids[:, :1], -1, ids[:, 1:])
        vals = np.where(ids >= 0, 1.0, 0.0)
        vals = (vals / vals.sum(1, keepdims=True)).astype(np.float32)
        dp = ("sparse", ids, vals)
    res = sf.verify(
        logits, drafts.reshape(-1), np.full(B, 5, np.int32), draft_probs=draft_arg(dp),
        temperature=0.0, seed=np.arange(B, dtype=np.uint64), position=7, method=method,
    )
    match = drafts == g[:, :5]
    want_a = np.where(match.all(1), 5, np.argmin(match, axis=1))
    np.testing.assert_array_equal(res.num_accepted, want_a)
    tokens = np.asarray(res.tokens)
    for a in range(6):
        m = want_a == a
        np.testing.assert_array_equal(tokens[m, : a + 1], g[m, : a + 1])


# ---------------------------------------------------------------------------------------
# Layout, keys and invariance
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["rejection", "coupled"])
@pytest.mark.parametrize("kind", ["none", "dense", "sparse"])
def test_explicit_chain_parents_equal_none(kind, method, rng):
    reqs = [random_request(rng, 9, 6, tree=False) for _ in range(1000)]
    args, kw = pack(reqs, kind, with_parents=True)
    a = call_verify(args, kw, method=method)
    b = call_verify(args, kw, method=method, parents=None)
    for f in ("tokens", "num_accepted", "accepted_nodes"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)


def per_request(res, nd):
    t, a, n = np.asarray(res.tokens), np.asarray(res.num_accepted), np.asarray(res.accepted_nodes)
    return [
        (t[b, : nd[b] + 1].tolist(), int(a[b]), n[b, : nd[b]].tolist()) for b in range(len(nd))
    ]


@pytest.mark.parametrize("method", ["rejection", "coupled"])
@pytest.mark.parametrize("kind", ["none", "dense", "sparse"])
def test_batch_invariance(kind, method, rng):
    """A request's result does not depend on the other requests or their order."""
    reqs = [random_request(rng, 13, 6, tree=bool(i % 3)) for i in range(400)]
    args, kw = pack(reqs, kind)
    full = per_request(call_verify(args, kw, method=method), args[2])
    check_structure(call_verify(args, kw, method=method), args[1], args[2], kw["parents"], 13)
    perm = rng.permutation(len(reqs))
    args2, kw2 = pack([reqs[i] for i in perm], kind)
    shuffled = per_request(call_verify(args2, kw2, method=method), args2[2])
    for j, i in enumerate(perm):
        assert shuffled[j] == full[i], f"request {i} changed when the batch was shuffled"
    sub = [i for i in range(len(reqs)) if i % 7 == 3]
    args3, kw3 = pack([reqs[i] for i in sub], kind)
    part = per_request(call_verify(args3, kw3, method=method), args3[2])
    for j, i in enumerate(sub):
        assert part[j] == full[i], f"request {i} changed in a smaller batch"
    for i in [0, 1, 2, 57, 399]:
        args4, kw4 = pack([reqs[i]], kind)
        one = per_request(call_verify(args4, kw4, method=method), args4[2])
        assert one[0] == full[i], f"request {i} alone differs"


@pytest.mark.parametrize("method", ["rejection", "coupled"])
def test_reproducible_and_keyed_by_seed_and_position(method, rng):
    reqs = [random_request(rng, 16, 5, tree=True) for _ in range(2000)]
    for r in reqs:
        r["temperature"] = 1.0
    args, kw = pack(reqs, "dense")
    a = per_request(call_verify(args, kw, method=method), args[2])
    assert a == per_request(call_verify(args, kw, method=method), args[2])
    b = per_request(call_verify(args, kw, method=method, seed=kw["seed"] + np.uint64(1)), args[2])
    c = per_request(call_verify(args, kw, method=method, position=kw["position"] + 1), args[2])
    assert sum(x != y for x, y in zip(a, b)) > 400
    assert sum(x != y for x, y in zip(a, c)) > 400


def test_scalar_parameters_broadcast(rng):
    reqs = [random_request(rng, 11, 5, tree=True) for _ in range(300)]
    args, kw = pack(reqs, "dense")
    B = len(reqs)
    scalar = dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.02, seed=99, position=1000)
    arrays = dict(
        temperature=np.full(B, 0.8, np.float32), top_k=np.full(B, 6, np.int32),
        top_p=np.full(B, 0.9, np.float32), min_p=np.full(B, 0.02, np.float32),
        seed=np.full(B, 99, np.uint64), position=np.full(B, 1000, np.int64),
    )
    for method in ["rejection", "coupled"]:
        a = call_verify(args, kw, method=method, **scalar)
        b = call_verify(args, kw, method=method, **arrays)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.accepted_nodes, b.accepted_nodes)


@pytest.mark.parametrize("method", ["rejection", "coupled"])
def test_long_chain_and_wide_tree(method, rng):
    """A chain of 300 drafts that must all be accepted, and a root with 200 siblings of
    which only the last has target probability (the residual is carried 199 times)."""
    V, n = 50, 300
    tokens = rng.integers(0, V, n).astype(np.int32)
    logits = np.full((n + 1, V), -np.inf, np.float32)
    logits[np.arange(n), tokens] = 0.0
    logits[n] = rng.standard_normal(V)
    res = sf.verify(logits, tokens, np.array([n], np.int32), seed=4, position=9, method=method)
    assert res.num_accepted[0] == n
    np.testing.assert_array_equal(res.tokens[0, :n], tokens)
    np.testing.assert_array_equal(res.accepted_nodes[0], np.arange(n))
    want = sf.sample(logits[n:], seed=4, position=9 + n, method=method)
    assert res.tokens[0, n] == want[0]

    m = 200
    V = 256
    sib = rng.permutation(V)[:m].astype(np.int32)
    logits = np.zeros((m + 1, V), np.float32)
    logits[0, sib[:-1]] = -np.inf  # only the last sibling's token and non-drafted ones
    res = sf.verify(logits, sib, np.array([m], np.int32), parents=np.full(m, -1, np.int32),
                    seed=4, position=9, method=method)
    p = ref_probs_row(logits[0])
    a = int(res.num_accepted[0])
    if a:
        assert res.accepted_nodes[0, 0] == m - 1 and res.tokens[0, 0] == sib[-1]
    else:
        assert p[res.tokens[0, 0]] > 0 and res.tokens[0, 0] not in sib[:-1]
    # Over many seeds (12 siblings, to keep the rows small) the last sibling is accepted
    # with probability p(its token), and the first token follows p.
    m, V, B = 12, 32, scaled(200_000)
    sib = rng.permutation(V)[:m].astype(np.int32)
    logits = np.zeros((m + 1, V), np.float32)
    logits[0, sib[:-1]] = -np.inf
    p = ref_probs_row(logits[0])
    r = sf.verify(np.tile(logits, (B, 1)), np.tile(sib, B), np.full(B, m, np.int32),
                  parents=np.full(B * m, -1, np.int32),
                  seed=np.arange(B, dtype=np.uint64), position=9, method=method)
    hit = (np.asarray(r.accepted_nodes)[:, 0] == m - 1).sum()
    if method == "rejection":
        assert_rate(hit, B, p[sib[-1]], "last of 12 siblings")
    first = np.asarray(r.tokens)[:, 0]
    assert_samples(first, p, f"first token, 12 siblings ({method})")


def test_result_layout_with_zero_drafts(rng):
    V = 7
    logits = rng.standard_normal((3, V)).astype(np.float32)
    res = sf.verify(logits, np.zeros(0, np.int32), np.zeros(3, np.int32), seed=1)
    assert res.tokens.shape == (3, 1) and res.num_accepted.tolist() == [0, 0, 0]
    assert np.asarray(res.accepted_nodes).shape == (3, 0)
    assert res.tokens.dtype == np.int32
    # mixed: request 1 has two drafts, the others none
    logits = rng.standard_normal((5, V)).astype(np.float32)
    res = sf.verify(logits, np.array([1, 2], np.int32), np.array([0, 2, 0], np.int32), seed=1)
    check_structure(res, [1, 2], [0, 2, 0], None, V)
    assert res.tokens.shape == (3, 3) and res.accepted_nodes.shape == (3, 2)
    assert res.tokens[0, 1] == -1 and res.tokens[2, 1] == -1


def test_sparse_probs_dense_rows():
    q = sf.SparseProbs(np.array([[4, -1, 0], [2, 1, 3]]),
                       np.array([[0.75, 0, 0.25], [0.5, 0.25, 0.25]]))
    np.testing.assert_array_equal(q.dense(5), np.array([[0.25, 0, 0, 0, 0.75],
                                                        [0, 0.25, 0.5, 0.25, 0]], np.float32))
    assert q.dense(5).dtype == np.float32
    with pytest.raises(ValueError, match=r"unused slot \(id -1\) holds a nonzero"):
        sf.SparseProbs(np.array([[-1, 2]]), np.array([[0.5, 0.5]])).dense(4)  # verify refuses it


def test_default_method_is_rejection(rng):
    reqs = [random_request(rng, 9, 4, tree=True) for _ in range(300)]
    args, kw = pack(reqs, "dense")
    a = call_verify(args, kw)
    b = call_verify(args, kw, method="rejection")
    np.testing.assert_array_equal(a.tokens, b.tokens)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_lower_precision_logits_match_float32_of_same_values(dtype, rng):
    """Logits in float16/bfloat16 give what float32 logits of the same values give
    (the conversion is exact, and the random streams do not depend on the dtype)."""
    reqs = [random_request(rng, 11, 5, tree=True) for _ in range(500)]
    args, kw = pack(reqs, "dense")
    low = to_dtype(args[0], dtype)
    same = as_f64(low).astype(np.float32)
    for method in ["rejection", "coupled"]:
        a = call_verify((low,) + args[1:], kw, method=method)
        b = call_verify((same,) + args[1:], kw, method=method)
        np.testing.assert_array_equal(a.tokens, b.tokens, err_msg=method)
        np.testing.assert_array_equal(a.accepted_nodes, b.accepted_nodes, err_msg=method)


def test_strided_logits_view(rng):
    reqs = [random_request(rng, 9, 4, tree=True) for _ in range(200)]
    args, kw = pack(reqs, "dense")
    wide = np.zeros((args[0].shape[0], 20), np.float32)
    wide[:, 5:14] = args[0]
    a = call_verify((wide[:, 5:14],) + args[1:], kw)
    b = call_verify(args, kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)
