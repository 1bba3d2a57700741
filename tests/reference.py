"""Obviously-correct float64 numpy references for specfast.

Nothing here is fast and nothing here is clever: every function follows the text of
ALGORITHMS.md line by line, sorts where sorting is the plainest way, and loops in Python
where that is clearer than vectorising. The tests compare the C core against these.

- ``ref_probs_row`` / ``ref_probs``: the target distribution (temperature, top_k, top_p,
  min_p) of one row / of every row.
- ``safe_top_p`` / ``safe_min_p``: move a filter threshold, when needed, off the edge of a
  decision so that errors of ~1e-5 in the probabilities cannot change which tokens survive
  (the reference and the kernel would otherwise legitimately disagree at the boundary).
- ``tree_outcomes``: the exact distribution of verify's outcome (the accepted path and the
  final emitted token) for fixed drafts under recursive rejection sampling.
- ``ToyLM``: a target and a drafter whose next-token distributions depend only on the last
  token, so the exact distribution of the emitted text is known for random drafts.
"""

from __future__ import annotations

import numpy as np

try:  # numpy arrays of bfloat16 come from ml_dtypes
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    ml_dtypes = None
    BF16 = None


def as_f64(a) -> np.ndarray:
    """Exact float64 values of float32 / float16 / bfloat16 (numpy or torch) input."""
    if hasattr(a, "detach"):  # torch
        import torch

        a = a.detach().cpu()
        if a.dtype == torch.bfloat16:
            a = a.float()
        a = a.numpy()
    a = np.asarray(a)
    if BF16 is not None and a.dtype == BF16:
        a = a.astype(np.float32)
    return a.astype(np.float64)


def to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> a numpy array of ``dtype`` ("float32", "float16", "bfloat16")."""
    if dtype == "float32":
        return np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "float16":
        return np.ascontiguousarray(x, dtype=np.float16)
    if dtype == "bfloat16":
        if BF16 is None:
            import pytest

            pytest.skip("numpy bfloat16 needs ml_dtypes")
        return np.ascontiguousarray(np.asarray(x, np.float32).astype(BF16))
    raise ValueError(dtype)


def order_of(x: np.ndarray) -> np.ndarray:
    """Token ids by probability descending (= logit descending), ties: lower id first."""
    x = as_f64(x)
    return np.lexsort((np.arange(x.size), -x))


def ref_probs_row(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The target distribution of one row, in float64, exactly as ALGORITHMS.md says."""
    x = as_f64(logits).reshape(-1)
    vocab = x.size
    if temperature == 0:  # greedy: argmax, lowest id on ties (np.argmax takes the first)
        p = np.zeros(vocab)
        p[int(np.argmax(x))] = 1.0
        return p
    order = order_of(x)
    m = x.max()
    assert np.isfinite(m), "reference needs a row with a finite logit"
    p = np.exp((x - m) / temperature)  # exp(-inf) = 0: banned tokens
    p /= p.sum()
    if 0 < top_k < vocab:
        p[order[top_k:]] = 0.0
        p /= p.sum()
    if top_p < 1.0:
        cs = np.cumsum(p[order])
        keep = min(int(np.searchsorted(cs, top_p, side="left")) + 1, vocab)
        p[order[keep:]] = 0.0
        p /= p.sum()
    if min_p > 0.0:
        p[p < min_p * p.max()] = 0.0
        p /= p.sum()
    return p


def _per_row(value, rows):
    a = np.asarray(value)
    if a.ndim == 0:
        return [a.item()] * rows
    assert a.shape == (rows,)
    return [v.item() for v in a]


def ref_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """``ref_probs_row`` for every row of (rows, vocab) logits; parameters scalar or per row."""
    x = as_f64(logits)
    rows = x.shape[0]
    ts, ks, ps, ms = (_per_row(v, rows) for v in (temperature, top_k, top_p, min_p))
    return np.stack([ref_probs_row(x[r], ts[r], ks[r], ps[r], ms[r]) for r in range(rows)])


# ---------------------------------------------------------------------------------------
# Thresholds away from the decision edges
# ---------------------------------------------------------------------------------------

# Absolute margin kept between top_p and every cumulative mass: the kernel's probabilities
# carry ~1e-5 relative error (the contract), so a prefix mass m moves by at most ~1e-5 * m
# (and far less when the errors are unbiased); 1.5e-5 leaves room for that.
TOP_P_MARGIN = 1.5e-5
# Relative margin kept between min_p * max(p) and every probability (same reasoning).
MIN_P_MARGIN = 1e-3


def _top_p_conflicts(cs: np.ndarray, top_p: float) -> bool:
    return bool(np.any(np.abs(cs - top_p) <= TOP_P_MARGIN))


def safe_top_p(rows, temperature, top_k, top_p) -> float:
    """A top_p near ``top_p`` that no row's cumulative mass comes within TOP_P_MARGIN of.

    ``rows`` is one row or a (rows, vocab) stack that will all share the parameter.
    Returns ``top_p`` itself when it is already safe.
    """
    if top_p >= 1.0 or temperature == 0:
        return top_p
    x = np.atleast_2d(as_f64(rows))
    css = []
    for r in x:
        p = ref_probs_row(r, temperature, top_k)
        css.append(np.concatenate([[0.0], np.cumsum(p[order_of(r)])]))
    allc = np.concatenate(css)
    if not _top_p_conflicts(allc, top_p):
        return top_p
    # Candidates: midpoints between neighbouring distinct cumulative masses of all rows.
    pts = np.unique(np.concatenate([allc, [1.0]]))
    mids = (pts[:-1] + pts[1:]) / 2
    width = pts[1:] - pts[:-1]
    ok = (width > 2 * TOP_P_MARGIN) & (mids > 0) & (mids < 1)
    assert ok.any(), "no safe top_p exists for these rows: make the logits less flat"
    cand = mids[ok]
    return float(cand[np.argmin(np.abs(cand - top_p))])


def safe_min_p(rows, temperature, top_k, top_p, min_p) -> float:
    """A min_p near ``min_p`` whose threshold min_p * max(p) no probability comes near.

    Probabilities exactly equal to the row maximum (tied logits) are not a conflict: the
    kernel computes them bit-identically to the maximum.
    """
    if min_p <= 0.0 or temperature == 0:
        return min_p
    x = np.atleast_2d(as_f64(rows))
    ratios = []
    for r in x:
        p = ref_probs_row(r, temperature, top_k, top_p)
        q = p[p > 0] / p.max()
        ratios.append(q[q < 1.0])
    rat = np.concatenate(ratios + [np.array([1.0])])

    def conflicts(mp):
        return np.any(np.abs(np.log(rat[rat < 1.0]) - np.log(mp)) <= np.log1p(MIN_P_MARGIN))

    if not conflicts(min_p):
        return min_p
    pts = np.unique(np.log(rat))  # ascending, last is 0
    mids = (pts[:-1] + pts[1:]) / 2
    ok = (pts[1:] - pts[:-1]) > 2 * np.log1p(MIN_P_MARGIN)
    assert ok.any(), "no safe min_p exists for these rows"
    cand = np.exp(mids[ok])
    return float(cand[np.argmin(np.abs(np.log(cand) - np.log(min_p)))])


def safe_params(rows, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """(top_p, min_p) adjusted to be safe for every row in ``rows``."""
    tp = safe_top_p(rows, temperature, top_k, top_p)
    mp = safe_min_p(rows, temperature, top_k, tp, min_p)
    return tp, mp


# ---------------------------------------------------------------------------------------
# Exact outcome distribution of recursive rejection sampling for fixed drafts
# ---------------------------------------------------------------------------------------


def philox4x32_10(seed, position, purpose, index):
    """Philox4x32-10 of the counter (position lo, position hi, purpose, index) under the
    key (seed lo, seed hi), written from the paper's definition (Salmon et al., SC'11)."""
    m = 0xFFFFFFFF
    k0, k1 = seed & m, seed >> 32
    c = [position & m, (position >> 32) & m, purpose, index]
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & m, (p0 >> 32) ^ c[3] ^ k1, p0 & m]
        k0, k1 = (k0 + 0x9E3779B9) & m, (k1 + 0xBB67AE85) & m
    return c


def accept_uniform(seed, position, index=0):
    """The uniform of the acceptance test of the index-th child at (seed, position):
    53 bits of Philox (purpose ACCEPT = 1), in (0, 1]."""
    w = philox4x32_10(seed, position % 2**64, 1, index)
    return ((((w[0] >> 5) << 26) | (w[1] >> 6)) + 1) / 2.0**53


def children_of(parents, n):
    """{parent: [children in node order]} with -1 for row 0."""
    ch = {i: [] for i in range(-1, n)}
    for i in range(n):
        ch[int(parents[i])].append(i)
    return ch


def chain_parents(n):
    return np.arange(-1, n - 1, dtype=np.int32)


def tree_outcomes(p_rows, parents, tokens, q_rows) -> dict:
    """Exact distribution of (accepted path, final token) for one request, fixed drafts.

    p_rows: (n + 1, V) target distributions (row 0, then the row after node i).
    parents: (n,) local parent indices (-1 = child of row 0).
    tokens: (n,) draft tokens.  q_rows: (n, V) the distribution each token was drawn
    from (one-hot for deterministic drafts).
    Returns {(tuple_of_nodes, token): probability}.
    """
    n = len(tokens)
    ch = children_of(parents, n)
    out: dict = {}

    def walk(node, path, prob):
        pp = np.array(p_rows[node + 1], dtype=np.float64)
        reach = prob
        for c in ch[node]:
            x = int(tokens[c])
            qc = np.asarray(q_rows[c], dtype=np.float64)
            a = 0.0 if qc[x] <= 0 else min(1.0, pp[x] / qc[x])
            if a > 0:
                walk(c, path + (c,), reach * a)
            reach *= 1.0 - a
            if reach <= 1e-15:
                return
            r = np.maximum(pp - qc, 0.0)
            s = r.sum()
            assert s > 1e-12, "residual vanished although rejection had positive probability"
            pp = r / s
        for y in np.nonzero(pp > 0)[0]:
            key = (path, int(y))
            out[key] = out.get(key, 0.0) + reach * pp[y]

    walk(-1, (), 1.0)
    total = sum(out.values())
    assert abs(total - 1.0) < 1e-9, total
    return out


def acceptance_ratios(p_rows, parents, tokens, q_rows) -> list:
    """What a fixed-draft case exercises: (node, sibling index, p'(x) / q(x), probability
    the node is tried) for every node tried with probability > 1e-6, p' being the
    target's distribution (or residual, after rejected siblings) at that point. A ratio
    in (0, 1) is a coin that decides; 0 or >= 1 is a foregone rejection or acceptance."""
    n = len(tokens)
    ch = children_of(parents, n)
    out = []

    def walk(node, prob):
        pp = np.array(p_rows[node + 1], dtype=np.float64)
        reach = prob
        for j, c in enumerate(ch[node]):
            x = int(tokens[c])
            qc = np.asarray(q_rows[c], dtype=np.float64)
            r = pp[x] / qc[x] if qc[x] > 0 else 0.0
            out.append((c, j, r, reach))
            if r > 0:
                walk(c, reach * min(1.0, r))
            reach *= 1.0 - min(1.0, r)
            if reach <= 1e-6:
                return
            res = np.maximum(pp - qc, 0.0)
            pp = res / res.sum()

    walk(-1, 1.0)
    return out


def coins_decide(ratios, lo=0.2, hi=0.8, reach=0.1, sibling=0) -> bool:
    """Whether some node at sibling index >= ``sibling``, tried with probability >=
    ``reach``, is accepted with a probability in (lo, hi)."""
    return any(j >= sibling and lo < r < hi and w >= reach for _, j, r, w in ratios)


def outcome_keys(result):
    """(path, final token) per request from a verify result (numpy); see outcome_counts."""
    tokens = np.asarray(result.tokens)
    nacc = np.asarray(result.num_accepted)
    nodes = np.asarray(result.accepted_nodes)
    keys = []
    for b in range(tokens.shape[0]):
        a = int(nacc[b])
        keys.append((tuple(int(v) for v in nodes[b, :a]), int(tokens[b, a])))
    return keys


def outcome_counts(result, mask=None) -> dict:
    """{(path, final token): count} over the requests of a verify result (numpy).

    ``mask`` (B,) bool restricts the count to some requests. Vectorised: the rows of
    (accepted nodes, final token) are counted with np.unique, then named.
    """
    tokens = np.asarray(result.tokens)
    nacc = np.asarray(result.num_accepted).astype(np.int64)
    nodes = np.asarray(result.accepted_nodes).reshape(tokens.shape[0], -1)
    final = tokens[np.arange(tokens.shape[0]), nacc]
    table = np.concatenate([nodes, nacc[:, None], final[:, None]], axis=1)
    if mask is not None:
        table = table[np.asarray(mask)]
    dims = np.maximum(table.max(axis=0, initial=0) + 2, 2).astype(np.int64)  # values >= -1
    if np.prod(dims.astype(float)) < 2.0**62:  # one int64 per row: a fast 1-D unique
        codes, counts = np.unique(np.ravel_multi_index((table + 1).T, dims), return_counts=True)
        rows = np.stack(np.unravel_index(codes, dims), axis=1) - 1
    else:
        rows, counts = np.unique(table, axis=0, return_counts=True)
    out = {}
    for r, c in zip(rows, counts):
        a = int(r[-2])
        out[(tuple(int(v) for v in r[:a]), int(r[-1]))] = int(c)
    return out


def one_hot(tokens, vocab):
    q = np.zeros((len(tokens), vocab))
    q[np.arange(len(tokens)), np.asarray(tokens)] = 1.0
    return q


def sparse_to_dense(ids, vals, vocab):
    ids = np.asarray(ids)
    vals = np.asarray(vals, dtype=np.float64)
    q = np.zeros((ids.shape[0], vocab))
    for i in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            if ids[i, j] >= 0:
                q[i, ids[i, j]] += vals[i, j]
    return q


def softmax(x, axis=-1):
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=axis, keepdims=True)


def sample_rows(rng, probs: np.ndarray) -> np.ndarray:
    """One draw per row of a (B, V) stack of distributions (inverse CDF, float64)."""
    c = np.cumsum(probs, axis=1)
    u = rng.random((probs.shape[0], 1)) * c[:, -1:]
    tok = (c <= u).sum(axis=1)
    # never land on a zero-probability token because of rounding at the top end
    tok = np.minimum(tok, probs.shape[1] - 1)
    bad = probs[np.arange(len(tok)), tok] <= 0
    if bad.any():
        tok[bad] = np.argmax(probs[bad] > 0, axis=1)
    return tok


# ---------------------------------------------------------------------------------------
# A toy language model pair with known text distribution
# ---------------------------------------------------------------------------------------


class ToyLM:
    """Target logits and drafter probabilities that depend only on the previous token.

    root_logits (V,): the target's row 0 (the context). trans_logits (V, V): row v is the
    target's logits after token v. q_root (V,), q_trans (V, V): the drafter's float32
    distributions (the drafter really samples from exactly these values).
    """

    def __init__(self, vocab, seed, *, spread=1.5, draft_noise=0.8):
        rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.root_logits = (rng.standard_normal(vocab) * spread).astype(np.float32)
        self.trans_logits = (rng.standard_normal((vocab, vocab)) * spread).astype(np.float32)
        # The drafter: the target at temperature 1 with noise (a plausible small model).
        qr = softmax(self.root_logits + rng.standard_normal(vocab) * draft_noise)
        qt = softmax(self.trans_logits + rng.standard_normal((vocab, vocab)) * draft_noise)
        self.q_root = _f32_normalised(qr)
        self.q_trans = _f32_normalised(qt)

    def target(self, **params):
        """(p_root (V,), P_trans (V, V)) under the sampling parameters."""
        p0 = ref_probs_row(self.root_logits, **params)
        pt = ref_probs(self.trans_logits, **{k: v for k, v in params.items()})
        return p0, pt

    def all_rows(self):
        return np.vstack([self.root_logits[None], self.trans_logits])


def _f32_normalised(q):
    q32 = np.asarray(q, np.float32)
    q32 = (q32.astype(np.float64) / q32.astype(np.float64).sum(axis=-1, keepdims=True)).astype(
        np.float32
    )
    return q32


def build_toy_batch(lm: ToyLM, batch, parents, *, kind, siblings, rng, sparse_k=4):
    """A batch of ``batch`` copies of one draft tree shape, drafted by ``lm``'s drafter.

    kind: "none" (deterministic drafts: the j-th sibling is the drafter's j-th most likely
    token, q one-hot), "dense" or "sparse" (top-``sparse_k`` of the drafter's q,
    renormalised: the drafter samples only those ids).
    siblings: "iid" (each sibling drawn from the same q) or "distinct" (drawn without
    replacement: q of a later sibling is the renormalised remainder).
    Returns a dict with logits (B*(n+1), V) float32, draft_tokens (B*n,) int32,
    num_draft (B,), parents (B*n,) or None for chains, draft_probs (dense / SparseProbs
    arguments / None), tokens (B, n), and q_first (B, V): the first node's q (float64).
    """
    parents = np.asarray(parents, np.int32)
    n = len(parents)
    V = lm.vocab
    ch = children_of(parents, n)
    tokens = np.zeros((batch, n), np.int64)
    dense = np.zeros((batch, n, V), np.float32) if kind == "dense" else None
    sp_ids = np.full((batch, n, sparse_k), -1, np.int32) if kind == "sparse" else None
    sp_vals = np.zeros((batch, n, sparse_k), np.float32) if kind == "sparse" else None
    q_first = None
    rows = np.arange(batch)
    for i in range(n):
        par = int(parents[i])
        if par < 0:
            base = np.broadcast_to(lm.q_root.astype(np.float64), (batch, V)).copy()
        else:
            base = lm.q_trans[tokens[:, par]].astype(np.float64)
        earlier = [s for s in ch[par] if s < i]
        if kind == "none":
            rank = len(earlier)
            order = np.argsort(-base, axis=1, kind="stable")
            tokens[:, i] = order[:, rank]
            if i == 0:
                q_first = one_hot(tokens[:, 0], V)
            continue
        if kind == "sparse":
            top = np.argsort(-base, axis=1, kind="stable")[:, :sparse_k]
            keep = np.zeros_like(base)
            keep[rows[:, None], top] = 1.0
            base = base * keep
        if siblings == "distinct":
            for s in earlier:
                base[rows, tokens[:, s]] = 0.0
        base = base / base.sum(axis=1, keepdims=True)
        base32 = base.astype(np.float32)
        q_eff = base32.astype(np.float64)
        q_eff /= q_eff.sum(axis=1, keepdims=True)
        tokens[:, i] = sample_rows(rng, q_eff)
        if i == 0:
            q_first = q_eff
        if kind == "dense":
            dense[:, i] = base32
        else:
            top = np.argsort(-base, axis=1, kind="stable")[:, :sparse_k]
            vals = np.take_along_axis(base32, top, axis=1)
            ids = np.where(vals > 0, top, -1).astype(np.int32)
            sp_ids[:, i] = ids
            sp_vals[:, i] = np.where(ids >= 0, vals, 0.0)
    logits = np.empty((batch, n + 1, V), np.float32)
    logits[:, 0] = lm.root_logits
    logits[:, 1:] = lm.trans_logits[tokens]
    out = dict(
        logits=logits.reshape(batch * (n + 1), V),
        draft_tokens=tokens.reshape(-1).astype(np.int32),
        num_draft=np.full(batch, n, np.int32),
        tokens=tokens,
        q_first=q_first,
        is_chain=bool(np.array_equal(parents, chain_parents(n))),
        parents_local=parents,
    )
    out["parents"] = None if out["is_chain"] else np.tile(parents, batch)
    if kind == "dense":
        out["draft_probs"] = ("dense", dense.reshape(batch * n, V))
    elif kind == "sparse":
        out["draft_probs"] = (
            "sparse",
            sp_ids.reshape(batch * n, sparse_k),
            sp_vals.reshape(batch * n, sparse_k),
        )
    else:
        out["draft_probs"] = None
    return out


def node_depths(parents):
    d = np.zeros(len(parents), np.int64)
    for i, p in enumerate(parents):
        d[i] = 0 if p < 0 else d[p] + 1
    return d


def simulate_coupled(row_tokens, parents, draft_tokens):
    """Walk one request's tree given the coupled target token of each of its rows.

    row_tokens: (n + 1,) the coupled sample of row 0 and of the row after each node (each
    at its own position). Returns (emitted tokens, accepted nodes).
    """
    n = len(draft_tokens)
    ch = children_of(parents, n)
    node, emitted, path = -1, [], []
    while True:
        t = int(row_tokens[node + 1])
        emitted.append(t)
        nxt = next((c for c in ch[node] if int(draft_tokens[c]) == t), None)
        if nxt is None:
            return emitted, path
        path.append(nxt)
        node = nxt


# ---------------------------------------------------------------------------------------
# Tolerances of probs() against ref_probs, keyed by the logits dtype
# ---------------------------------------------------------------------------------------
# The reference reads the exact values of the input (float16 and bfloat16 convert to
# float32 exactly), so the dtype does not widen the tolerance: what remains is the
# kernel's own arithmetic. rtol: the contract's ~1e-5 relative (exp is a float32
# polynomial of ~2 ulp; (x - max) / T rounds once or twice, and an argument of up to
# ln(2^40) ~ 27.7 turns 2^-24 relative into ~3e-6 relative after exp). atol: tokens below
# ~2^-40 of the row's largest probability are flushed to exactly 0 by the fixed-point
# masses; 2^-36 absolute covers that flush and the 2^-40 quantum of the masses.
TOLERANCES = {
    "float32": dict(rtol=1e-5, atol=2.0**-36),
    "float16": dict(rtol=1e-5, atol=2.0**-36),
    "bfloat16": dict(rtol=1e-5, atol=2.0**-36),
}


# ---------------------------------------------------------------------------------------
# Ragged batches of independent random requests
# ---------------------------------------------------------------------------------------

PARAM_KEYS = ("temperature", "top_k", "top_p", "min_p", "seed", "position")


def random_request(rng, vocab, max_draft, *, tree=True, sparse_k=4):
    """One request: rows, drafts (some equal to the row's argmax so that acceptances
    happen), parents, dense q, sparse q and per-request parameters."""
    nd = int(rng.integers(0, max_draft + 1))
    if tree:
        parents = np.array([int(rng.integers(-1, i)) if i else -1 for i in range(nd)], np.int32)
    else:
        parents = chain_parents(nd)
    logits = (rng.standard_normal((nd + 1, vocab)) * 1.5).astype(np.float32)
    q = rng.dirichlet(np.full(vocab, 0.5), size=nd)
    top = np.argsort(-q, axis=1, kind="stable")[:, :sparse_k]
    sq = np.zeros_like(q)
    np.put_along_axis(sq, top, np.take_along_axis(q, top, 1), 1)
    sq /= np.maximum(sq.sum(axis=1, keepdims=True), 1e-300)
    tokens = np.zeros(nd, np.int32)
    for i in range(nd):
        if rng.random() < 0.5:  # the row's argmax: likely accepted
            tokens[i] = int(np.argmax(logits[parents[i] + 1]))
            # make sure the drafter could have drawn it
            if sq[i, tokens[i]] == 0:
                top[i, -1] = tokens[i]
                sq[i] = 0
                sq[i, top[i]] = 1.0 / sparse_k
        else:
            tokens[i] = int(rng.choice(vocab, p=sq[i]))
    vals = np.take_along_axis(sq, top, 1)
    return dict(
        logits=logits,
        tokens=tokens,
        parents=parents,
        dense=_f32_normalised(q) if nd else np.zeros((0, vocab), np.float32),
        sparse_ids=top.astype(np.int32),
        sparse_vals=_f32_normalised(vals) if nd else np.zeros((0, sparse_k), np.float32),
        temperature=float(rng.choice([0.0, 0.5, 1.0, 1.0, 1.5])),
        top_k=int(rng.choice([0, 0, 3, 8])),
        top_p=float(rng.choice([1.0, 1.0, 0.9, 0.7])),
        min_p=float(rng.choice([0.0, 0.0, 0.05])),
        seed=int(rng.integers(0, 2**63)),
        position=int(rng.integers(0, 2**40)),
    )


def pack(reqs, kind="dense", *, with_parents=True):
    """Flatten a list of requests into verify's arguments (kind: none, dense, sparse).

    Returns (args, kwargs) for ``specfast.verify`` except ``draft_probs`` (see
    ``draft_arg``): kwargs["draft_probs"] is a tuple describing it.
    """
    vocab = reqs[0]["logits"].shape[1]
    logits = np.concatenate([r["logits"] for r in reqs])
    tokens = np.concatenate([r["tokens"] for r in reqs]).astype(np.int32)
    nd = np.array([len(r["tokens"]) for r in reqs], np.int32)
    kw = {k: np.array([r[k] for r in reqs]) for k in PARAM_KEYS}
    kw["temperature"] = kw["temperature"].astype(np.float32)
    kw["top_p"] = kw["top_p"].astype(np.float32)
    kw["min_p"] = kw["min_p"].astype(np.float32)
    kw["top_k"] = kw["top_k"].astype(np.int32)
    kw["seed"] = kw["seed"].astype(np.uint64)
    kw["position"] = kw["position"].astype(np.int64)
    kw["parents"] = (
        np.concatenate([r["parents"] for r in reqs]).astype(np.int32) if with_parents else None
    )
    if kind == "dense":
        kw["draft_probs"] = ("dense", np.concatenate([r["dense"] for r in reqs]).reshape(-1, vocab))
    elif kind == "sparse":
        k = reqs[0]["sparse_ids"].shape[1] if reqs[0]["sparse_ids"].ndim == 2 else 4
        ids = np.concatenate([r["sparse_ids"].reshape(-1, k) for r in reqs]).astype(np.int32)
        vals = np.concatenate([r["sparse_vals"].reshape(-1, k) for r in reqs]).astype(np.float32)
        kw["draft_probs"] = ("sparse", ids, vals)
    else:
        kw["draft_probs"] = None
    return (logits, tokens, nd), kw


def draft_arg(spec):
    """The ``draft_probs`` argument described by ``pack``'s tuple."""
    import specfast

    if spec is None:
        return None
    if spec[0] == "dense":
        return spec[1]
    return specfast.SparseProbs(spec[1], spec[2])


def call_verify(args, kw, **over):
    """specfast.verify(*args, **kw) with the draft_probs tuple resolved; ``over`` wins."""
    import specfast

    kw = dict(kw, **over)
    kw["draft_probs"] = draft_arg(kw.get("draft_probs"))
    return specfast.verify(*args, **kw)


def request_slices(num_draft):
    """(row offset, node offset) of each request of a ragged batch."""
    nd = np.asarray(num_draft, np.int64)
    nodes = np.concatenate([[0], np.cumsum(nd)])[:-1]
    rows = np.concatenate([[0], np.cumsum(nd + 1)])[:-1]
    return rows, nodes


def check_structure(result, draft_tokens, num_draft, parents, vocab):
    """Shapes, dtypes, padding and path consistency of a verify result (numpy)."""
    tokens = np.asarray(result.tokens)
    nacc = np.asarray(result.num_accepted)
    nodes = np.asarray(result.accepted_nodes)
    nd = np.asarray(num_draft, np.int64)
    B = nd.size
    md = int(nd.max()) if B else 0
    assert tokens.shape == (B, md + 1), tokens.shape
    assert nacc.shape == (B,), nacc.shape
    assert nodes.shape == (B, md), nodes.shape
    assert tokens.dtype == np.int32 and nacc.dtype == np.int32 and nodes.dtype == np.int32
    assert np.all((nacc >= 0) & (nacc <= nd)), "num_accepted outside [0, num_draft]"
    col = np.arange(md + 1)[None]
    emitted = col <= nacc[:, None]
    assert np.all(tokens[~emitted] == -1), "tokens not padded with -1"
    final = tokens[np.arange(B), nacc]
    assert np.all((final >= 0) & (final < vocab)), "final token out of range"
    acc = col[:, :md] < nacc[:, None]
    assert np.all(nodes[~acc] == -1), "accepted_nodes not padded with -1"
    assert np.all((nodes[acc] >= 0)), "accepted node index negative"
    assert np.all(np.broadcast_to(nd[:, None], acc.shape)[acc] > nodes[acc]), "node >= num_draft"
    _, node_off = request_slices(nd)
    g = node_off[:, None] + np.where(acc, nodes, 0)
    dt = np.asarray(draft_tokens)
    assert np.all(tokens[:, :md][acc] == dt[g[acc]]), "accepted tokens are not the drafts"
    if parents is None:
        assert np.all(nodes[acc] == np.broadcast_to(col[:, :md], acc.shape)[acc]), "chain path"
    else:
        par = np.asarray(parents)
        want = np.concatenate([np.full((B, 1), -1), nodes[:, :-1]], axis=1) if md else nodes
        assert np.all(par[g[acc]] == want[acc]), "accepted nodes do not form a path"
