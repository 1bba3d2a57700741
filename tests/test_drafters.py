"""Drafters on their own: n-gram lookup (pure Python) and the draft-model drafter."""

from __future__ import annotations

import numpy as np
import pytest

import specfast
from specfast.drafters import NgramDrafter, Sampling, draft_seed


def propose(d, ctx, k):
    d.start([ctx], [Sampling()])
    return d.propose([ctx], [k], [Sampling()])[0]


def test_ngram_prefers_the_longest_match_then_the_earliest():
    ctx = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 6, 1, 2, 3]
    # both occurrences of (1, 2, 3) match 3 tokens back: the earliest wins (HF's rule)
    d = propose(NgramDrafter(), ctx, 7)
    assert d.tokens == [4, 5, 9, 1, 2, 3, 7] and d.match == 3
    assert propose(NgramDrafter(), ctx, 2).tokens == [4, 5]
    # the later occurrence matches further back (6, 1, 2, 3): it wins
    ctx = [6, 1, 2, 3, 4, 5, 9, 6, 1, 2, 3, 7, 8, 0, 6, 1, 2, 3]
    d = propose(NgramDrafter(), ctx, 3)
    assert d.tokens == [4, 5, 9] and d.match == 4
    ctx = [5, 9, 1, 2, 3, 4, 5, 9, 6, 1, 2, 3, 7, 8, 9, 6, 1, 2, 3]
    d = propose(NgramDrafter(), ctx, 3)
    assert d.tokens == [7, 8, 9] and d.match == 5
    assert propose(NgramDrafter(), ctx, 5).probs is None  # deterministic


def test_ngram_falls_back_to_shorter_ngrams_and_to_nothing():
    assert propose(NgramDrafter(max_ngram=3, min_ngram=1), [5, 6, 7, 8, 6], 3).tokens == [7, 8, 6]
    assert propose(NgramDrafter(), [1, 2, 3, 4], 3).tokens == []
    assert propose(NgramDrafter(), [1, 2, 3, 1, 2], 0).tokens == []
    with pytest.raises(ValueError):
        NgramDrafter(max_ngram=1, min_ngram=2)


@pytest.mark.parametrize("branches", [1, 3])
def test_ngram_copy_runs_on_over_a_repeating_suffix(branches):
    """A run or a repeated pattern matches its latest occurrence, a period back: the
    draft goes on repeating it for all k tokens (it used to stop at the context's
    end, proposing one token of a run)."""
    for ctx, want in (([0, 7] + [32] * 40, [32] * 8), ([1, 2] * 10, [1, 2] * 4),
                      ([9, 4, 5, 6, 4, 5, 6], [4, 5, 6, 4, 5, 6, 4, 5])):
        d = propose(NgramDrafter(branches=branches), ctx, 8)
        assert d.chain().tokens == want


def test_ngram_contexts_as_arrays_give_the_lists_tokens():
    ctx = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 1, 4, 1, 5]
    drafts = {}
    for kind in (list, np.array):
        d = NgramDrafter()
        d.start([kind(ctx)], [Sampling()])
        first = d.propose([kind(ctx)], [4], [Sampling()])[0].tokens
        later = ctx + first[:2] + [7]  # two accepted, then the target parts (a resync)
        drafts[kind] = first, d.propose([kind(later)], [4], [Sampling()])[0].tokens
        assert all(type(t) is int for t in drafts[kind][0] + drafts[kind][1])
    assert drafts[list] == drafts[np.array] and drafts[list][0] == [9, 2, 6, 5]


def test_ngram_calls_are_checked():
    d = NgramDrafter()
    with pytest.raises(RuntimeError, match="start"):
        d.propose([[1, 2, 1]], [2], [Sampling()])
    d.start([[1, 2, 1], [3, 3]], [Sampling()] * 2)
    for ks, error, what in (([2], ValueError, "1 ks for a batch of 2"),
                            ([2, -1], ValueError, r"ks\[1\] must be >= 0"),
                            ([2.5, 1], TypeError, r"ks\[0\] must be an int")):
        with pytest.raises(error, match=what):
            d.propose([[1, 2, 1], [3, 3]], ks, [Sampling()] * 2)
    with pytest.raises(ValueError, match="1 contexts for a batch of 2"):
        d.propose([[1, 2, 1]], [2], [Sampling()])
    with pytest.raises(ValueError, match=r"lengths\[0\] must be >= 0"):
        d.rollback([-5, 2])


def test_ngram_index_grows_incrementally_and_selects_rows():
    d = NgramDrafter()
    ctxs = [[1, 2, 3, 1, 2], [4, 5, 4, 5, 4, 5]]
    d.start(ctxs, [Sampling()] * 2)
    assert [p.tokens for p in d.propose(ctxs, [2, 2], [Sampling()] * 2)] == [[3, 1], [4, 5]]
    ctxs[0] += [9, 1, 2]
    assert d.propose(ctxs, [1, 0], [Sampling()] * 2)[0].tokens == [3]  # the earliest (1, 2)
    ctxs[0] += [9]
    assert d.propose(ctxs, [2, 0], [Sampling()] * 2)[0].tokens == [1, 2]  # (2, 9) grew in
    d.select([1])
    # the match (4, 5, 4, 5) ends 2 back: the copy runs on over what it copied
    assert d.propose(ctxs[1:], [3], [Sampling()])[0].tokens == [4, 5, 4]


def test_ngram_tree_leads_with_the_source_a_chain_resumes():
    """Where only one-token matches are left, a tree follows the course a chain
    would resume (it outweighs them together), so on a copy the target edits as it
    goes a tree of k nodes bets as the chain does."""
    src = [6, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    ctx = src + [50, 1, 2]
    tree = NgramDrafter(branches=4)
    tree.start([ctx], [Sampling()])
    assert tree.propose([ctx], [5], [Sampling()])[0].tokens == [3, 4, 5, 6, 7]
    ctx = ctx + [3, 4, 6]  # 3 and 4 accepted, the source's 5 skipped
    tree.rollback([len(ctx)])
    t = tree.propose([ctx], [6], [Sampling()])[0]
    assert t.tokens[:3] == [7, 8, 9] and t.parents[:3] == [-1, 0, 1]
    assert t.match == NgramDrafter.RESYNC_MATCH
    # without the tree's last draft there is no source to resume: (6,) matches at
    # 0 and 7, and the earliest leads
    fresh = propose(NgramDrafter(branches=4), ctx, 6)
    assert fresh.tokens[0] == 0 and fresh.match == 1


def test_ngram_chain_resumes_its_source_after_the_target_skips_tokens():
    src = [6, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    ctx = src + [50, 1, 2]
    d = NgramDrafter()
    d.start([ctx], [Sampling()])
    assert d.propose([ctx], [5], [Sampling()])[0].tokens == [3, 4, 5, 6, 7]
    # the target accepts 3, 4, then skips the source's 5 and emits 6
    ctx = ctx + [3, 4, 6]
    d.rollback([len(ctx)])
    resumed = d.propose([ctx], [3], [Sampling()])[0]
    assert resumed.tokens == [7, 8, 9] and resumed.match >= 2
    # the first drafted token rejected: the decoder keeps old + 0 tokens of the
    # draft, and the copy still resumes where the target's token is in the source
    d.start([src + [50, 1, 2]], [Sampling()])
    d.propose([src + [50, 1, 2]], [5], [Sampling()])
    d.rollback([len(src) + 3])
    assert d.propose([src + [50, 1, 2, 6]], [3], [Sampling()])[0].tokens == [7, 8, 9]
    # without the chain, (6,) matches one token back at 0 and 7: the earliest wins
    assert propose(NgramDrafter(), ctx, 3).tokens == [0, 1, 2]
    assert propose(NgramDrafter(resync=-1), ctx, 3).tokens == [0, 1, 2]
    # a token not a few tokens ahead: after one accepted token the lookup decides,
    # after two or more the token was inserted and the copy goes on where it broke
    for accepted, expect in (([3], [1, 2]), ([3, 4], [5, 6])):
        d.start([src + [50, 1, 2]], [Sampling()])
        d.propose([src + [50, 1, 2]], [5], [Sampling()])
        ctx = src + [50, 1, 2] + accepted + [0]
        assert d.propose([ctx], [2], [Sampling()])[0].tokens == expect
    # a two-token match outranks the chain's source
    ctx = [4, 6, 30, 31, 1, 2, 3, 4, 5, 6, 7, 8, 50, 1, 2]
    d.start([ctx], [Sampling()])
    d.propose([ctx], [4], [Sampling()])
    ctx = ctx + [3, 4, 6]
    assert d.propose([ctx], [2], [Sampling()])[0].tokens == [30, 31]


def test_draft_seed_is_shared_only_in_coupled_mode():
    assert draft_seed(7, "coupled") == 7
    assert draft_seed(7, "rejection") != 7


def test_model_drafter_reports_the_distribution_it_sampled():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from test_decoder import tiny_model

    from specfast.drafters import ModelDrafter

    torch.set_num_threads(1)
    m = tiny_model(vocab=32, seed=5)
    d = ModelDrafter(m)
    ctx = [1, 2, 3]
    s = Sampling(temperature=1.0, seed=3, method="rejection")
    d.start([ctx], [s])
    out = d.propose([ctx], [3], [s])[0]
    assert len(out.tokens) == 3 and out.probs.shape == (3, 32)
    np.testing.assert_allclose(out.probs.sum(axis=1), 1.0, atol=1e-5)
    # the first token: specfast.sample of the draft logits at position 3, drafting seed
    with torch.inference_mode():
        logits = m.model(input_ids=torch.tensor([ctx])).logits[0, -1:].float().numpy()
    np.testing.assert_allclose(out.probs[0], specfast.probs(logits, temperature=1.0)[0], atol=1e-6)
    assert out.tokens[0] == int(specfast.sample(logits, temperature=1.0, seed=draft_seed(3, "rejection"),
                                                position=3)[0])
    # coupled: the drafter's token is the target's own Gumbel-max token when models agree
    c = Sampling(temperature=1.0, seed=3, method="coupled")
    d.start([ctx], [c])
    first = d.propose([ctx], [1], [c])[0]
    assert first.probs is None  # coupled verification needs no q
    assert first.tokens[0] == int(specfast.sample(logits, temperature=1.0, seed=3, position=3,
                                                  method="coupled")[0])
    # rollback keeps the verified prefix; the next proposal continues from it
    d.rollback([3])
    again = d.propose([ctx + [first.tokens[0]]], [2], [c])[0]
    want, prefix = [], ctx + [first.tokens[0]]
    for _ in range(2):  # the coupled token at each next position, by full forwards
        with torch.inference_mode():
            lg = m.model(input_ids=torch.tensor([prefix])).logits[0, -1:].float().numpy()
        want.append(int(specfast.sample(lg, temperature=1.0, seed=3, position=len(prefix),
                                        method="coupled")[0]))
        prefix = prefix + want[-1:]
    assert again.tokens == want
    assert d.memory()["params"] > 0


def test_ngram_rollback_forgets_rejected_tokens():
    """After drafting over unverified tokens and rolling back, the index is the
    one built from the verified context alone."""
    rng = np.random.default_rng(1)
    for _ in range(50):
        ctx = rng.integers(0, 5, size=int(rng.integers(3, 40))).tolist()
        extra = rng.integers(0, 5, size=int(rng.integers(1, 10))).tolist()
        d = NgramDrafter(max_ngram=3)
        d.start([ctx], [Sampling()])
        d.propose([ctx + extra], [4], [Sampling()])  # indexes the unverified tokens
        d.rollback([len(ctx)])
        fresh = NgramDrafter(max_ngram=3)
        fresh.start([ctx], [Sampling()])
        nxt = ctx + rng.integers(0, 5, size=3).tolist()
        assert d.propose([nxt], [5], [Sampling()]) == fresh.propose([nxt], [5], [Sampling()])
        assert d._index[0] == fresh._index[0]


@pytest.mark.parametrize("branches", [1, 3], ids=["chain", "tree"])
def test_ngram_drafts_after_a_look_ahead_as_without_it(branches):
    """A server drafting ahead proposes on an assumed context (its draft accepted
    whole) and then rolls back to what the target kept. The source a chain copies
    came back with it: it was forgotten, so after a partial acceptance the next
    draft lost its resync (46 target steps became 75 on a rewrite)."""
    rng = np.random.default_rng(7)
    src = rng.integers(0, 12, size=80).tolist()  # ids recur: one token back is ambiguous
    rewrite = [t for j, t in enumerate(src) if j % 7 != 3]  # the target drops a token now and then
    prompt = src + [45]

    def run(lookahead):
        d = NgramDrafter(branches=branches)
        ctx, drafts = prompt + rewrite[:1], []
        d.start([ctx], [Sampling()])
        while len(ctx) - len(prompt) < len(rewrite):
            draft = d.propose([ctx], [4], [Sampling()])[0]
            drafts.append(draft.tokens)
            want = rewrite[len(ctx) - len(prompt):]
            n = 0  # greedy acceptance of the chain (a tree's first path)
            while n < min(len(draft.tokens), len(want) - 1) and draft.tokens[n] == want[n] \
                    and (draft.parents is None or draft.parents[n] == n - 1):
                n += 1
            if lookahead:
                d.propose([ctx + draft.tokens], [5], [Sampling()])
            d.rollback([len(ctx) + n])
            ctx = ctx + want[:n + 1]
        return drafts

    assert run(lookahead=True) == run(lookahead=False)


@pytest.mark.parametrize("spec", ["ngram:x", "ngram:0", "ngram:"])
def test_make_refuses_a_bad_ngram_spec(spec):
    from specfast.drafters import make

    with pytest.raises(ValueError, match="ngram:N"):
        make(spec)


def test_ngram_candidates_are_the_first_and_last_occurrences():
    """With more occurrences than ``candidates``, the lookup weighs the first and
    the last ones: a rewrite's source comes first, the text just written last.
    Here only the last occurrence of (1, 2, 3) also matches the 8 before it."""
    ctx = [9, 1, 2, 3, 10, 5, 1, 2, 3, 11, 6, 1, 2, 3, 12, 8, 1, 2, 3, 13, 8, 1, 2, 3]
    for c in (1, 2, 3, 32):  # one candidate: the last occurrence
        d = propose(NgramDrafter(candidates=c), ctx, 3)
        assert d.tokens == [13, 8, 1] and d.match == 4, c
    # the trees' lookup samples the same: the longest match leads
    tree = propose(NgramDrafter(candidates=2, branches=2), ctx, 3)
    assert tree.tokens[0] == 13 and tree.match == 4


def test_ngram_select_keeps_each_rows_copy():
    """After select, a row resumes its own chain's source (the resync), as a
    drafter started on that row alone does: the source of the dropped row would
    send it to the first occurrence of its last token."""
    src = [6, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    rows = [[1, 2, 3, 4, 1, 2], src + [50, 1, 2]]
    later = rows[1] + [3, 4, 6]  # 3 and 4 accepted, the source's 5 skipped

    def drafts(d, start_rows, keep):
        d.start(start_rows, [Sampling()] * len(start_rows))
        first = d.propose(start_rows, [5] * len(start_rows), [Sampling()] * len(start_rows))
        d.rollback([len(r) for r in start_rows[:-1]] + [len(later)])
        if keep is not None:
            d.select(keep)
        return first[-1].tokens, d.propose([later], [3], [Sampling()])[0]

    first, both = drafts(NgramDrafter(), rows, [1])
    assert first == [3, 4, 5, 6, 7]
    alone = drafts(NgramDrafter(), rows[1:], None)[1]
    assert both == alone and both.tokens == [7, 8, 9] and both.match == NgramDrafter.RESYNC_MATCH
    # the tree drafter resumes the same source after select
    first, tree = drafts(NgramDrafter(branches=3), rows, [1])
    assert tree == drafts(NgramDrafter(branches=3), rows[1:], None)[1]
    assert tree.tokens[:3] == [7, 8, 9] and tree.match == NgramDrafter.RESYNC_MATCH


def test_make_ngram_takes_its_longest_ngram():
    """"ngram:N" sets max_ngram to N, which decides where many short matches hide
    a longer one: (1, 2, 3) occurs 40 times, too many to weigh them all (the first
    and last 16 are), and only the 20th follows a 7 as the suffix does."""
    from specfast.drafters import make

    assert make("ngram").max_ngram == 3 and make("ngram:4").max_ngram == 4
    assert make("ngram:1").max_ngram == 1 and make("ngram:4").min_ngram == 1
    ctx = []
    for j in range(40):
        ctx += [7 if j == 19 else 20, 1, 2, 3, 100 + j]
    ctx += [7, 1, 2, 3]
    four = propose(make("ngram:4"), ctx, 2)
    assert four.tokens == [119, 20] and four.match == 4
    three = propose(make("ngram"), ctx, 2)
    assert three.tokens == [100, 20] and three.match == 3
