"""Drafters: what proposes the tokens the target verifies.

A drafter implements :class:`Drafter`. The decoder calls ``start`` once per
generation with the prompts, ``propose`` once per step with the number of
tokens it wants per request, and ``rollback`` after verification with how
many tokens of each context survived. A drafter reports the distribution each
token was drawn from (``Draft.probs``): None for deterministic drafts (n-gram
lookup, greedy), a dense ``(k, V)`` array or a :class:`specfast.SparseProbs`
otherwise, so that verification stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _api

# Rejection mode must not reuse the verifier's random stream for drafting
# (a draft correlated with its own acceptance test biases the output); coupled
# mode must reuse it (that is what makes the drafter agree with the target).
_DRAFT_SEED_SALT = 0x9E3779B97F4A7C15


def check_arg(owner: str, name: str, value, lo: float, hi: float = float("inf"), *,
              integer: bool = False, open_lo: bool = False):
    """``value`` if it is a finite number in [lo, hi] ((lo, hi] with ``open_lo``; an
    int with ``integer``), else a TypeError / ValueError naming ``owner``'s ``name``:
    a bad setting fails where it is given, not steps into a generation."""
    kinds = (int, np.integer) if integer else (int, float, np.integer, np.floating)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise TypeError(f"{owner}: {name} must be {'an int' if integer else 'a number'}, "
                        f"got {value!r}")
    finite = isinstance(value, (int, np.integer)) or np.isfinite(value)  # ints past float64 too
    if not ((lo < value if open_lo else lo <= value) and value <= hi and finite):
        span = (f"in {'(' if open_lo else '['}{lo}, {hi}]" if hi != float("inf") else
                f"{'' if integer else 'finite and '}{'>' if open_lo else '>='} {lo}")
        raise ValueError(f"{owner}: {name} must be {span}, got {value!r}")
    return value


def check_calls(owner: str, batch, contexts, values, name: str) -> None:
    """A RuntimeError before ``start`` (``batch`` None), else a TypeError /
    ValueError unless ``values`` holds one int >= 0 per request of the batch
    (``contexts``, when given, as many)."""
    if batch is None:
        raise RuntimeError(f"{owner}: call start before propose or rollback")
    if contexts is not None and len(contexts) != batch:
        raise ValueError(f"{owner}: {len(contexts)} contexts for a batch of {batch} "
                         "(start, less the requests select dropped)")
    if len(values) != batch:
        raise ValueError(f"{owner}: {len(values)} {name} for a batch of {batch}")
    for i, v in enumerate(values):
        check_arg(owner, f"{name}[{i}]", v, 0, integer=True)


def draft_seed(seed: int, method: str) -> int:
    """The seed a drafter samples with: the target's own in coupled mode, an
    independent one in rejection mode."""
    if method == "coupled":
        return seed
    return (seed ^ _DRAFT_SEED_SALT) & ((1 << 64) - 1)


@dataclass
class Sampling:
    """Sampling parameters of one request (the target's; drafters share them)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    method: str = "coupled"


@dataclass
class Draft:
    """A draft chain or tree for one request.

    tokens : list of int, at most the k asked for (may be empty)
    probs : None (deterministic drafts), ``(len(tokens), V)`` float32, or SparseProbs
    match : int
        A confidence signal for the draft-length controller: for lookup drafts,
        how many context tokens the match covers (0 when unknown).
    parents : None (a chain) or, per node, the index of its parent node (-1:
        the last context token), parents first. Nodes come best first, so that
        the first k nodes are the best tree of k.
    """

    tokens: list
    probs: object = None
    match: int = 0
    parents: list | None = None

    def head(self, k: int) -> "Draft":
        """The first k nodes (a tree's nodes come best first, parents first)."""
        if len(self.tokens) <= k:
            return self
        if k <= 0:
            return Draft([], None, self.match)
        parents = None if self.parents is None else list(self.parents[:k])
        return Draft(list(self.tokens[:k]), _rows(self.probs, slice(0, k)), self.match, parents)

    def chain(self) -> "Draft":
        """A tree's first root-to-leaf path (each node's first child: its best,
        a plain draw from q where the tree is sampled), as a chain."""
        if self.parents is None:
            return self
        path = []
        for i, p in enumerate(self.parents):
            if p == (path[-1] if path else -1):
                path.append(i)
        return Draft([self.tokens[i] for i in path], _rows(self.probs, path), self.match)

    def tail(self) -> "Draft":
        """A chain without its first token."""
        return Draft(list(self.tokens[1:]), _rows(self.probs, slice(1, None)), self.match)


def _rows(probs, sl):
    """Rows ``sl`` of a draft's q (None, dense or SparseProbs)."""
    if isinstance(probs, _api.SparseProbs):
        return _api.SparseProbs(probs.indices[sl], probs.values[sl])
    return None if probs is None else probs[sl]


class Drafter:
    """The drafter interface.

    ``deterministic`` tells the decoder whether ``Draft.probs`` is always None.
    ``cheap`` says proposing costs next to nothing whatever the length: the
    decoder then asks for the longest useful draft first and lets the draft
    length controller cut it, knowing the draft (and its ``match``).
    ``stalled`` is true when the last ``propose`` first waited on a fault (a
    remote drafter's timeout or reconnection): its time says nothing of what
    drafting costs, and the draft length controller leaves it out.
    """

    name = "drafter"
    deterministic = True
    cheap = False
    stalled = False

    def start(self, contexts: list, sampling: list) -> None:
        """A new generation of ``len(contexts)`` requests with these prompt ids."""

    def propose(self, contexts: list, ks: list, sampling: list) -> list:
        """Drafts up to ``ks[i]`` tokens after ``contexts[i]`` (the full token list,
        prompt and generated); returns one :class:`Draft` per request. The next
        draft token of request i sits at absolute position ``len(contexts[i])``."""
        raise NotImplementedError

    def rollback(self, lengths: list) -> None:
        """The first ``lengths[i]`` tokens of context i are verified and agree with
        what was proposed; anything the drafter holds beyond them was rejected."""

    def select(self, rows: list) -> None:
        """Keep only these requests (indices into the current batch), in this
        order: the others finished."""

    def finish(self) -> None:
        """The generation is over (also after an error): release what ``start``
        took (a remote drafter's session)."""

    def memory(self) -> dict:
        """Bytes the drafter holds: ``{"params": ..., "kv": ..., "kv_peak": ...}``."""
        return {"params": 0, "kv": 0, "kv_peak": 0}


class NgramDrafter(Drafter):
    """Prompt lookup: find earlier occurrences of the context's last n tokens
    (n from ``max_ngram`` down to ``min_ngram``) and propose what followed.

    Among the occurrences of the longest matching n-gram it takes the one whose
    match extends furthest back (up to ``max_match`` tokens: the most specific
    context), the earliest on ties (as transformers' prompt lookup: in a rewrite
    the source comes first and its continuation is the longest), and proposes
    up to k tokens of its continuation. ``Draft.match`` is the matched length,
    which the draft length controller uses as the draft's confidence.

    A chain also follows its source (:meth:`resync`). When the target parts
    from a copy (a rewrite that wraps a line differently, drops a word) and the
    context's suffix then matches only one token back, the draft resumes the
    source where the target's token reappears a few tokens ahead of where the
    copy broke (at most ``resync`` tokens ahead; -1 turns this off), or where
    the copy broke if the token looks inserted, instead of at that token's
    first occurrence anywhere.
    ``Draft.match`` is ``RESYNC_MATCH`` for such a draft.

    With ``branches > 1`` it drafts a tree instead (:meth:`tree`): the
    continuations of several earlier occurrences merged, so that when the best
    match goes wrong a sibling may still be right.

    Model-free and deterministic; an index of n-gram -> end positions is
    updated incrementally, so a lookup costs O(new tokens + candidates *
    match length).

    Examples
    --------
    >>> d = NgramDrafter()
    >>> d.start([[1, 2, 3, 4, 1, 2]], [Sampling()])
    >>> d.propose([[1, 2, 3, 4, 1, 2]], [3], [Sampling()])[0].tokens
    [3, 4, 1]
    """

    name = "ngram"
    cheap = True
    # A resumed source is priced as a 2-token match: one token agreed, where the
    # copy said it would (a 0, "unknown", drafted long resyncs that failed).
    RESYNC_MATCH = 2

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, candidates: int = 32,
                 max_match: int = 64, branches: int = 1, decay: float = 0.9,
                 resync: int = 4):
        for name, v, lo in (("max_ngram", max_ngram, 1), ("min_ngram", min_ngram, 1),
                            ("candidates", candidates, 1), ("max_match", max_match, 1),
                            ("branches", branches, 1), ("resync", resync, -1)):
            check_arg("NgramDrafter", name, v, lo, integer=True)
        if min_ngram > max_ngram:
            raise ValueError("NgramDrafter: need min_ngram <= max_ngram")
        check_arg("NgramDrafter", "decay", decay, 0.0, 1.0, open_lo=True)
        if decay == 1.0:
            raise ValueError("NgramDrafter: decay must be in (0, 1), got 1.0")
        self.max_ngram, self.min_ngram, self.candidates = max_ngram, min_ngram, candidates
        self.max_match = max(max_match, max_ngram)
        self.branches, self.decay = branches, decay
        self.resync_window = resync
        if branches > 1:
            self.name = f"ngram-tree{branches}"
        self._index: list | None = None  # per request, from start
        self._indexed: list = []  # n-grams ending before this position are indexed
        self._tokens: list = []  # the tokens they were read from
        # (source start or -1, context length) of the last chain, after the one
        # drafted before it at a shorter context: a rollback past the last (a
        # server's look-ahead, drafted after unverified tokens) returns to it
        self._copy: list = []

    def start(self, contexts, sampling):
        self._index = [{} for _ in contexts]
        self._indexed = [0 for _ in contexts]
        self._tokens = [[] for _ in contexts]
        self._copy = [[] for _ in contexts]

    def _set_copy(self, i, start, n):
        self._copy[i] = [c for c in self._copy[i] if c[1] < n][-1:] + [(start, n)]

    def _keys(self, toks, e):
        """The indexed n-grams ending at position e."""
        return [tuple(toks[e - n + 1:e + 1])
                for n in range(self.min_ngram, min(self.max_ngram, e + 1) + 1)]

    def _sample(self, ends):
        """At most ``candidates`` of a n-gram's end positions: the first and last halves."""
        c = self.candidates
        return ends if len(ends) <= c else ends[:c // 2] + ends[-(c - c // 2):]

    def _update(self, i, ctx):
        # index n-grams ending at positions < len(ctx) - 1 (never the suffix itself)
        index, end = self._index[i], len(ctx) - 1
        for e in range(max(self._indexed[i], self.min_ngram - 1), end):
            for key in self._keys(ctx, e):
                index.setdefault(key, []).append(e)
        if end > self._indexed[i]:
            self._tokens[i].extend(ctx[len(self._tokens[i]):end])
            self._indexed[i] = end

    def _batch(self):
        return None if self._index is None else len(self._index)

    def rollback(self, lengths):
        """Forgets n-grams past the first ``lengths[i]`` tokens (a server drafting
        ahead indexes tokens that verification may reject)."""
        check_calls("NgramDrafter", self._batch(), None, lengths, "lengths")
        for i, n_keep in enumerate(lengths):
            keep = max(0, min(self._indexed[i], n_keep - 1))
            toks, index = self._tokens[i], self._index[i]
            for e in range(self._indexed[i] - 1, keep - 1, -1):  # newest first
                for key in self._keys(toks, e):
                    ends = index[key]
                    ends.pop()
                    if not ends:
                        del index[key]
            del toks[keep:]
            self._indexed[i] = keep
            # a copy drafted after unverified tokens (a look-ahead) is forgotten
            self._copy[i] = [c for c in self._copy[i] if c[1] <= n_keep]

    def lookup(self, i, ctx):
        """(end position of the chosen match, matched length), or (-1, 0)."""
        last = len(ctx) - 1
        for n in range(min(self.max_ngram, last), self.min_ngram - 1, -1):
            ends = self._index[i].get(tuple(ctx[-n:]))
            if not ends:
                continue
            best, best_len = -1, -1
            for e in self._sample(ends):  # ascending: strict > keeps the earliest on ties
                j = self._extend(ctx, e, n)
                if j > best_len:
                    best, best_len = e, j
                    if j >= self.max_match:
                        break
            return best, best_len
        return -1, 0

    @staticmethod
    def _continuation(ctx, start, k):
        """k tokens copied from ``ctx[start:]`` on, the copy running on past the
        context's end over what it has copied (as LZ77 copies an overlapping
        match): a suffix that matched d tokens back says the text repeats with
        period d, so a run or a repeated line drafts k tokens, not d."""
        out = [int(t) for t in ctx[start:start + k]]
        n = len(ctx)
        while len(out) < k and start < n:
            out.append(out[start + len(out) - n])
        return out

    def _extend(self, ctx, e, n):
        """How far the match of the suffix ending at e reaches back (n known)."""
        last, cap = len(ctx) - 1, self.max_match
        while n < cap and n <= e and ctx[e - n] == ctx[last - n]:
            n += 1
        return n

    def resync(self, i, ctx):
        """Where the last chain's source continues, or -1.

        That chain copied ``ctx[s:]`` after a context of length L, and the
        target then accepted a tokens of it and emitted ``ctx[-1]`` where the
        source has ``ctx[s + a]``. If they agree the copy goes on at s + a + 1;
        if the target's token appears in the next ``resync`` tokens of the
        source, the target skipped the tokens before it (a line wrapped
        differently, a word dropped) and the copy goes on after it; otherwise,
        if the copy was running (two or more tokens accepted), the target
        inserted its token and the copy goes on at s + a.
        """
        if not self._copy[i] or self._copy[i][-1][0] < 0:
            return -1
        s, n = self._copy[i][-1]
        a = len(ctx) - 1 - n
        p = s + a
        if a < 0 or p >= n or list(ctx[n:n + a]) != list(ctx[s:p]):
            return -1  # not what the chain proposed
        last = ctx[-1]
        for q in range(p, min(p + 1 + self.resync_window, n)):
            if ctx[q] == last:
                return q + 1
        return p if a >= 2 and self.resync_window >= 0 else -1

    def matches(self, i, ctx):
        """Earlier occurrences of the context's suffix, best first: (end, matched
        length) pairs, from the longest n-gram down until ``branches`` distinct
        next tokens are found."""
        last, found, firsts = len(ctx) - 1, {}, set()
        for n in range(min(self.max_ngram, last), self.min_ngram - 1, -1):
            ends = self._index[i].get(tuple(ctx[-n:]))
            if not ends:
                continue
            for e in self._sample(ends):
                if e not in found:
                    found[e] = self._extend(ctx, e, n)
                    firsts.add(ctx[e + 1])
            if len(firsts) >= self.branches:
                break
        return sorted(found.items(), key=lambda m: (-m[1], m[0]))

    def tree(self, i, ctx, k):
        """A draft tree of at most k nodes merging the continuations of
        :meth:`matches`.

        A continuation weighs its matched length squared (a longer match is a
        much better bet, as the chain's choice of the longest match assumes);
        a node's score is the share
        of weight whose continuation passes through it times ``decay ** depth``
        (deeper tokens are less likely to survive), the n-gram analogue of
        EAGLE-2's path confidence. The k best nodes form a tree (a child scores
        below its parent), listed best first.
        """
        found = self.matches(i, ctx)
        weights = [j * j for _, j in found]
        match = found[0][1] if found else 0
        if not found or found[0][1] < 2:
            # a weak clue: the source's course leads, as it does a chain (more
            # than the other continuations together)
            r = self.resync(i, ctx)
            if r >= 0:
                rest = [(m, w) for m, w in zip(found, weights) if m[0] != r - 1]
                found = [(r - 1, self.RESYNC_MATCH)] + [m for m, _ in rest]
                weights = [sum(w for _, w in rest) + self.RESYNC_MATCH ** 2] + [w for _, w in rest]
                match = self.RESYNC_MATCH
        self._set_copy(i, found[0][0] + 1 if found else -1, len(ctx))
        if not found:
            return Draft([])
        nodes, weight, children = [], [], {}  # node: (token, parent, depth)
        for (e, _), w_e in zip(found, weights):
            parent = -1
            for depth, tok in enumerate(self._continuation(ctx, e + 1, k)):
                node = children.get((parent, tok))
                if node is None:
                    node = children[(parent, tok)] = len(nodes)
                    nodes.append((tok, parent, depth))
                    weight.append(0)
                weight[node] += w_e
                parent = node
        scale = 1.0 / sum(weights)
        tokens, parents, depths = zip(*nodes)
        score = [w * scale * self.decay ** d for w, d in zip(weight, depths)]
        return _best_tree(tokens, parents, score, depths, k, match)

    def propose(self, contexts, ks, sampling):
        check_calls("NgramDrafter", self._batch(), contexts, ks, "ks")
        out = []
        for i, (ctx, k) in enumerate(zip(contexts, ks)):
            if k > 0 and len(ctx) > self.min_ngram:
                self._update(i, ctx)
                if self.branches > 1:
                    out.append(self.tree(i, ctx, k))
                    continue
                e, n = self.lookup(i, ctx)
                start = e + 1 if e >= 0 else -1
                if n < 2:  # one token back is a weak clue: prefer the source's course
                    r = self.resync(i, ctx)
                    if r >= 0:
                        start, n = r, self.RESYNC_MATCH
                tokens = self._continuation(ctx, start, k) if start >= 0 else []
                self._set_copy(i, start if tokens else -1, len(ctx))
                if tokens:
                    out.append(Draft(tokens, None, n))
                    continue
            out.append(Draft([]))
        return out

    def select(self, rows):
        self._index = [self._index[r] for r in rows]
        self._indexed = [self._indexed[r] for r in rows]
        self._tokens = [self._tokens[r] for r in rows]
        self._copy = [self._copy[r] for r in rows]


class ModelDrafter(Drafter):
    """A smaller language model (any adapter) drafting autoregressively.

    Each drafted token is sampled with :func:`specfast.sample` from
    :func:`specfast.probs` of the draft logits under the request's sampling
    parameters, at its absolute position, so the reported q is exactly the
    distribution it was drawn from; in coupled mode it uses the request's own
    seed. ``p_min`` stops a chain early when the draft's probability of its own
    token falls below it (llama.cpp's ``--draft-p-min``; for a greedy request,
    its probability at temperature 1).

    With ``branches > 1`` it drafts a tree of k nodes instead (:meth:`tree`).

    The draft model must share the target's tokenizer (same vocabulary ids).
    """

    deterministic = False

    def __init__(self, model, *, p_min: float = 0.0, sparse_top: int = 0, branches: int = 1):
        check_arg("ModelDrafter", "branches", branches, 1, integer=True)
        check_arg("ModelDrafter", "sparse_top", sparse_top, 0, integer=True)
        check_arg("ModelDrafter", "p_min", p_min, 0.0, 1.0)
        if branches > 1 and not hasattr(model, "keep_paths"):
            raise ValueError(f"{type(model).__name__} runs chains only: trees need branches=1")
        self.model = model
        self.p_min = p_min
        self.sparse_top = sparse_top
        self.branches = branches
        self.name = f"model:{getattr(model, 'name', type(model).__name__)}"
        if branches > 1:
            self.name += f":tree{branches}"
        self._state = None
        self._fed: list = []
        self._peak = 0

    def start(self, contexts, sampling):
        self._state = self.model.new_state(len(contexts))
        self._fed = [0] * len(contexts)
        self._peak = 0  # memory() reports the generation's own peak, as the target's

    def _batch(self):
        return None if self._state is None else len(self._fed)

    def propose(self, contexts, ks, sampling):
        check_calls("ModelDrafter", self._batch(), contexts, ks, "ks")
        m = self.model
        batch = len(contexts)
        limit = getattr(m, "max_positions", None)
        if limit is not None:  # a draft model with fewer learned positions than
            # the target stops drafting there (the deepest token fed sits at
            # len(context) + k - 2); the target decodes on
            ks = [min(k, max(0, limit + 1 - len(c))) for c, k in zip(contexts, ks)]
        live = [i for i in range(batch) if ks[i] > 0]
        drafts = [Draft([], None) for _ in range(batch)]
        if not live:
            return drafts
        # A row needs a token to feed for its next logits: one whose state holds
        # its whole context (no rollback since the last draft) re-feeds the last.
        if any(self._fed[i] >= len(contexts[i]) for i in live):
            self.rollback([len(c) - 1 if k > 0 else f
                           for c, k, f in zip(contexts, ks, self._fed)])
        # catch up: feed each live row the verified tokens it has not seen
        feed = [list(contexts[i][self._fed[i]:]) if ks[i] > 0 else [] for i in range(batch)]
        logits = m.forward(self._state, feed, all_logits=False)
        for i in live:
            self._fed[i] = len(contexts[i])
        if self.branches > 1:
            return self.tree(contexts, ks, sampling, {i: logits[i][-1] for i in live})
        rows = {i: [] for i in live}
        qs = {i: [] for i in live}
        active = list(live)
        depth = 0
        while active:
            lg = _np_logits([logits[i][-1] for i in active])
            s = [sampling[i] for i in active]
            kw = self._filters(s)
            q = _api.probs(lg, **kw)
            # p_min reads the draft's own confidence: a greedy q is one-hot
            ckw = _confidence(kw)
            conf = _api.probs(lg, **ckw) if self.p_min > 0 and ckw is not kw else q
            tok = _api.sample(lg, **kw, seed=np.array([draft_seed(x.seed, x.method) for x in s],
                                                     np.uint64),
                              position=np.array([len(contexts[i]) + depth for i in active]),
                              method=s[0].method)
            nxt = []
            for j, i in enumerate(active):
                t = int(tok[j])
                rows[i].append(t)
                qs[i].append(q[j])
                if len(rows[i]) < ks[i] and conf[j, t] >= self.p_min:
                    nxt.append(i)
            depth += 1
            active = nxt
            if active:
                feed = [[rows[i][-1]] if i in active else [] for i in range(batch)]
                logits = m.forward(self._state, feed, all_logits=False)
                for i in active:
                    self._fed[i] += 1
        for i in live:
            drafts[i] = Draft(rows[i], self._report(np.stack(qs[i]), rows[i], sampling[i]))
        self._peak = max(self._peak, m.kv_bytes(self._state))
        return drafts

    def tree(self, contexts, ks, sampling, root_logits):
        """Draft trees of ``ks[i]`` nodes, grown level by level as in EAGLE-2:
        the ``branches`` best nodes of a level (by path confidence, the product
        of draft probabilities) each get ``branches`` children.

        Greedy and coupled requests take each node's children in the order of
        the key the target itself uses (probability, or probability with the
        request's Gumbel noise, the runner-ups after masking the winners), grow
        more nodes than asked and keep the k most confident (greedy ones by the
        draft's softmax at temperature 1): their q is never read (greedy
        verification takes q one-hot, coupled ignores it).
        Rejection-sampling requests draw the children of a node without
        replacement, each from the draft distribution with the earlier siblings
        masked out, on a stream of its own, and report that distribution; every
        drawn node is kept (dropping drawn nodes by their value would bias what
        verification sees), so the tree stops at k draws.

        The draft model runs the whole tree each level (a tree attention mask),
        then rolls back to the context.
        """
        m = self.model
        batch = len(contexts)
        live = sorted(root_logits)
        draws = {i: sampling[i].method == "rejection" and sampling[i].temperature > 0
                 for i in live}
        tok = {i: [] for i in live}
        par = {i: [] for i in live}
        dep = {i: [] for i in live}
        score = {i: [] for i in live}
        q = {i: [] for i in live}
        level = {i: [-1] for i in live}  # nodes whose children come next
        rows = {(i, -1): lg for i, lg in root_logits.items()}  # (i, node) -> logits
        deepest = max(ks[i] for i in live)
        for depth in range(deepest):
            # drawn trees stop at k draws; ranked ones at 2k candidates
            owners = [(i, n) for i in live for n in level[i]
                      if depth < ks[i] and len(tok[i]) < (1 if draws[i] else 2) * ks[i]]
            if not owners:
                break
            lg = _np_logits([rows[o] for o in owners]).copy()
            s = [sampling[i] for i, _ in owners]
            kw = self._filters(s)
            q0 = _api.probs(lg, **_confidence(kw))
            pos = np.array([len(contexts[i]) + depth for i, _ in owners], np.int64)
            born = {i: [] for i in live}
            for j in range(min(self.branches, lg.shape[1])):
                seeds = np.array([_sibling_seed(x, n, j) for x, (_, n) in zip(s, owners)],
                                 np.uint64)
                drawn = _api.sample(lg, **kw, seed=seeds, position=pos, method=s[0].method)
                qj = _api.probs(lg, **kw) if any(draws[i] for i, _ in owners) else None
                for r, (i, n) in enumerate(owners):
                    t = int(drawn[r])
                    sc = (1.0 if n < 0 else score[i][n]) * float(q0[r, t])
                    if draws[i]:
                        if len(tok[i]) >= ks[i]:
                            continue
                        q[i].append(qj[r])
                    elif sc <= 0.0:
                        continue
                    born[i].append(len(tok[i]))
                    tok[i].append(t)
                    par[i].append(n)
                    dep[i].append(depth)
                    score[i].append(sc)
                lg[np.arange(len(owners)), drawn] = -np.inf
            # rows whose new nodes get children (a row's nodes at its depth k - 1
            # are leaves: feeding them would pass a shorter draft model's positions)
            grow = [i for i in live if born[i] and depth + 1 < ks[i]]
            for i in live:  # the most confident of the new nodes grow next
                level[i] = sorted(born[i], key=lambda n: -score[i][n])[:self.branches]
            if depth + 1 < deepest and grow:
                # one forward over the paths to the nodes that grow next
                m.truncate(self._state, [len(c) - 1 for c in contexts])
                sub = {i: _subtree(par[i], level[i]) for i in grow}
                feed = [[contexts[i][-1]] + [tok[i][n] for n in sub[i][0]] if i in grow else []
                        for i in range(batch)]
                out = m.forward(self._state, feed, trees=[sub[i][1] if i in grow else None
                                                          for i in range(batch)])
                for i in grow:
                    at = {n: r for r, n in enumerate(sub[i][0])}
                    for n in level[i]:
                        rows[(i, n)] = out[i][1 + at[n]]
        self._fed = [min(f, len(c) - 1) for f, c in zip(self._fed, contexts)]
        m.truncate(self._state, self._fed)
        drafts = [Draft([], None) for _ in range(batch)]
        for i in live:
            if draws[i]:
                probs = self._report(np.stack(q[i]), tok[i], sampling[i]) if tok[i] else None
                drafts[i] = Draft(tok[i], probs, 0, par[i])
                continue
            drafts[i] = _best_tree(tok[i], par[i], score[i], dep[i], ks[i])
        self._peak = max(self._peak, m.kv_bytes(self._state))
        return drafts

    def _filters(self, s):
        """The draft distribution's parameters; with ``sparse_top`` K, the
        drafter draws from its K most probable tokens only, so that K ids and
        probabilities state q exactly."""
        top_k = np.array([x.top_k for x in s], np.int32)
        if self.sparse_top:
            top_k = np.where((top_k <= 0) | (top_k > self.sparse_top), self.sparse_top, top_k)
        return dict(temperature=np.array([x.temperature for x in s], np.float32), top_k=top_k,
                    top_p=np.array([x.top_p for x in s], np.float32),
                    min_p=np.array([x.min_p for x in s], np.float32))

    def _report(self, q, tokens, s):
        if s.method == "coupled" or s.temperature == 0:
            return None  # coupled verification ignores q; greedy q is one-hot
        if self.sparse_top:  # q has at most sparse_top nonzero entries (see _filters)
            k = min(self.sparse_top, q.shape[1])
            idx = np.argsort(-q, axis=1, kind="stable")[:, :k].astype(np.int32)
            vals = np.take_along_axis(q, idx, axis=1)
            idx[vals <= 0] = -1
            return _api.SparseProbs(idx, np.where(idx >= 0, vals, 0).astype(np.float32))
        return q

    def rollback(self, lengths):
        check_calls("ModelDrafter", self._batch(), None, lengths, "lengths")
        keep = [min(f, n) for f, n in zip(self._fed, lengths)]
        self.model.truncate(self._state, keep)
        self._fed = keep

    def select(self, rows):
        if self._state is not None:
            self.model.select(self._state, rows)
        self._fed = [self._fed[r] for r in rows]

    def memory(self):
        kv = self.model.kv_bytes(self._state) if self._state is not None else 0
        return {"params": self.model.param_bytes(), "kv": kv, "kv_peak": max(self._peak, kv)}


def _confidence(kw: dict) -> dict:
    """The parameters of the draft's confidence in its tokens (which ranks tree
    nodes and which p_min reads): its own distribution, ``kw`` itself, but a
    greedy request's is one-hot (every runner-up would score 0), so greedy rows
    take the unfiltered softmax (temperature 1), which orders tokens as the
    greedy target does."""
    greedy = kw["temperature"] == 0
    if not greedy.any():
        return kw
    return dict(temperature=np.where(greedy, np.float32(1), kw["temperature"]),
                top_k=np.where(greedy, np.int32(0), kw["top_k"]),
                top_p=np.where(greedy, np.float32(1), kw["top_p"]),
                min_p=np.where(greedy, np.float32(0), kw["min_p"]))


def _sibling_seed(s: Sampling, parent: int, j: int) -> int:
    """The seed of the j-th child of a tree node. Coupled and greedy drafting
    use the request's noise for every child (the runner-ups of the same race);
    rejection mode gives each draw a stream of its own."""
    seed = draft_seed(s.seed, s.method)
    if s.method == "coupled":
        return seed
    return (seed + (parent + 2) * 0xD1B54A32D192ED03 + j * 0x8CB92BA72F3D8DD7) & ((1 << 64) - 1)


def _subtree(parents, ends):
    """(nodes, their parents re-indexed): the nodes on the paths to ``ends``,
    parents first."""
    keep = set()
    for n in ends:
        while n >= 0 and n not in keep:
            keep.add(n)
            n = parents[n]
    nodes = sorted(keep)
    at = {n: r for r, n in enumerate(nodes)}
    return nodes, [at[parents[n]] if parents[n] >= 0 else -1 for n in nodes]


def _best_tree(tokens, parents, score, depth, k, match=0) -> Draft:
    """The k best nodes, shallower first on ties, listed best first with their
    parents re-indexed; a tree, since no child scores above its parent."""
    best = sorted(range(len(tokens)), key=lambda n: (-score[n], depth[n], n))[:k]
    local = {n: r for r, n in enumerate(best)}
    return Draft([tokens[n] for n in best], None, match,
                 [local[parents[n]] if parents[n] >= 0 else -1 for n in best])


def _np_logits(rows):
    """Stacks torch or numpy logits rows into one float32 numpy array."""
    first = rows[0]
    if type(first).__module__.split(".", 1)[0] == "torch":
        import torch

        return torch.stack(list(rows)).float().numpy()
    return np.stack([np.asarray(r, np.float32) for r in rows])


def is_ngram(spec: str) -> bool:
    """Whether a :func:`make` spec names the n-gram drafter (else a model path)."""
    return spec == "ngram" or spec.startswith("ngram:")


def make(spec: str, target=None, *, branches: int = 1, **kwargs) -> Drafter:
    """A drafter from a short spec: ``"ngram"``, ``"ngram:4"`` (max n-gram) or a
    model path (folder or ``.gguf``) loaded with the HF adapter; ``branches > 1``
    drafts trees."""
    if is_ngram(spec):
        n = spec.split(":", 1)[1] if ":" in spec else "3"
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"drafter {spec!r}: 'ngram:N' takes a longest n-gram N >= 1")
        n = int(n)
        return NgramDrafter(max_ngram=n, min_ngram=1, branches=branches)
    from .adapters import load

    return ModelDrafter(load(spec, **kwargs), branches=branches)


__all__ = ["Draft", "Drafter", "ModelDrafter", "NgramDrafter", "Sampling", "draft_seed", "is_ngram",
           "make"]
