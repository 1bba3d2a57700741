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
    """A draft chain for one request.

    tokens : list of int, at most the k asked for (may be empty)
    probs : None (deterministic drafts), ``(len(tokens), V)`` float32, or SparseProbs
    match : int
        A confidence signal for the draft-length controller: for lookup drafts,
        how many context tokens the match covers (0 when unknown).
    """

    tokens: list
    probs: object = None
    match: int = 0


class Drafter:
    """The drafter interface.

    ``deterministic`` tells the decoder whether ``Draft.probs`` is always None.
    ``cheap`` says proposing costs next to nothing whatever the length: the
    decoder then asks for the longest useful draft first and lets the draft
    length controller cut it, knowing the draft (and its ``match``).
    """

    name = "drafter"
    deterministic = True
    cheap = False

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

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, candidates: int = 32,
                 max_match: int = 64):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram, self.candidates = max_ngram, min_ngram, candidates
        self.max_match = max(max_match, max_ngram)
        self._index: list = []
        self._indexed: list = []

    def start(self, contexts, sampling):
        self._index = [{} for _ in contexts]
        self._indexed = [0 for _ in contexts]

    def _update(self, i, ctx):
        # index n-grams ending at positions < len(ctx) - 1 (never the suffix itself);
        # the context only ever holds verified tokens, so entries never go stale
        index, end = self._index[i], len(ctx) - 1
        for e in range(max(self._indexed[i], self.min_ngram - 1), end):
            for n in range(self.min_ngram, self.max_ngram + 1):
                if e - n + 1 >= 0:
                    index.setdefault(tuple(ctx[e - n + 1:e + 1]), []).append(e)
        self._indexed[i] = max(self._indexed[i], end)

    def lookup(self, i, ctx):
        """(end position of the chosen match, matched length), or (-1, 0)."""
        last = len(ctx) - 1
        for n in range(min(self.max_ngram, last), self.min_ngram - 1, -1):
            ends = self._index[i].get(tuple(ctx[-n:]))
            if not ends:
                continue
            c = self.candidates
            cands = ends if len(ends) <= c else ends[:c // 2] + ends[-(c - c // 2):]
            best, best_len, cap = -1, -1, self.max_match
            for e in cands:  # ascending: strict > keeps the earliest on ties
                j = n
                while j < cap and j <= e and ctx[e - j] == ctx[last - j]:
                    j += 1
                if j > best_len:
                    best, best_len = e, j
                    if j >= cap:
                        break
            return best, best_len
        return -1, 0

    def propose(self, contexts, ks, sampling):
        out = []
        for i, (ctx, k) in enumerate(zip(contexts, ks)):
            if k > 0 and len(ctx) > self.min_ngram:
                self._update(i, ctx)
                e, n = self.lookup(i, ctx)
                if e >= 0:
                    out.append(Draft(list(ctx[e + 1:e + 1 + k]), None, n))
                    continue
            out.append(Draft([]))
        return out

    def select(self, rows):
        self._index = [self._index[r] for r in rows]
        self._indexed = [self._indexed[r] for r in rows]


class ModelDrafter(Drafter):
    """A smaller language model (any adapter) drafting autoregressively.

    Each drafted token is sampled with :func:`specfast.sample` from
    :func:`specfast.probs` of the draft logits under the request's sampling
    parameters, at its absolute position, so the reported q is exactly the
    distribution it was drawn from; in coupled mode it uses the request's own
    seed. ``p_min`` stops a chain early when the draft's probability of its own
    token falls below it (llama.cpp's ``--draft-p-min``).

    The draft model must share the target's tokenizer (same vocabulary ids).
    """

    deterministic = False

    def __init__(self, model, *, p_min: float = 0.0, sparse_top: int = 0):
        self.model = model
        self.p_min = p_min
        self.sparse_top = sparse_top
        self.name = f"model:{getattr(model, 'name', type(model).__name__)}"
        self._state = None
        self._fed: list = []
        self._peak = 0

    def start(self, contexts, sampling):
        self._state = self.model.new_state(len(contexts))
        self._fed = [0] * len(contexts)

    def propose(self, contexts, ks, sampling):
        m = self.model
        batch = len(contexts)
        live = [i for i in range(batch) if ks[i] > 0]
        drafts = [Draft([], None) for _ in range(batch)]
        if not live:
            return drafts
        # catch up: feed each live row the verified tokens it has not seen
        feed = [list(contexts[i][self._fed[i]:]) if ks[i] > 0 else [] for i in range(batch)]
        logits = m.forward(self._state, feed, all_logits=False)
        for i in live:
            self._fed[i] = len(contexts[i])
        rows = {i: [] for i in live}
        qs = {i: [] for i in live}
        active = list(live)
        depth = 0
        while active:
            lg = _np_logits([logits[i][-1] for i in active])
            s = [sampling[i] for i in active]
            kw = dict(temperature=np.array([x.temperature for x in s], np.float32),
                      top_k=np.array([x.top_k for x in s], np.int32),
                      top_p=np.array([x.top_p for x in s], np.float32),
                      min_p=np.array([x.min_p for x in s], np.float32))
            q = _api.probs(lg, **kw)
            tok = _api.sample(lg, **kw, seed=np.array([draft_seed(x.seed, x.method) for x in s],
                                                     np.uint64),
                              position=np.array([len(contexts[i]) + depth for i in active]),
                              method=s[0].method)
            nxt = []
            for j, i in enumerate(active):
                t = int(tok[j])
                rows[i].append(t)
                qs[i].append(q[j])
                if len(rows[i]) < ks[i] and q[j, t] >= self.p_min:
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

    def _report(self, q, tokens, s):
        if s.method == "coupled" or s.temperature == 0:
            return None  # coupled verification ignores q; greedy q is one-hot
        if self.sparse_top:
            k = min(self.sparse_top, q.shape[1])
            idx = np.argsort(-q, axis=1, kind="stable")[:, :k]
            # the drawn token must be representable: it always is when q is
            # concentrated on <= k tokens; otherwise fall back to dense
            vals = np.take_along_axis(q, idx, axis=1)
            if np.allclose(vals.sum(axis=1), 1.0, atol=1e-6):
                return _api.SparseProbs(idx, vals / vals.sum(axis=1, keepdims=True))
        return q

    def rollback(self, lengths):
        if self._state is None:
            return
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


def _np_logits(rows):
    """Stacks torch or numpy logits rows into one float32 numpy array."""
    first = rows[0]
    if type(first).__module__.split(".", 1)[0] == "torch":
        import torch

        return torch.stack(list(rows)).float().numpy()
    return np.stack([np.asarray(r, np.float32) for r in rows])


def make(spec: str, target=None, **kwargs) -> Drafter:
    """A drafter from a short spec: ``"ngram"``, ``"ngram:4"`` (max n-gram) or a
    model path (folder or ``.gguf``) loaded with the HF adapter."""
    if spec == "ngram" or spec.startswith("ngram:"):
        n = int(spec.split(":", 1)[1]) if ":" in spec else 3
        return NgramDrafter(max_ngram=n, min_ngram=1)
    from .adapters import load

    return ModelDrafter(load(spec, **kwargs))


__all__ = ["Draft", "Drafter", "ModelDrafter", "NgramDrafter", "Sampling", "draft_seed", "make"]
