"""Token trees end to end on tiny random transformers models: the tree forward,
keeping the accepted path, n-gram trees, and exactness of tree decoding."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import specfast  # noqa: E402
from specfast.decoder import SpeculativeDecoder  # noqa: E402
from specfast.drafters import ModelDrafter, NgramDrafter, Sampling  # noqa: E402

from reference import ref_probs_row  # noqa: E402
from stats import assert_outcomes, scaled, tv_draws  # noqa: E402
from test_decoder import (PROMPTS, full_logits, one_thread, reference,  # noqa: E402,F401
                          target, tiny_model, two_token_joint)


def path_to(parents, node):
    """Nodes from the root's child down to ``node``."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_tree_forward_equals_a_forward_per_path(target):
    """Every node's logits are those after the prefix and its own path, and a
    chain row and a tree row share a batch."""
    prompts = [[3, 7, 11, 3, 7], [5, 9]]
    tree = ([40, 41, 42, 43, 44, 45], [-1, -1, 0, 0, 2, 1])
    state = target.new_state(2)
    target.forward(state, [p[:-1] for p in prompts], all_logits=False)
    rows = target.forward(state, [[prompts[0][-1]] + tree[0], [prompts[1][-1], 20, 21]],
                          trees=[tree[1], None])
    got = rows[0].float().numpy()
    np.testing.assert_allclose(got[0], full_logits(target, prompts[0])[0], atol=1e-5)
    for node in range(len(tree[0])):
        path = [tree[0][n] for n in path_to(tree[1], node)]
        want = full_logits(target, prompts[0] + path)[0]
        np.testing.assert_allclose(got[1 + node], want, atol=1e-5, err_msg=f"node {node}")
    np.testing.assert_allclose(rows[1][-1].float().numpy(),
                               full_logits(target, prompts[1] + [20, 21])[0], atol=1e-5)


def test_keep_paths_leaves_the_cache_of_a_chain(target):
    """After keeping a path, the next forward sees the prefix and the path only."""
    prompt = [3, 7, 11, 3, 7]
    tokens, parents = [40, 41, 42, 43, 44], [-1, -1, 1, 1, 3]
    for path in ([], [1], [1, 3], [1, 3, 4], [0]):
        state = target.new_state(1)
        target.forward(state, [prompt[:-1]], all_logits=False)
        target.forward(state, [[prompt[-1]] + tokens], trees=[parents])
        nodes = np.full((1, 4), -1, np.int32)
        nodes[0, :len(path)] = path
        target.keep_paths(state, nodes, np.array([len(path)], np.int32))
        kept = prompt + [tokens[n] for n in path]
        target.truncate(state, [len(kept)])
        assert state.lengths == [len(kept)]
        # the dropped nodes leave the cache (they stayed as holes, step after step)
        assert state.slots == len(kept) and target.kv_bytes(state) == \
            target.kv_bytes_per_token() * len(kept)
        got = target.forward(state, [[33]])[0][-1].float().numpy()
        np.testing.assert_allclose(got, full_logits(target, kept + [33])[0], atol=1e-5,
                                   err_msg=f"path {path}")


def test_keep_paths_rejects_a_path_longer_than_its_tree(target):
    state = target.new_state(1)
    target.forward(state, [[1, 2]], all_logits=False)
    target.forward(state, [[3, 4]], trees=[[-1]])
    with pytest.raises(ValueError, match="longer"):
        target.keep_paths(state, np.array([[0, 1]], np.int32), np.array([2], np.int32))


def test_tree_forward_checks_parents(target):
    state = target.new_state(1)
    with pytest.raises(ValueError, match="parents"):
        target.forward(state, [[1, 2, 3]], trees=[[-1]])


def check_tree(draft, k):
    n = len(draft.tokens)
    assert n <= k and len(draft.parents) == n
    assert all(-1 <= p < i for i, p in enumerate(draft.parents))
    seen = set()
    for i, p in enumerate(draft.parents):  # siblings carry different tokens
        assert (p, draft.tokens[i]) not in seen
        seen.add((p, draft.tokens[i]))


def test_ngram_tree_merges_continuations():
    ctx = [1, 2, 3, 9, 9, 1, 2, 4, 8, 8, 5, 1, 2, 3, 7, 1, 2]
    d = NgramDrafter(branches=3)
    d.start([ctx], [Sampling()])
    draft = d.propose([ctx], [8], [Sampling()])[0]
    check_tree(draft, 8)
    roots = [t for t, p in zip(draft.tokens, draft.parents) if p == -1]
    assert sorted(roots) == [3, 4]  # "1 2" was followed by 3 (twice) and by 4
    # "1 2 3" continues with 9 and with 7: the tree branches below 3
    three = draft.tokens.index(3)
    assert sorted(t for t, p in zip(draft.tokens, draft.parents) if p == three) == [7, 9]
    # the first node is the chain drafter's first token; the first k nodes are a tree
    chain = NgramDrafter()
    chain.start([ctx], [Sampling()])
    assert draft.tokens[0] == chain.propose([ctx], [8], [Sampling()])[0].tokens[0]
    for k in range(1, 9):
        small = d.propose([ctx], [k], [Sampling()])[0]
        check_tree(small, k)


def test_ngram_tree_random_contexts_are_valid_trees():
    rng = np.random.default_rng(0)
    for _ in range(200):
        ctx = rng.integers(0, 4, size=int(rng.integers(2, 60))).tolist()
        d = NgramDrafter(branches=int(rng.integers(2, 6)), max_ngram=3)
        d.start([ctx], [Sampling()])
        k = int(rng.integers(1, 12))
        draft = d.propose([ctx], [k], [Sampling()])[0]
        if draft.tokens:
            check_tree(draft, k)
        for i in range(len(draft.tokens)):  # each path followed the last token earlier on
            path = [draft.tokens[n] for n in path_to(draft.parents, i)]
            assert any(ctx[s] == ctx[-1] and repeated(ctx, s + 1, len(path)) == path
                       for s in range(len(ctx) - 1))


def repeated(ctx, start, n):
    """n tokens of the text from ``start`` on, where the text past the context
    repeats with the period len(ctx) - start (a copy from there running on)."""
    text, period = list(ctx), len(ctx) - start
    while len(text) < start + n:
        text.append(text[-period])
    return text[start:start + n]


@pytest.mark.parametrize("k", ["auto", 3, 8], ids=lambda k: f"k={k}")
def test_tree_greedy_matches_plain_decoding(target, k):
    dec = SpeculativeDecoder(target, NgramDrafter(branches=3), k=k)
    out = dec.generate(PROMPTS, 30)  # a batch: different trees per row
    for prompt, g in zip(PROMPTS, out):
        assert g.tokens == reference(target, prompt, 30, temperature=0.0), prompt
    assert dec.last_metrics.draft_n > 0


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=5)],
                         ids=["t1", "t0.7-topk5"])
def test_tree_coupled_matches_plain_coupled_sampling(target, params):
    seeds = [5, 6, 7, 8]
    out = SpeculativeDecoder(target, NgramDrafter(branches=4), k=6).generate(
        PROMPTS, 24, seed=seeds, method="coupled", **params)
    for prompt, seed, g in zip(PROMPTS, seeds, out):
        assert g.tokens == reference(target, prompt, 24, seed=seed, method="coupled", **params)


@pytest.mark.parametrize("k", ["auto", 5], ids=lambda k: f"k={k}")
def test_model_tree_matches_plain_decoding(target, k):
    """A draft model's trees (ranked by path confidence): greedy and coupled output
    equal plain decoding's, in a batch."""
    dec = SpeculativeDecoder(target, ModelDrafter(tiny_model(seed=1, layers=1), branches=3), k=k)
    out = dec.generate(PROMPTS, 24)
    for prompt, g in zip(PROMPTS, out):
        assert g.tokens == reference(target, prompt, 24, temperature=0.0), prompt
    seeds = [1, 2, 3, 4]
    out = dec.generate(PROMPTS, 24, temperature=0.8, top_k=6, seed=seeds, method="coupled")
    for prompt, seed, g in zip(PROMPTS, seeds, out):
        assert g.tokens == reference(target, prompt, 24, seed=seed, method="coupled",
                                     temperature=0.8, top_k=6)
    assert dec.last_metrics.draft_n > 0


def test_model_tree_branches_under_greedy():
    """Greedy requests get trees, not chains: a greedy q is one-hot, so the nodes
    rank by the draft's unfiltered softmax instead (else every runner-up scores 0)."""
    draft = ModelDrafter(tiny_model(seed=1, layers=1), branches=3)
    for s in (Sampling(temperature=0.0), Sampling(temperature=0.0, top_k=1, method="rejection")):
        ctx = [3, 7, 11, 3, 7]
        draft.start([ctx], [s])
        d = draft.propose([ctx], [6], [s])[0]
        check_tree(d, 6)
        assert len(d.tokens) == 6
        assert len(set(d.parents)) < len(d.parents), d.parents  # a node with two children


def test_p_min_stops_greedy_chains():
    """p_min reads the draft's confidence (at temperature 1 for a greedy request,
    whose q is one-hot and never fell below it: 8 of 8 tokens were drafted)."""
    model = tiny_model(seed=1, layers=1)
    ctx = [3, 7, 11, 3, 7]
    for s in (Sampling(temperature=0.0), Sampling(temperature=1.0, seed=1, method="coupled")):
        drafted = []
        for p_min in (0.0, 0.999):
            d = ModelDrafter(model, p_min=p_min)
            d.start([ctx], [s])
            drafted.append(len(d.propose([ctx], [8], [s])[0].tokens))
        assert drafted == [8, 1], (s, drafted)


def test_model_tree_draws_siblings_without_replacement():
    """In rejection mode siblings are drawn without replacement and each reports
    the distribution it was drawn from: those rows sum to 1 and exclude the
    earlier siblings."""
    draft = ModelDrafter(tiny_model(vocab=12, seed=5, layers=1), branches=3)
    s = Sampling(temperature=1.0, seed=9, method="rejection")
    ctx = [1, 2, 3, 4]
    draft.start([ctx], [s])
    d = draft.propose([ctx], [7], [s])[0]
    check_tree(d, 7)
    assert len(d.tokens) == 7 and d.probs.shape == (7, 12)
    np.testing.assert_allclose(d.probs.sum(axis=1), 1.0, atol=1e-5)
    for i, p in enumerate(d.parents):
        assert d.probs[i, d.tokens[i]] > 0
        for j in range(i):
            if d.parents[j] == p:  # an earlier sibling
                assert d.probs[i, d.tokens[j]] == 0
    again = ModelDrafter(draft.model, branches=3)
    again.start([ctx], [s])
    assert again.propose([ctx], [7], [s])[0].tokens == d.tokens  # reproducible


def test_model_tree_siblings_follow_what_they_report():
    """Over many seeds the root's first two children are distributed as draws without
    replacement: the first from the draft model's filtered distribution q (float64
    reference of a full forward), the second from the filters applied again with the
    first masked out, q_a (its top 2 holds a token q gives 0); P(a, b) = q(a) q_a(b).
    Each reports exactly the distribution it was drawn from. top_k = 2 keeps the
    table at 4 pairs: 1.1e5 drafts (in batches of 500) see a total variation of 1%."""
    model = tiny_model(vocab=12, seed=5, layers=1)
    params = dict(temperature=0.9, top_k=2)
    ctx = [1, 2, 3, 4]
    logits = full_logits(model, ctx)[0]
    q = ref_probs_row(logits, **params)

    def without(a):
        masked = logits.copy()
        masked[a] = -np.inf
        return ref_probs_row(masked, **params)

    q_without = np.array([without(a) for a in range(logits.size)])
    expected = {}
    for a in np.nonzero(q)[0]:
        for b in np.nonzero(q_without[a])[0]:
            expected[(int(a), int(b))] = q[a] * q_without[a, b]
    assert len(expected) == 4 and any(q[b] == 0 for _, b in expected)
    n, chunk = scaled(tv_draws(len(expected) - 1)), 500
    draft = ModelDrafter(model, branches=3)
    counts = np.zeros((logits.size, logits.size), np.int64)
    for start in range(0, n, chunk):  # (few objects held: the collector's passes stay short)
        s = [Sampling(seed=i, method="rejection", **params)
             for i in range(start, min(start + chunk, n))]
        draft.start([ctx] * len(s), s)
        ab, reported = [], []
        for d in draft.propose([ctx] * len(s), [3] * len(s), s):
            first, second = [j for j, p in enumerate(d.parents) if p == -1][:2]
            ab.append((d.tokens[first], d.tokens[second]))
            reported.append(d.probs[[first, second]])
        ab, reported = np.array(ab), np.array(reported)
        np.testing.assert_allclose(reported[:, 0], np.broadcast_to(q, (len(s), q.size)),
                                   atol=2e-6)
        np.testing.assert_allclose(reported[:, 1], q_without[ab[:, 0]], atol=2e-6)
        np.add.at(counts, (ab[:, 0], ab[:, 1]), 1)
    observed = {(int(a), int(b)): int(c) for (a, b), c in np.ndenumerate(counts) if c}
    assert_outcomes(observed, expected, "first two siblings")


@pytest.mark.parametrize("sparse_top", [0, 5], ids=["dense", "sparse"])
def test_tree_rejection_passes_exact_rows_to_verify(target, monkeypatch, sparse_top):
    """As test_decoder's test_rejection_passes_exact_rows_to_verify for chains, for
    trees: every verification of a rejection-mode batch gets, per request, a tree
    (each parent before its children, siblings with distinct tokens), the target's
    logits after the context and after each node's path, each node's q: the draft
    model's exact filtered distribution after its parent's path with the earlier
    siblings masked out (float64 reference of full forwards, no cache), the request's
    own seed and sampling parameters, and position = context length; the target keeps
    the path verify accepted (keep_paths gets its accepted nodes, and the next
    verification's logits, checked against full forwards, hold no other node)."""
    draft_model = tiny_model(seed=1, layers=1)
    params = dict(temperature=0.9, top_k=8, top_p=0.9, min_p=0.02)
    q_params = dict(params, top_k=sparse_top or params["top_k"])  # the drafter's own
    seeds, prompts, n_new = [3, 4], [PROMPTS[0], PROMPTS[2]], 16
    calls, kept = [], []
    real, real_keep = specfast._api.verify, target.keep_paths

    def spy(logits, tokens, num_draft, **kw):
        r = real(logits, tokens, num_draft, **kw)
        calls.append((np.array(logits), np.array(tokens), np.array(num_draft), kw, r))
        return r

    def keep_spy(state, nodes, num):
        kept.append((len(calls), np.array(nodes), np.array(num)))
        return real_keep(state, nodes, num)

    monkeypatch.setattr(specfast._api, "verify", spy)
    monkeypatch.setattr(target, "keep_paths", keep_spy)
    dec = SpeculativeDecoder(target, ModelDrafter(draft_model, sparse_top=sparse_top,
                                                  branches=3), k=4)
    out = dec.generate(prompts, n_new, seed=seeds, method="rejection", **params)
    ctx = [list(p) for p in prompts]
    live, siblings, deep, accepted = [0, 1], 0, 0, 0
    for c, (logits, toks, nd, kw, r) in enumerate(calls):
        assert kw["method"] == "rejection"
        parents, q = kw["parents"], kw["draft_probs"]
        keeps = [(nodes, num) for at, nodes, num in kept if at == c + 1]
        if parents is None:  # a step without drafts (the last token): nothing to keep
            assert not nd.any() and q is None and not keeps
            parents = np.zeros(0, np.int32)
        else:
            assert len(keeps) == 1
            np.testing.assert_array_equal(keeps[0][0], r.accepted_nodes)
            np.testing.assert_array_equal(keeps[0][1], r.num_accepted)
            if sparse_top:
                q = q.dense(target.vocab_size)
        row = off = 0
        for j, i in enumerate(live):
            assert kw["position"][j] == len(ctx[i]) and kw["seed"][j] == seeds[i]
            assert kw["temperature"][j] == np.float32(0.9) and kw["top_k"][j] == 8
            n, par, tk = int(nd[j]), parents[off:off + nd[j]], toks[off:off + nd[j]]
            np.testing.assert_allclose(logits[row], full_logits(target, ctx[i])[0],
                                       rtol=1e-5, atol=1e-5)
            for a in range(n):
                assert -1 <= par[a] < a
                earlier = [int(tk[b]) for b in range(a) if par[b] == par[a]]
                assert int(tk[a]) not in earlier
                siblings += bool(earlier)
                deep += bool(par[a] >= 0)
                prefix = ctx[i] + [int(tk[x]) for x in path_to(par, a)]
                np.testing.assert_allclose(logits[row + 1 + a], full_logits(target, prefix)[0],
                                           rtol=1e-5, atol=1e-5)
                masked = full_logits(draft_model, prefix[:-1])[0]
                masked[earlier] = -np.inf
                np.testing.assert_allclose(q[off + a], ref_probs_row(masked, **q_params),
                                           atol=2e-6)
            m = int(r.num_accepted[j])
            path = [int(v) for v in r.accepted_nodes[j, :m]]
            assert path == (path_to(par, path[-1]) if m else [])
            assert [int(t) for t in r.tokens[j, :m]] == [int(tk[v]) for v in path]
            accepted += m
            ctx[i] += [int(t) for t in r.tokens[j, :m + 1]]
            off += n
            row += n + 1
        live = [i for i in live if len(ctx[i]) - len(prompts[i]) < n_new]
    assert not live and siblings > 0 and deep > 0 and accepted > 0
    assert len(kept) == sum(kw["parents"] is not None for *_, kw, _ in calls)
    assert [c[len(p):] for c, p in zip(ctx, prompts)] == [g.tokens for g in out]


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_tree_rejection_sampling_is_exact(drafter):
    """The joint distribution of the first two tokens equals the target's when
    every step verifies a tree of deterministic candidates (a smoke test of the loop:
    6000 generations see 6% of it; test_tree_rejection_passes_exact_rows_to_verify
    pins the inputs of every tree verification exactly, and test_verify holds the
    kernel to 1%)."""
    target = tiny_model(vocab=6, seed=3, scale=0.4)
    prompt = [1, 2, 1, 3, 1, 2, 4, 1]
    n = scaled(6000)
    d = NgramDrafter(max_ngram=2, branches=3) if drafter == "ngram" else \
        ModelDrafter(tiny_model(vocab=6, seed=4, scale=0.4), branches=2)
    dec = SpeculativeDecoder(target, d, k=3)
    # 3 new tokens: the first step may draft 2 nodes ("1" was followed by 2 and 3)
    out = dec.generate([prompt] * n, 3, temperature=1.0, seed=list(range(n)),
                       method="rejection")
    assert_outcomes([tuple(g.tokens[:2]) for g in out], two_token_joint(target, prompt),
                    f"rejection/tree/{drafter}", resolution=0.06)
    assert sum(g.metrics.draft_n for g in out) > 2 * n  # trees of siblings were verified


def test_trees_need_a_target_that_takes_them(target):
    class ChainsOnly:  # an adapter without tree forwards (llama.cpp's)
        pass

    with pytest.raises(ValueError, match="chains only"):
        SpeculativeDecoder(ChainsOnly(), NgramDrafter(branches=2))
    with pytest.raises(ValueError, match="chains only"):
        ModelDrafter(ChainsOnly(), branches=2)
    with pytest.raises(ValueError, match="branches"):
        NgramDrafter(branches=0)
    from specfast.drafters import make

    assert make("ngram:4", branches=3).branches == 3
