"""A plain torch implementation of what :func:`specfast.verify` computes.

This is the peer baseline of the benchmarks (``specfast bench``, ``bench/``): the way
serving stacks verify drafts today, written carefully and vectorised over the batch,
with no Python loop per request or token:

- the target distribution of *every* row (as the model produced them, draft rows included):
  widen to float32, divide by the temperature; for top-k / top-p, sort each row (stable,
  descending; ``torch.topk`` when every row has a top_k) and mask the tail; softmax; min-p;
- ``method="rejection"``: gather p(x) and q(x) of each draft token, accept while
  ``u * q(x) < p(x)`` (float64 uniforms), gather the row where the chain stopped, form the
  residual ``max(0, p - q)`` (or p at the bonus position) and draw from it by inverse CDF
  (or :func:`torch.multinomial`, ``sampler="multinomial"``);
- ``method="coupled"``: the Gumbel-max token of every row, ``argmax(p / E)`` with
  ``E ~ Exp(1)`` (the exponential race), and accept while the draft equals it.

The semantics follow ALGORITHMS.md (filter order, a zero q(x) rejects; ties rank the lower
token id first on the sort path, in torch.topk's order on the top-k path). The random
streams are torch's own, so the tokens differ from specfast's draw by draw but follow the
same distribution (tests/test_bench_cli.py checks that).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

__all__ = ["TorchVerifyResult", "torch_probs", "torch_verify"]


class TorchVerifyResult(NamedTuple):
    """``tokens`` ``(B, K + 1)`` int32 padded with -1, ``num_accepted`` ``(B,)`` int32."""

    tokens: torch.Tensor
    num_accepted: torch.Tensor


def _per_row(value, rows, dtype, device):
    """(tensor (rows, 1), or the Python scalar when the value is one number)."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return value.item(), None
        return None, value.to(device=device, dtype=dtype).reshape(rows, 1)
    if hasattr(value, "__len__"):
        t = torch.as_tensor(value, dtype=dtype, device=device)
        if t.numel() == 1:
            return t.item(), None
        return None, t.reshape(rows, 1)
    return value, None


def torch_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The target distribution of each row of ``logits`` ``(..., V)`` as float32.

    Temperature, then top_k, top_p (sorting each row), then min_p, renormalising after
    each; parameters are scalars or one value per row. Temperature 0 is greedy.
    """
    shape = logits.shape
    x = logits.reshape(-1, shape[-1])
    rows, vocab = x.shape
    dev = x.device
    # Widened to float32 as serving stacks do; a copy made here is scaled in place
    # (the caller's float32 logits are not).
    copied = x.dtype != torch.float32
    x = x.float()
    t, t_rows = _per_row(temperature, rows, torch.float32, dev)
    k, k_rows = _per_row(top_k, rows, torch.int64, dev)
    p, p_rows = _per_row(top_p, rows, torch.float32, dev)
    m, m_rows = _per_row(min_p, rows, torch.float32, dev)

    greedy = None
    if t_rows is not None:
        greedy = t_rows == 0
        scale = torch.where(greedy, torch.ones_like(t_rows), t_rows)
        x = x.div_(scale) if copied else x / scale
        if not bool(greedy.any()):
            greedy = None
    elif t == 0:
        greedy = True
    elif t != 1.0:
        x = x.div_(t) if copied else x / t

    use_k = k_rows is not None or 0 < k < vocab
    use_p = p_rows is not None or p < 1.0
    if use_k or use_p:
        kk = k_rows if k_rows is not None else torch.tensor([[k]], device=dev)
        kk = torch.where((kk <= 0) | (kk > vocab), torch.full_like(kk, vocab), kk)
        if use_k and bool((kk < vocab).all()):
            # Every row keeps at most k tokens: the k largest, sorted, are all the filter
            # needs (the fast path of serving stacks, e.g. vLLM's top-k only path).
            srt, idx = x.topk(int(kk.max()), dim=-1, sorted=True)
        else:
            # The full sort that serving stacks use for top-p (stable: ties keep the
            # lower id first, as specfast orders them).
            srt, idx = x.sort(dim=-1, descending=True, stable=True)
        if use_k:
            rank = torch.arange(srt.shape[-1], device=dev)
            srt = srt.masked_fill(rank >= kk, float("-inf"))
        if use_p:
            ps = srt.softmax(dim=-1)
            before = ps.cumsum(dim=-1) - ps  # mass of the more probable tokens
            pp = p_rows if p_rows is not None else p
            drop = before >= pp
            drop[:, 0] = False
            srt = srt.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter_(-1, idx, srt)
    probs = x.softmax(dim=-1)
    if m_rows is not None or m > 0.0:
        mm = m_rows if m_rows is not None else m
        probs = probs.masked_fill(probs < mm * probs.amax(dim=-1, keepdim=True), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if greedy is not None:
        one_hot = torch.zeros_like(probs).scatter_(-1, x.argmax(dim=-1, keepdim=True), 1.0)
        probs = one_hot if greedy is True else torch.where(greedy, one_hot, probs)
    return probs.reshape(shape)


def _draw(weights, generator, sampler):
    """One token per row of non-negative ``weights`` (B, V), proportionally."""
    if sampler == "multinomial":
        return torch.multinomial(weights, 1, generator=generator)[:, 0]
    if sampler != "cdf":
        raise ValueError(f"sampler must be 'cdf' or 'multinomial', got {sampler!r}")
    c = weights.cumsum(dim=-1, dtype=torch.float64)
    u = torch.rand((c.shape[0], 1), dtype=torch.float64, generator=generator,
                   device=c.device) * c[:, -1:]
    # The first index whose cumulative mass exceeds u: zero-weight tokens are never drawn.
    return torch.searchsorted(c, u, right=True)[:, 0].clamp_max(c.shape[1] - 1)


def _layout(num_draft, dev):
    """Row index (B, K + 1) of each (request, depth) and the valid mask (B, K)."""
    nd = num_draft.to(device=dev, dtype=torch.int64)
    start = torch.cumsum(nd + 1, 0) - (nd + 1)
    kmax = int(nd.max()) if nd.numel() else 0
    depth = torch.arange(kmax + 1, device=dev)
    row = start[:, None] + torch.minimum(depth[None, :], nd[:, None])
    node = (start - torch.arange(nd.numel(), device=dev))[:, None] + depth[None, :kmax]
    return nd, kmax, row, node, depth[None, :kmax] < nd[:, None]


def torch_verify(target_logits, draft_tokens, num_draft, *, draft_probs=None,
                 temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, method="rejection",
                 generator=None, sampler="cdf"):
    """Chain verification of a ragged batch, as :func:`specfast.verify` (chains only).

    Parameters
    ----------
    target_logits : tensor ``(sum(num_draft + 1), V)``, any float dtype
    draft_tokens : int tensor ``(N,)``; num_draft : int tensor ``(B,)``
    draft_probs : None (one-hot drafts), float tensor ``(N, V)``, or a pair
        ``(ids, values)`` of ``(N, S)`` tensors (sparse top-S draft distributions).
    temperature, top_k, top_p, min_p : scalar or ``(B,)``
    method : {"rejection", "coupled"}
    generator : torch.Generator or None
    sampler : {"cdf", "multinomial"}
        How the final token is drawn from the residual: inverse CDF (float64 cumsum and
        ``torch.searchsorted``), or ``torch.multinomial``, which is ~10x slower on CPU
        at these vocabulary sizes; the default keeps the baseline fast.

    Returns
    -------
    TorchVerifyResult
    """
    dev = target_logits.device
    rows, vocab = target_logits.shape
    num_draft = torch.as_tensor(num_draft)
    draft_tokens = torch.as_tensor(draft_tokens).to(device=dev, dtype=torch.int64)
    nd, kmax, row, node, valid = _layout(num_draft, dev)
    batch = nd.numel()
    uniform = bool((nd == kmax).all())

    # Per request parameters broadcast to its K + 1 rows.
    def rowwise(v):
        if (v.numel() if isinstance(v, torch.Tensor) else np.size(v)) > 1:
            return torch.as_tensor(v, device=dev).reshape(batch, 1).expand(batch, kmax + 1)
        return v

    if uniform:  # a view: no copy of the logits
        logits3 = target_logits.view(batch, kmax + 1, vocab)
    else:
        logits3 = target_logits[row]
    p = torch_probs(logits3, rowwise(temperature), rowwise(top_k), rowwise(top_p),
                    rowwise(min_p))  # (B, K + 1, V)
    nidx = node.clamp(0, max(draft_tokens.numel() - 1, 0))
    if kmax:
        draft = torch.where(valid, draft_tokens[nidx], 0)
    else:
        draft = torch.zeros(batch, 0, dtype=torch.int64, device=dev)
    ar = torch.arange(batch, device=dev)

    if method == "coupled":
        # The exponential race: argmax p / E, E ~ Exp(1), per row (= Gumbel-max on log p).
        # E = -log U: on the CPU, Tensor.exponential_ draws on one thread, several
        # times slower than the rest of this method; U > 0 so that E stays finite.
        noise = torch.rand(p.shape, generator=generator, device=dev)
        noise = noise.clamp_min_(torch.finfo(noise.dtype).tiny).log_().neg_()
        target = (p / noise).argmax(dim=-1)  # (B, K + 1)
        accept = (draft == target[:, :kmax]) & valid
        n_acc = accept.to(torch.int32).cumprod(dim=1).sum(dim=1)
        final = target[ar, n_acc]
    elif method == "rejection":
        p_x = p[:, :kmax].gather(-1, draft[..., None])[..., 0]
        if draft_probs is None:
            q_x = torch.ones_like(p_x)
        elif isinstance(draft_probs, torch.Tensor):
            q3 = draft_probs.view(batch, kmax, vocab) if uniform else draft_probs[nidx]
            q_x = q3.gather(-1, draft[..., None])[..., 0]
        else:
            ids, vals = (torch.as_tensor(a, device=dev) for a in draft_probs)
            ids3, vals3 = ids[nidx], vals[nidx]
            q_x = (vals3.float() * (ids3 == draft[..., None])).sum(-1)
        # float64 uniforms: float32 torch.rand can return exactly 0 (vLLM's fix).
        u = torch.rand(p_x.shape, dtype=torch.float64, generator=generator, device=dev)
        accept = (u * q_x < p_x) & (q_x > 0) & valid
        n_acc = accept.to(torch.int32).cumprod(dim=1).sum(dim=1)
        rejected = n_acc < nd
        p_stop = p[ar, n_acc]  # (B, V): the row where the chain stopped
        at = n_acc.clamp_max(max(kmax - 1, 0)).long()
        if kmax == 0 or not bool(rejected.any()):
            resid = p_stop
        elif draft_probs is None:
            resid = p_stop.clone()
            hit = ar[rejected]
            resid[hit, draft[hit, at[hit]]] = 0.0
        elif isinstance(draft_probs, torch.Tensor):
            q_stop = q3[ar, at].float()
            resid = torch.where(rejected[:, None], (p_stop - q_stop).clamp_min_(0.0), p_stop)
        else:
            sub = vals3[ar, at].float() * rejected[:, None]
            resid = p_stop.scatter_add(-1, ids3[ar, at].clamp_min(0).long(), -sub).clamp_min_(0.0)
        # Rounding can leave a residual of mass 0: fall back to p there.
        empty = resid.sum(dim=-1) <= 0
        if bool(empty.any()):
            resid = torch.where(empty[:, None], p_stop, resid)
        final = _draw(resid, generator, sampler)
    else:
        raise ValueError(f"method must be 'rejection' or 'coupled', got {method!r}")

    n_acc = n_acc.to(torch.int32)
    tokens = torch.full((batch, kmax + 1), -1, dtype=torch.int32, device=dev)
    if kmax:
        keep = torch.arange(kmax, device=dev)[None, :] < n_acc[:, None]
        tokens[:, :kmax] = torch.where(keep, draft.to(torch.int32), -1)
    tokens[ar, n_acc.long()] = final.to(torch.int32)
    return TorchVerifyResult(tokens, n_acc)
