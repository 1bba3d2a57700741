"""The speculative decoding loop: draft, one target forward, one verify, roll back.

Every step, for the whole batch of live requests:

1. choose a draft length k per request (:class:`DraftLength`);
2. the drafter proposes up to k tokens per request;
3. the target runs once over ``[last token] + drafts`` of every request;
4. :func:`specfast.verify` runs once over the ragged batch, with each
   request's absolute position, so coupled mode reproduces plain coupled
   sampling token by token;
5. each request appends what it accepted plus the corrected/bonus token, and
   its KV caches (target and drafter) roll back past what was rejected.
"""

from __future__ import annotations

import operator
import resource
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from . import _api
from .drafters import Draft, Drafter, Sampling, check_arg


# -- metrics ------------------------------------------------------------------
@dataclass
class Metrics:
    """What one generation did, as llama.cpp's server reports it, and more.

    Times are seconds of wall clock; in a batch they are shared by its requests
    (a request's ``t_*`` are the batch's while it was live).
    """

    prompt_tokens: int = 0
    tokens: int = 0  # generated tokens
    draft_n: int = 0  # drafted tokens sent to verification
    # drafted tokens that passed verification, those a stop string or EOS then
    # cut included (what the drafter achieved: the acceptance statistics)
    draft_n_accepted: int = 0
    target_steps: int = 0  # target forwards after the prefill
    drafted_at: list = field(default_factory=list)  # per draft position: tried
    accepted_at: list = field(default_factory=list)  # per draft position: accepted
    k_chosen: dict = field(default_factory=dict)  # draft length -> steps
    t_prefill: float = 0.0
    t_draft: float = 0.0
    t_target: float = 0.0
    t_verify: float = 0.0
    t_total: float = 0.0
    predicted_tokens: float = 0.0  # the cost model's expectation (batch totals)
    predicted_seconds: float = 0.0
    transfer: dict = field(default_factory=dict)  # a remote drafter's traffic (batch totals)

    @property
    def acceptance_rate(self) -> float:
        return self.draft_n_accepted / self.draft_n if self.draft_n else 0.0

    @property
    def request_steps(self) -> int:
        """Target steps of each request, summed (a batch's totals: more than
        ``target_steps``)."""
        return sum(self.k_chosen.values())

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a request emits per target step (1 for plain decoding; in a
        batch's totals, per step of each request)."""
        return self.tokens / self.request_steps if self.request_steps else 0.0

    @property
    def per_position_acceptance(self) -> list:
        """P(draft position d accepted | position d was verified)."""
        return [a / t if t else 0.0 for a, t in zip(self.accepted_at, self.drafted_at)]

    @property
    def t_other(self) -> float:
        return max(0.0, self.t_total - self.t_prefill - self.t_draft - self.t_target - self.t_verify)

    @property
    def predicted_tokens_per_s(self) -> float:
        """Decode tokens/s the draft-length cost model predicts for the draft
        lengths it chose, given the acceptance this generation measured (batch
        totals only): compare with :attr:`decode_tokens_per_s`."""
        return self.predicted_tokens / self.predicted_seconds if self.predicted_seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of the whole call (prefill included)."""
        return self.tokens / self.t_total if self.t_total else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second after the prefill."""
        t = self.t_total - self.t_prefill
        return self.tokens / t if t > 0 else 0.0

    def _count(self, drafted: int, accepted: int, nodes: int | None = None) -> None:
        """``drafted``: the draft's depth (its length for a chain); ``nodes``: its size."""
        self.draft_n += drafted if nodes is None else nodes
        self.draft_n_accepted += accepted
        while len(self.drafted_at) < drafted:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        # positions 0..min(accepted, drafted-1) were verified; 0..accepted-1 passed
        for d in range(min(drafted, accepted + 1)):
            self.drafted_at[d] += 1
        for d in range(accepted):
            self.accepted_at[d] += 1

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items()}
        d.update(request_steps=self.request_steps, acceptance_rate=self.acceptance_rate,
                 mean_accepted_length=self.mean_accepted_length,
                 per_position_acceptance=self.per_position_acceptance,
                 t_other=self.t_other, tokens_per_s=self.tokens_per_s,
                 predicted_tokens_per_s=self.predicted_tokens_per_s,
                 decode_tokens_per_s=self.decode_tokens_per_s)
        return d

    def summary(self) -> str:
        pos = " ".join(f"{p:.2f}" for p in self.per_position_acceptance[:8])
        net = ""
        if self.transfer:
            t = self.transfer
            net = (f"; network {t['bytes_per_step']:.0f} B/step, "
                   f"{t['bytes_per_drafted_token']:.1f} B/drafted token, "
                   f"{t['bytes_per_token']:.1f} B/token; drafted remotely "
                   f"{t['steps']} steps, locally {t['local_steps']}")
            if t["failures"]:  # a drafter away is drafted around: said here
                net += f" ({len(t['failures'])} failed tries, the last: {t['failures'][-1]})"
        return (f"{self.tokens} tokens in {self.t_total:.2f} s ({self.tokens_per_s:.1f} tok/s), "
                f"{self.target_steps} target steps ({self.mean_accepted_length:.2f} tok/step), "
                f"drafted {self.draft_n} accepted {self.draft_n_accepted} "
                f"({100 * self.acceptance_rate:.0f}%), per position [{pos}]; "
                f"time: prefill {self.t_prefill:.2f} draft {self.t_draft:.2f} "
                f"target {self.t_target:.2f} verify {self.t_verify:.2f} other {self.t_other:.2f} s"
                + net)


@dataclass
class Generation:
    """One request's result."""

    text: str
    tokens: list
    finish_reason: str  # "length", "eos" or "stop"
    metrics: Metrics


# -- draft length ----------------------------------------------------------------
class _Request:
    """One request's acceptance statistics (per confidence bucket) and probe state."""

    __slots__ = ("stats", "skipped", "interval", "probing", "hits", "expected")

    def __init__(self, probe_every):
        self.stats = {}  # bucket -> [first ok, first failed, next ok, next failed]
        self.skipped = 0
        self.interval = probe_every
        self.probing = False  # the last choice was a probe
        self.hits = 0.0  # first draft tokens accepted, all buckets (decayed)
        self.expected = 0.0  # what the buckets' priors expected of the same drafts


class DraftLength:
    """Chooses k per request and step from measured acceptance and costs.

    Acceptance is bursty (a copied span is accepted token after token, then
    the copy ends), so it is modelled as a chain, not i.i.d. tokens: ``p0`` =
    P(first draft token accepted) and ``q`` = P(next accepted | previous
    accepted), so drafting k yields ``1 + p0 (1 - q^k) / (1 - q)`` tokens in
    expectation. Both are decayed running estimates per request and per
    confidence bucket of the draft (``Draft.match``, the length of the context
    a lookup draft matched: a 2-token match and a 40-token one are different
    bets), starting from a prior.

    Costs are measured, and robustly: the target forward of width w (the
    minimum over a window of recent steps per width, the widths joined by a
    monotone piecewise-linear curve pooled by samples, so a lucky or unlucky
    step cannot pin k, and priced optimistically past the widest tried), the
    drafter's time fitted the same way against the draft length (a fixed part,
    such as a remote drafter's round trip, and a part per token; not counted
    for ``cheap`` drafters, whose draft is proposed whatever k is) and the
    per-step verify and
    bookkeeping time. k maximises expected tokens per second; when that is
    k = 0 the request decodes plainly and probes with ``probe_k`` tokens after
    ``probe_every`` skipped drafts, the interval doubling (up to ``probe_max``)
    after each failed probe, so prose pays next to nothing while text that
    turns copyable is noticed.

    Parameters
    ----------
    fixed : int or None
        Always draft this many (no adaptation).
    max_k : int
        The longest draft considered.
    margin : float
        Drafting is chosen only when its expected rate beats plain decoding's
        by this factor.
    prior_first, prior_next, prior_weight : float
        The prior of ``p0`` and ``q``, and how many observations it counts as.
    decay : float
        Weight kept by the acceptance estimates at each new observation.
    window : int
        Steps of measured times kept per target width and draft length.
    prior_slope : float
        The cost of each extra token of a target forward, as a fraction of the
        narrowest measured forward, assumed past the widest measured width.
    probe_every, probe_max, probe_k : int
        While drafting does not pay: skipped drafts before the first probe,
        the most the interval doubles to, and the probe's draft length.
    pad_max : int
        The most tokens a drafting step may be widened by, where the target
        computes a wider step (``forward(pad_to=...)``) and a wider one was
        measured faster (:meth:`compute_width`); 0: never.
    """

    def __init__(self, fixed: int | None = None, max_k: int = 10, *, prior_first: float = 0.5,
                 prior_next: float = 0.85, prior_weight: float = 2.0, decay: float = 0.9,
                 window: int = 24, probe_every: int = 4, probe_max: int = 32, probe_k: int = 1,
                 prior_slope: float = 0.02, margin: float = 1.1, pad_max: int = 3):
        for name, v, lo in (("fixed", fixed, 0), ("max_k", max_k, 0), ("window", window, 1),
                            ("probe_every", probe_every, 1), ("probe_max", probe_max, 1),
                            ("probe_k", probe_k, 0), ("pad_max", pad_max, 0)):
            if v is not None:
                check_arg("DraftLength", name, v, lo, integer=True)
        for name, v, hi in (("prior_first", prior_first, 1.0), ("prior_next", prior_next, 1.0),
                            ("prior_slope", prior_slope, float("inf"))):
            check_arg("DraftLength", name, v, 0.0, hi)
        for name, v, hi in (("prior_weight", prior_weight, float("inf")), ("margin", margin,
                            float("inf")), ("decay", decay, 1.0)):  # decay 0 forgets all: 0 / 0
            check_arg("DraftLength", name, v, 0.0, hi, open_lo=True)
        # max_k bounds the adaptive length only: a fixed length is drafted whole
        self.fixed, self.max_k = fixed, max_k if fixed is None else max(max_k, fixed)
        self.prior_first, self.prior_next = prior_first, prior_next
        self.prior_weight, self.decay = prior_weight, decay
        self.window = int(window)  # a deque's maxlen takes Python ints only
        self.probe_every, self.probe_max, self.probe_k = probe_every, probe_max, probe_k
        self.prior_slope = prior_slope
        self.margin = margin
        self.pad_max = pad_max
        self.pad = 0  # pad_max where the target can widen a step (the decoder sets it)
        self.cheap_draft = False
        self._times: dict = {}  # width -> recent forward seconds
        self._unmeasured = 0  # choices made without a measured plain step
        self._draft: dict = {}  # draft length -> recent seconds of proposing
        self._draft_line = None
        self._fixed: deque = deque(maxlen=self.window)  # verify + other, per step
        self._costs = None  # forward seconds by width, from _times
        self._req: list = []

    # -- per request ---------------------------------------------------------
    def start(self, batch: int) -> None:
        self._req = [_Request(self.probe_every) for _ in range(batch)]

    def select(self, rows) -> None:
        self._req = [self._req[r] for r in rows]

    @staticmethod
    def bucket(match) -> int:
        """Confidence bucket of a draft: 0 unknown, else 1 + log2 of the match length."""
        return 0 if not match or match < 0 else min(int(match).bit_length(), 7)

    def _prior(self, b: int) -> float:
        """P(first draft token accepted) before a request has drafted from bucket b."""
        if b:  # lookup drafts: a short match is a weaker bet than a long one
            return min(0.9, self.prior_first * 0.25 * b)
        return self.prior_first

    def _stats(self, i: int, match):
        req = self._req[i]
        b = self.bucket(match)
        st = req.stats.get(b)
        if st is None:
            # A bucket this request has not drafted from yet starts from its prior
            # scaled by how the request's other drafts fared against theirs: in
            # prose, where short matches keep failing, a first long match is not
            # worth a wide step; in a rewrite it is.
            luck = (req.hits + 1.0) / (req.expected + 1.0)
            w, p, q = self.prior_weight, min(0.9, self._prior(b) * luck), self.prior_next
            st = req.stats[b] = [p * w, (1 - p) * w, q * w, (1 - q) * w]
        return st

    def acceptance(self, i: int, match=None) -> tuple:
        """(p0, q): P(first draft token accepted), P(next accepted | previous was)."""
        s0, f0, s1, f1 = self._stats(i, match)
        return s0 / (s0 + f0), s1 / (s1 + f1)

    # -- costs ---------------------------------------------------------------
    @staticmethod
    def _fit_line(times, one_point, stat=min):
        """(intercept, slope) through ``stat`` of the times seen at each x (a
        line weighted by samples); ``one_point(x, t)`` when one x is measured."""
        pts = [(w, stat(t), len(t)) for w, t in times.items() if t]
        if len({w for w, _, _ in pts}) == 1:
            return one_point(pts[0][0], pts[0][1])
        xs = np.array([p[0] for p in pts], float)
        ys = np.array([p[1] for p in pts], float)
        ws = np.sqrt(np.array([p[2] for p in pts], float))
        slope, icpt = np.polyfit(xs, ys, 1, w=ws)
        slope = max(float(slope), 0.0)
        return max(float(np.average(ys - slope * xs, weights=ws)), 0.0), slope

    def _forward_costs(self, stat=min) -> np.ndarray:
        """Seconds of a target forward of each width 0 .. max_k + 1 (index =
        width). Measured widths are joined by straight lines, made monotone
        (pooling adjacent widths that disagree, weighted by samples): the
        cost is far from linear on CPUs, where one token is a matrix-vector
        product and each further token costs less than the one before. Past
        the widest measured width the cost rises by the prior's slope (or the
        last segment's, if flatter): longer drafts look cheap until tried, and
        are then measured."""
        grid = np.arange(self.max_k + 2, dtype=float)
        # A width seen fewer than 3 times (once the best-known one has been) is
        # left out, as if unmeasured: one slow step on a loaded machine must not
        # price that width out for good (it would never be chosen, so never re-measured).
        trust = self._trust()
        if self.pad and stat is min:  # what compute_width will pick
            pts = sorted((w, t, n) for w, (t, n) in self._widened(trust).items())
        else:
            pts = sorted((w, stat(t), len(t)) for w, t in self._times.items()
                         if len(t) >= max(1, trust))
        if not pts:
            return 1.0 + self.prior_slope * (grid - 1)  # relative units until measured
        ws = np.array([p[0] for p in pts], float)
        ys = _monotone([p[1] for p in pts], [p[2] for p in pts])
        # Past the widest measured width, optimism: the prior's slope unless the
        # last segment is flatter, so that long drafts get tried and measured (a
        # steep first segment, 1 -> 2 tokens, would otherwise keep k short).
        slope = self.prior_slope * ys[0]
        if len(pts) > 1:
            slope = min(slope, (ys[-1] - ys[-2]) / (ws[-1] - ws[-2]))
        cost = np.interp(grid, ws, ys)
        past = grid > ws[-1]
        cost[past] = ys[-1] + slope * (grid[past] - ws[-1])
        before = grid < ws[0]
        cost[before] = np.maximum(ys[0] - slope * (ws[0] - grid[before]), 1e-9)
        return cost

    def _widened(self, trust: int) -> dict:
        """{width: (seconds, samples)}: what :meth:`compute_width` makes a step of
        w tokens cost (w >= 2; a plain step is never widened, and is measured
        as the other widths are without padding)."""
        out = {w: (min(t), len(t)) for w, t in self._times.items()
               if len(t) >= max(1, trust) and (w == 1 or w > self.max_k + 1)}
        for w in range(2, self.max_k + 2):
            wider = [(min(self._times[c]), len(self._times[c]))
                     for c in range(w, w + self.pad + 1) if self._times.get(c)]
            if wider:
                out[w] = min(wider)
        return out

    def compute_width(self, w: int) -> int:
        """The width to compute a step of w tokens at: w itself until it has been
        measured once, then each wider width up to w + pad once (a step that
        widens costs a little, and finds the cheap widths: MKL multiplies 4 rows
        faster than 3), then the fastest of them."""
        if self.pad == 0 or w < 2:
            return w
        cands = range(w, w + self.pad + 1)
        fresh = [c for c in cands if not self._times.get(c)]
        if fresh:
            return fresh[0]
        return min(cands, key=lambda c: (min(self._times[c]), c))

    def _trust(self) -> int:
        """Samples a width needs for the cost fit: 3 once the best-known width has 3."""
        return min(3, max((len(t) for t in self._times.values()), default=0))

    def _fit(self):
        if self._costs is None:
            self._costs = self._forward_costs()
        return self._costs

    def _drafting(self, k: int) -> float:
        """Seconds to draft k tokens: a fixed part (a remote drafter's round trip,
        a draft model's catch-up forward) plus a part per token, both measured;
        nothing when not drafting or when the drafter is cheap."""
        if k == 0 or self.cheap_draft or not any(self._draft.values()):
            return 0.0
        if self._draft_line is None:  # one length measured: all of it per token
            # the mean, not the fastest: a remote drafter's look-ahead makes
            # some steps free and others pay the round trip
            self._draft_line = self._fit_line(self._draft, lambda w, t: (0.0, t / w), _mean)
        icpt, slope = self._draft_line
        return icpt + slope * k

    def expected_tokens(self, p0: float, q: float, k: int) -> float:
        q = min(q, 0.995)
        return 1.0 + p0 * (1 - q ** k) / (1 - q)

    def step_seconds(self, k: int, typical: bool = False) -> float:
        """The modelled time of a step drafting k: draft, verify k + 1, the rest.
        ``typical``: from mean times (what a run will see), not the fastest
        (what k is chosen from, robust to load)."""
        stat = _mean if typical else min
        costs = self._forward_costs(_mean) if typical else self._fit()
        fixed = stat(self._fixed) if self._fixed else 0.0
        return float(costs[min(k + 1, len(costs) - 1)]) + self._drafting(k) + fixed

    def expected_rate(self, p0: float, q: float, k: int) -> float:
        """Tokens per second when drafting k with acceptance (p0, q)."""
        # A clock too coarse to see a step still ranks k by tokens per step.
        return self.expected_tokens(p0, q, k) / max(self.step_seconds(k), 1e-9)

    def choose(self, i: int, limit: int, match=None, available: int | None = None) -> int:
        """Draft length for request i: at most ``limit`` (tokens left) and
        ``available`` (the draft's length, when it is proposed first)."""
        cap = min(self.max_k, limit)
        if available is not None:
            cap = min(cap, available)
        if cap <= 0:
            return 0
        if self.fixed is not None:
            return min(self.fixed, cap)
        if self._times and len(self._times.get(1, ())) < self._trust():
            # the cost of a plain step is unmeasured, or measured too few times for
            # the fit to trust: the curve through draft widths alone then makes
            # plain steps look dear and drafting cheap (llama.cpp: width 1 was
            # priced at 37 ms where it took 11), so take one now and then
            self._unmeasured += 1
            if self._unmeasured % 8 == 0:
                return 0
        p0, q = self.acceptance(i, match)
        # Speculating must beat plain decoding by a margin: acceptance and costs
        # are estimates, and a bet that only breaks even adds variance, not speed.
        best_k, best = 0, self.expected_rate(p0, q, 0) * self.margin
        for k in range(1, cap + 1):
            r = self.expected_rate(p0, q, k)
            if r > best:
                best_k, best = k, r
        req = self._req[i]
        if best_k == 0:
            req.skipped += 1
            if req.skipped >= req.interval:
                req.skipped = 0
                req.probing = True  # observe doubles the interval if it fails
                return min(self.probe_k, cap)
            return 0
        req.skipped = 0
        req.probing = False
        req.interval = self.probe_every
        return best_k

    def observe(self, i: int, drafted: int, accepted: int, match=None) -> None:
        if drafted == 0:
            return
        st = self._stats(i, match)
        d = self.decay
        req = self._req[i]
        req.hits = req.hits * d + (accepted >= 1)
        req.expected = req.expected * d + self._prior(self.bucket(match))
        st[0] = st[0] * d + (accepted >= 1)
        st[1] = st[1] * d + (accepted == 0)
        if accepted >= 1 and drafted >= 2:
            # positions 2..drafted were verified while the previous one passed (a
            # one-token draft says nothing of q, and must not fade what did)
            st[2] = st[2] * d + (accepted - 1)
            st[3] = st[3] * d + (1 if accepted < drafted else 0)
        if req.probing:
            req.probing = False
            if accepted == 0:
                req.interval = min(2 * req.interval, self.probe_max)

    def observe_target(self, width: int, seconds: float) -> None:
        t = self._times.get(width)
        if t is None:
            t = self._times[width] = deque(maxlen=self.window)
        t.append(seconds)
        self._costs = None

    def observe_draft(self, tokens: int, seconds: float) -> None:
        """Proposing drafts of (at most) ``tokens`` took ``seconds``."""
        if tokens:
            t = self._draft.get(tokens)
            if t is None:
                t = self._draft[tokens] = deque(maxlen=self.window)
            t.append(seconds)
            self._draft_line = None

    def observe_fixed(self, seconds: float) -> None:
        self._fixed.append(seconds)


def _monotone(ys, weights) -> np.ndarray:
    """The non-decreasing sequence nearest ``ys`` in weighted least squares
    (pool adjacent violators)."""
    blocks = []  # [mean, weight, count]
    for y, w in zip(ys, weights):
        blocks.append([float(y), float(w), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            y2, w2, n2 = blocks.pop()
            b = blocks[-1]
            b[0] = (b[0] * b[1] + y2 * w2) / (b[1] + w2)
            b[1] += w2
            b[2] += n2
    return np.repeat([b[0] for b in blocks], [b[2] for b in blocks])


def _mean(times) -> float:
    return sum(times) / len(times)


# -- the decoder ---------------------------------------------------------------
class SpeculativeDecoder:
    """Speculative decoding of ``target`` with ``drafter``, exact in every mode.

    Parameters
    ----------
    target : adapter
        A model adapter (:class:`specfast.adapters.hf.HFModel`, ...).
    drafter : Drafter or None
        None decodes plainly (k = 0), with the same loop and sampling.
    k : "auto" or int
        Draft length: adaptive per request, or fixed.
    max_k : int or None
        Longest adaptive draft; None: 32 for a ``cheap`` drafter (n-gram lookup,
        whose long matches are accepted in long runs), 10 otherwise.
    **controller
        The draft length controller's settings (:class:`DraftLength`:
        ``margin``, ``decay``, ``window``, the priors and the probes).

    A decoder runs one generation at a time (a second one, from another thread
    or from a ``stream`` callback, is a RuntimeError): its drafter and
    controller hold the running generation's state. Batch prompts into one
    call, or make a decoder per thread, each with its own drafter (an
    ``HFModel`` may be shared by them, as the drafting server shares one; a
    ``LlamaCppModel`` runs one generation at a time).

    Examples
    --------
    >>> dec = SpeculativeDecoder(target, NgramDrafter())        # doctest: +SKIP
    >>> out = dec.generate("Rewrite this code ...", max_new_tokens=128)  # doctest: +SKIP
    >>> out.text, out.metrics.acceptance_rate                   # doctest: +SKIP
    """

    def __init__(self, target, drafter: Drafter | None = None, *, k="auto",
                 max_k: int | None = None, **controller):
        self.target = target
        self.drafter = drafter
        if getattr(drafter, "branches", 1) > 1 and not hasattr(target, "keep_paths"):
            raise ValueError(f"{type(target).__name__} verifies chains only: use a drafter "
                             f"with branches=1")
        draft_vocab = getattr(getattr(drafter, "model", None), "vocab_size", None)
        if draft_vocab is not None and draft_vocab != target.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft_vocab} ids) differs from the "
                             f"target's ({target.vocab_size}): they must share one tokenizer")
        if drafter is None:
            k = 0
        if k != "auto" and (not isinstance(k, (int, np.integer)) or isinstance(k, bool)
                            or not 0 <= k <= _api._MAX_DRAFT):
            raise ValueError(f"k must be 'auto' or an int in [0, {_api._MAX_DRAFT}], got {k!r}")
        if max_k is None:
            max_k = 32 if getattr(drafter, "cheap", False) else 10
        self.controller = DraftLength(None if k == "auto" else int(k), max_k, **controller)
        self.last_metrics: Metrics | None = None
        self._peaks = {"target_kv": 0, "draft_kv": 0}
        self._shape = (1, 0)
        self._busy = threading.Lock()

    # -- public ----------------------------------------------------------
    def generate(self, prompt, max_new_tokens: int = 128, *, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed=0,
                 method: str = "coupled", stream=None, stop=None, eos: bool = True):
        """Generates from one prompt (returns a :class:`Generation`) or a list of
        prompts (returns a list, decoded as one batch).

        Parameters
        ----------
        prompt : str, list of chat messages, list of token ids, or a list of these
        max_new_tokens : int
        temperature, top_k, top_p, min_p : the target distribution (:func:`specfast.probs`);
            temperature 0 is greedy
        seed : int or list of int (one per prompt)
            Keys every random draw with the absolute position; a prompt in a
            batch gives the same output as alone with the same seed in greedy and
            coupled modes (where the target's forward gives a row the same logits
            whatever else the batch holds: the HF adapter, not llama.cpp), and in
            rejection mode with a fixed ``k`` (with
            ``k="auto"`` the draft lengths follow measured times, and which draws
            a position uses follows them: the same distribution, other tokens).
        method : {"coupled", "rejection"}
        stream : callable ``(index, token_ids, text)`` or None
            Called with each request's newly emitted tokens and text. The text is
            sent once it cannot change (not the start of a stop string, no partial
            character); a tokenizer that rewrites earlier text as more tokens come
            (``clean_up_tokenization_spaces``) streams it as first decoded, and the
            returned ``text`` is the final one.
        stop : str, list of str or None
            Stop strings (a str is one); the text is cut before the first one, and the tokens end
            with the one that completes it, as in plain decoding.
        eos : bool
            Stop at the model's end-of-sequence tokens.
        """
        prompts, single = _as_batch(prompt)
        if isinstance(seed, np.ndarray) and seed.ndim == 0:
            seed = seed[()]  # one number
        seeds = list(seed) if isinstance(seed, (list, tuple, np.ndarray)) else [seed] * len(prompts)
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        if isinstance(max_new_tokens, (bool, np.bool_)):
            raise TypeError("max_new_tokens must be an integer, got a bool")
        max_new = operator.index(max_new_tokens)
        if max_new < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new}")
        if stream is not None and not callable(stream):
            raise TypeError(f"stream must be a callable (index, token_ids, text) or None, "
                            f"got {type(stream).__name__}")
        sampling = [_sampling(temperature, top_k, top_p, min_p, s, method) for s in seeds]
        results = self._run(prompts, sampling, max_new, stream, _stops(stop), eos)
        return results[0] if single else results

    def memory_report(self, batch: int | None = None, context: int | None = None) -> dict:
        """Measured bytes of the last generation beside the planning estimate.

        measured: target and drafter parameters, the peak bytes of both KV
        caches (holes and padding included) and the process' peak RSS.
        estimate: ``target + draft + both KV caches (batch * context tokens)
        + overhead`` (logits of a step, and ~20% of the weights for the
        runtime's buffers), what a user plans with.
        """
        batch = self._shape[0] if batch is None else batch
        context = self._shape[1] if context is None else context
        t_params = self.target.param_bytes()
        d_mem = self.drafter.memory() if self.drafter is not None else {"params": 0}
        d_model = getattr(self.drafter, "model", None)
        t_kv = self.target.kv_bytes_per_token() * batch * context
        d_kv = d_model.kv_bytes_per_token() * batch * context if d_model is not None else 0
        logits = batch * (self.controller.max_k + 1) * self.target.vocab_size * 4 * 2
        overhead = logits + int(0.2 * (t_params + d_mem["params"]))
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        measured = {"target_params": t_params, "draft_params": d_mem["params"],
                    "target_kv_peak": self._peaks["target_kv"],
                    "draft_kv_peak": d_mem.get("kv_peak", 0), "process_peak_rss": rss}
        estimate = {"target_params": t_params, "draft_params": d_mem["params"],
                    "target_kv": t_kv, "draft_kv": d_kv, "overhead": overhead}
        measured["total"] = sum(v for k, v in measured.items() if k != "process_peak_rss")
        estimate["total"] = sum(estimate.values())
        return {"batch": batch, "context": context, "measured": measured, "estimate": estimate}

    # -- the loop -----------------------------------------------------------
    def _run(self, *args):
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("this SpeculativeDecoder is already generating (one generation "
                               "at a time: batch the prompts, or make a decoder per thread)")
        try:
            return self._loop(*args)
        finally:  # a remote drafter's session ends with the generation
            try:
                finish = getattr(self.drafter, "finish", None)
                if finish is not None:
                    finish()
            finally:
                self._busy.release()

    def _loop(self, prompts, sampling, max_new, stream, stop, eos):
        target, drafter, ctl = self.target, self.drafter, self.controller
        t_start = time.perf_counter()
        batch = len(prompts)
        contexts = [target.encode(p) for p in prompts]
        if any(not c for c in contexts):
            raise ValueError("empty prompt")
        if any(min(c) < 0 or max(c) >= target.vocab_size for c in contexts):
            raise ValueError(f"prompt token ids must be in [0, {target.vocab_size})")
        n_prompt = [len(c) for c in contexts]
        limit = getattr(target, "max_positions", None)  # the last token emitted is never fed
        if limit is not None and max(n_prompt) + max_new - 1 > limit:
            raise ValueError(f"{target.name} takes {limit} positions: a prompt of "
                             f"{max(n_prompt)} tokens leaves room for "
                             f"{max(0, limit + 1 - max(n_prompt))} new ones")
        pool = getattr(target, "max_batch_positions", None)  # cells the rows share
        if pool is not None and sum(n + max_new - 1 for n in n_prompt) > pool:
            raise ValueError(f"{target.name}'s rows share {pool} positions: {batch} prompts "
                             f"of {sum(n_prompt)} tokens with {max_new} new tokens each need "
                             f"{sum(n + max_new - 1 for n in n_prompt)} (raise n_ctx, or "
                             "decode fewer prompts at once)")
        eos_ids = set(target.eos_token_ids) if eos else set()
        metrics = [Metrics(prompt_tokens=n) for n in n_prompt]
        total = Metrics(prompt_tokens=sum(n_prompt))
        gen = [[] for _ in range(batch)]
        texts = [""] * batch
        finish = ["length"] * batch
        want_text = stream is not None or bool(stop)
        detok = [_Text(target.decode) for _ in range(batch)]

        cheap = drafter is not None and getattr(drafter, "cheap", False)
        ctl.cheap_draft = cheap
        ctl.pad = ctl.pad_max if getattr(target, "can_pad", False) else 0
        state = target.new_state(batch)
        target.forward(state, [c[:-1] for c in contexts], all_logits=False)
        if drafter is not None:
            drafter.start([list(c) for c in contexts], sampling)
        ctl.start(batch)
        total.t_prefill = time.perf_counter() - t_start
        for m in metrics:
            m.t_prefill = total.t_prefill
        live = list(range(batch)) if max_new > 0 else []
        self._peaks["target_kv"] = 0
        step_ks: dict = {}  # the longest draft of a step -> steps

        while live:
            step_start = time.perf_counter()
            limits = [max_new - len(gen[i]) - 1 for i in live]
            t0 = time.perf_counter()
            if cheap:
                # propose the longest useful draft, then let the controller cut it
                want = [min(ctl.max_k, n) if ctl.fixed is None else min(ctl.fixed, n)
                        for n in limits]
                drafts = drafter.propose([contexts[i] for i in live], want,
                                         [sampling[i] for i in live])
                ks = [ctl.choose(j, n, d.match, len(d.tokens))
                      for j, (n, d) in enumerate(zip(limits, drafts))]
            else:
                ks = [ctl.choose(j, n) for j, n in enumerate(limits)]
                drafts = [Draft([]) for _ in live]
                if drafter is not None and any(ks):
                    drafts = drafter.propose([contexts[i] for i in live], ks,
                                             [sampling[i] for i in live])
            drafts = _checked(drafts, ks, len(live), target, drafter)
            step_ks[max(ks)] = step_ks.get(max(ks), 0) + 1
            t_draft = time.perf_counter() - t0
            if not cheap and not getattr(drafter, "stalled", False):  # a fault's wait
                ctl.observe_draft(max(ks), t_draft)

            t0 = time.perf_counter()
            parents = _parents(drafts)
            feed = [[contexts[i][-1]] + d.tokens for i, d in zip(live, drafts)]
            need = 1 + max(len(d.tokens) for d in drafts)
            width = ctl.compute_width(need)
            wide = {"pad_to": width} if width > need else {}
            if parents is None:
                rows = target.forward(state, feed, **wide)
            else:
                rows = target.forward(state, feed, trees=[d.parents for d in drafts], **wide)
            t_target = time.perf_counter() - t0
            ctl.observe_target(width, t_target)

            t0 = time.perf_counter()
            result = self._verify(rows, drafts, [sampling[i] for i in live],
                                  [len(contexts[i]) for i in live], parents)
            t_verify = time.perf_counter() - t0
            if parents is not None:
                target.keep_paths(state, result.accepted_nodes, result.num_accepted)

            keep_target, keep_draft, still = [], [], []
            for j, i in enumerate(live):
                n_acc = int(result.num_accepted[j])
                drafted, nodes = _depth(drafts[j]), len(drafts[j].tokens)
                # the statistics k was chosen from: per match bucket only when the
                # draft (and its match) was known before k was
                ctl.observe(j, drafted, n_acc, drafts[j].match if cheap else None)
                metrics[i]._count(drafted, n_acc, nodes)
                total._count(drafted, n_acc, nodes)
                metrics[i].target_steps += 1
                for m in (metrics[i], total):
                    m.k_chosen[ks[j]] = m.k_chosen.get(ks[j], 0) + 1
                old = len(contexts[i])
                new = [int(t) for t in result.tokens[j, :n_acc + 1]]
                keep_target.append(old + n_acc)
                keep_draft.append(old + n_acc)
                contexts[i].extend(new)
                done = self._emit(i, new, gen, texts, finish, max_new, eos_ids, stop,
                                  want_text, stream, detok[i])
                if not done:
                    still.append(j)
            total.target_steps += 1
            target.truncate(state, keep_target)
            if drafter is not None:
                drafter.rollback(keep_draft)
            self._peaks["target_kv"] = max(self._peaks["target_kv"], target.kv_bytes(state))
            step = time.perf_counter() - step_start
            ctl.observe_fixed(max(0.0, step - t_draft - t_target))
            for i in live:
                m = metrics[i]
                m.t_draft += t_draft
                m.t_target += t_target
                m.t_verify += t_verify
            total.t_draft += t_draft
            total.t_target += t_target
            total.t_verify += t_verify
            if len(still) != len(live):
                now = time.perf_counter() - t_start
                for j, i in enumerate(live):
                    if j not in still:
                        metrics[i].t_total = now
                live = [live[j] for j in still]
                if live:
                    target.select(state, still)
                    if drafter is not None:
                        drafter.select(still)
                    ctl.select(still)

        total.t_total = time.perf_counter() - t_start
        for i in range(batch):
            metrics[i].tokens = len(gen[i])
            metrics[i].t_total = metrics[i].t_total or total.t_total  # no step ran
            if not want_text:
                texts[i] = target.decode(gen[i])
        total.tokens = sum(len(g) for g in gen)
        self._predict(total, metrics, step_ks)
        stats = getattr(drafter, "stats", None)
        if hasattr(stats, "as_dict"):  # a remote drafter: what crossed the network
            total.transfer = stats.as_dict()
            total.transfer["bytes_per_token"] = stats.total_bytes / max(1, total.tokens)
        self.last_metrics = total
        self._shape = (batch, max(n_prompt) + max_new)
        return [Generation(texts[i], gen[i], finish[i], metrics[i]) for i in range(batch)]

    def _predict(self, total, metrics, step_ks):
        """What the cost model predicts for the draft lengths chosen, with this
        generation's own acceptance (p0, q over all its drafts) and the fitted
        costs: expected tokens over modelled time (see ``predicted_tokens_per_s``)."""
        ctl = self.controller
        tried, passed = total.drafted_at, total.accepted_at
        p0 = passed[0] / tried[0] if tried and tried[0] else 0.0
        q = sum(passed[1:]) / sum(tried[1:]) if sum(tried[1:]) else 0.0
        total.predicted_tokens = sum(n * ctl.expected_tokens(p0, q, k)
                                     for m in metrics for k, n in m.k_chosen.items())
        total.predicted_seconds = sum(n * ctl.step_seconds(k, typical=True)
                                      for k, n in step_ks.items())

    def _verify(self, rows, drafts, sampling, positions, parents=None):
        torch_rows = type(rows[0]).__module__.split(".", 1)[0] == "torch"
        if torch_rows:
            import torch

            logits = torch.cat(rows).float().numpy()
        else:
            logits = np.concatenate([np.asarray(r, np.float32) for r in rows])
        tokens = np.array([t for d in drafts for t in d.tokens], np.int32)
        num_draft = np.array([len(d.tokens) for d in drafts], np.int32)
        q = _draft_probs(drafts, logits.shape[1])
        return _api.verify(
            logits, tokens, num_draft, draft_probs=q, parents=parents,
            temperature=np.array([s.temperature for s in sampling], np.float32),
            top_k=np.array([s.top_k for s in sampling], np.int32),
            top_p=np.array([s.top_p for s in sampling], np.float32),
            min_p=np.array([s.min_p for s in sampling], np.float32),
            seed=np.array([s.seed for s in sampling], np.uint64),
            position=np.array(positions, np.int64), method=sampling[0].method)

    def _emit(self, i, new, gen, texts, finish, max_new, eos_ids, stop, want_text, stream,
              detok):
        """Appends request i's new tokens one at a time, as plain decoding meets
        them (so a stop string ends the run at the token that completes it);
        True when the request is finished. While it runs, texts[i] is the text
        streamed so far: none that a later token could take back (the start of
        a stop string, a partial character); when it ends, the whole text
        decoded at once."""
        out, done, text = [], False, None
        for t in new:
            if len(gen[i]) + len(out) >= max_new:
                done = True
                break
            if t in eos_ids:
                finish[i], done = "eos", True
                break
            out.append(t)
        if stop:
            text = detok(gen[i] + out)
            if _find_stop(text, stop) >= 0:
                # the token that completes it, where plain decoding stops (in
                # the text decoded whole: none where only the joined one had it)
                for n in range(1, len(out) + 1):
                    text = self.target.decode(gen[i] + out[:n])
                    cut = _find_stop(text, stop)
                    if cut >= 0:
                        out, text, done, finish[i] = out[:n], text[:cut], True, "stop"
                        break
        gen[i].extend(out)
        done = done or len(gen[i]) >= max_new
        delta = ""
        if want_text:
            if done and finish[i] != "stop":
                text = self.target.decode(gen[i])  # the whole text, at once
            elif text is None:
                text = detok(gen[i])
            if not done:
                detok.advance(gen[i])
                text = _settled(text, stop)
            # Only what follows the streamed text goes out: a decoder that
            # rewrote earlier characters cannot take back what was sent.
            delta = text[len(texts[i]):]
            texts[i] = text if done else texts[i] + delta
        if stream is not None and (out or delta):
            stream(i, out, delta)
        return done


class _Text:
    """A request's text without decoding all of it every step: the text of its
    first ``at`` tokens is kept (``head``) and a call decodes only the tokens
    after them. The anchor moves (``advance``, every ``TAIL`` tokens) only where
    the whole text, decoded once, ends with the text of the tokens after the new
    anchor, and that text starts with no split character: there the join is
    exact for decoders whose text at a join depends on the tokens beside it
    (byte-level BPE, SentencePiece's dropped leading space). One that rewrites
    earlier text later (a byte-fallback run that a stray byte makes invalid)
    can make the joined text differ: only the streamed text then, as the stream
    never takes back what it sent; a stop is confirmed in the text decoded
    whole, and a finished request's text is decoded whole. Called with the
    request's tokens, or those and some not yet emitted."""

    TAIL = 32

    def __init__(self, decode):
        self.decode, self.at, self.head, self.next = decode, 0, "", 2 * self.TAIL

    def __call__(self, tokens) -> str:
        return self.head + self.decode(tokens[self.at:])

    def advance(self, tokens) -> None:
        if len(tokens) < self.next:
            return
        self.next = len(tokens) + self.TAIL
        at = len(tokens) - self.TAIL
        whole, tail = self.decode(tokens), self.decode(tokens[at:])
        if tail and whole.endswith(tail) and not tail.startswith("\ufffd"):
            self.head, self.at = whole[:len(whole) - len(tail)], at


def _stops(stop) -> list:
    """The stop strings as a list: a str is one stop string, not its characters."""
    if not (stop is None or isinstance(stop, (str, list, tuple))):
        raise TypeError(f"stop must be a str, a list of str or None, got {type(stop).__name__}")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
    for s in stops:
        if not isinstance(s, str):
            raise TypeError(f"stop strings must be str, got {type(s).__name__}")
        if not s:
            raise ValueError("a stop string must not be empty (it would stop at once)")
    return stops


def _find_stop(text: str, stop) -> int:
    """Where the first stop string starts in text, or -1."""
    return min((p for p in (text.find(s) for s in stop) if p >= 0), default=-1)


def _settled(text: str, stop) -> str:
    """text without its end that may still change: a partial character, or the
    start of a stop string."""
    base = text.rstrip("\ufffd")
    keep = len(base)
    for s in stop:
        n = next((n for n in range(min(len(s) - 1, len(base)), 0, -1) if base.endswith(s[:n])), 0)
        keep = min(keep, len(base) - n)
    return text[:keep]


def _checked(drafts, ks, n, target, drafter) -> list:
    """The drafts cut to ``ks``, checked before the target sees them (a drafter
    is user code): one per request, token ids in the vocabulary; trees become
    chains for a target that verifies chains only (a remote drafter may send
    trees)."""
    if len(drafts) != n:
        raise ValueError(f"{getattr(drafter, 'name', 'the drafter')} returned {len(drafts)} "
                         f"drafts for {n} requests")
    trees = hasattr(target, "keep_paths")
    out = []
    for d, k in zip(drafts, ks):
        d = d.head(k) if trees or d.parents is None else d.chain().head(k)
        if not all(_api._is_int(t) for t in d.tokens):
            kinds = sorted({type(t).__name__ for t in d.tokens if not _api._is_int(t)})
            raise TypeError(f"{getattr(drafter, 'name', 'the drafter')} drafted token ids "
                            f"that are not ints: {', '.join(kinds)}")
        tokens = [int(t) for t in d.tokens]
        if tokens and (min(tokens) < 0 or max(tokens) >= target.vocab_size):
            raise ValueError(f"{getattr(drafter, 'name', 'the drafter')} drafted token ids "
                             f"outside [0, {target.vocab_size})")
        out.append(Draft(tokens, d.probs, d.match, d.parents))
    return out


def _depth(d: Draft) -> int:
    """Nodes on the longest root-to-leaf path."""
    if d.parents is None:
        return len(d.tokens)
    depth = []
    for p in d.parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return max(depth, default=0)


def _parents(drafts):
    """The batch's parents for verify: None when every draft is a chain."""
    if all(d.parents is None for d in drafts):
        return None
    out = []
    for d in drafts:
        out.extend(range(-1, len(d.tokens) - 1) if d.parents is None else d.parents)
    return np.array(out, np.int32)


def _draft_probs(drafts, vocab):
    """One q for the batch: None when every draft is deterministic, else dense
    rows (one-hot for deterministic drafts) or SparseProbs when all are sparse."""
    live = [d for d in drafts if d.tokens]
    if not live or all(d.probs is None for d in live):
        return None
    if all(isinstance(d.probs, _api.SparseProbs) for d in live):
        width = max(d.probs.indices.shape[1] for d in live)
        idx = np.full((sum(len(d.tokens) for d in live), width), -1, np.int32)
        val = np.zeros(idx.shape, np.float32)
        r = 0
        for d in live:
            n, w = d.probs.indices.shape
            idx[r:r + n, :w] = d.probs.indices
            val[r:r + n, :w] = d.probs.values
            r += n
        return _api.SparseProbs(idx, val)
    out = []
    for d in live:
        if d.probs is None:
            q = np.zeros((len(d.tokens), vocab), np.float32)
            q[np.arange(len(d.tokens)), d.tokens] = 1.0
        elif isinstance(d.probs, _api.SparseProbs):
            q = d.probs.dense(vocab)
        else:
            q = np.asarray(d.probs, np.float32)
        out.append(q)
    return np.concatenate(out)


def _sampling(temperature, top_k, top_p, min_p, seed, method) -> Sampling:
    """One request's Sampling, its numbers checked as :func:`specfast.sample` checks them."""
    _api._method(method)
    t, p, m = (_api._scalar(v, name, False) for v, name in
               ((temperature, "temperature"), (top_p, "top_p"), (min_p, "min_p")))
    k, s = _api._scalar(top_k, "top_k", True), _api._scalar(seed, "seed", True)
    if None in (t, p, m, k, s):
        raise TypeError("generate: sampling parameters must be numbers (seed: one per prompt)")
    t, p, m = (_api._as_float(v, name) for v, name in
               ((t, "temperature"), (p, "top_p"), (m, "min_p")))
    if _api._first_bad_param(dict(temperature=t, top_k=k, top_p=p, min_p=m)) is not None:
        raise ValueError(f"generate: {_api._PARAM_RULES}; got temperature={t}, top_k={k}, "
                         f"top_p={p}, min_p={m}")
    if not 0 <= s < 1 << 64:
        raise ValueError(f"generate: seed={s} is out of range [0, 2^64)")
    return Sampling(t, k, p, m, s, method)


def _ids(prompt):
    """A prompt of token ids (numpy ints included) as a list of ints, else None."""
    if prompt and all(_api._is_int(t) for t in prompt):
        return [int(t) for t in prompt]
    return None


def _listed(prompt):
    """A 1-D numpy array of token ids (a tokenizer's return_tensors="np") as a
    list; any other prompt as it is."""
    if isinstance(prompt, np.ndarray) and prompt.ndim == 1 and prompt.dtype.kind in "iu":
        return prompt.tolist()
    return prompt


def _as_batch(prompt):
    """(list of prompts, whether one prompt was given)."""
    if isinstance(prompt, str):
        return [prompt], True
    prompt = _listed(prompt)
    if isinstance(prompt, (list, tuple)):
        ids = _ids(prompt)
        if ids is not None:
            return [ids], True
        if prompt and all(isinstance(m, dict) for m in prompt):
            return [list(prompt)], True
        if not prompt:
            raise ValueError("no prompt")
        if any(isinstance(t, (int, np.integer)) for t in prompt):
            kinds = sorted({type(t).__name__ for t in prompt})
            raise TypeError(f"token ids must all be ints, got {', '.join(kinds)}")
        # each prompt as it would be alone
        return [(isinstance(p, (list, tuple)) and _ids(p)) or p
                for p in map(_listed, prompt)], False
    raise TypeError(f"prompt must be a string, token ids, chat messages or a list of these, "
                    f"got {type(prompt).__name__}")


def plain_decoder(target) -> SpeculativeDecoder:
    """The same loop without drafting: the baseline speculative decoding is
    compared against (and must reproduce)."""
    return SpeculativeDecoder(target, None)


__all__ = ["DraftLength", "Generation", "Metrics", "SpeculativeDecoder", "plain_decoder"]
