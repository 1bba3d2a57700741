"""Token trees around verification: attention masks, positions, KV compaction."""

from __future__ import annotations

import operator

import numpy as np

from ._api import (_MAX_BATCH, _MAX_DRAFT, _as_array, _bad_parent, _int_array, _is_torch, _ptr,
                   _strided, _torch)
from ._lib import check, ffi, lib


def tree_mask(parents, num_draft=None, *, packed=False):
    """Attention mask and positions of draft trees.

    Parameters
    ----------
    parents : int array ``(N,)`` or None
        Per draft node, the local index of its parent (-1: a child of the
        root), as for :func:`specfast.verify`. None: chains.
    num_draft : int array ``(B,)`` or None
        Nodes per request. None: one request of ``len(parents)`` nodes.
    packed : bool
        Return the mask bit-packed: ``uint32`` words, bit ``j % 32`` of word
        ``j // 32`` for token j.

    Returns
    -------
    mask : ``(B, W, W)`` bool, or ``(B, W, ceil(W / 32))`` uint32 when packed,
        with ``W = max(num_draft) + 1``; token 0 is the root (the token of the
        request's first logits row), token ``1 + i`` is node i; ``mask[b, i, j]``
        says whether token i attends to token j (itself or an ancestor).
        A token past a request's tokens (padding) attends to itself only (with
        no key at all an attention kernel gives NaN, which the next layer's
        values would spread to every row). Without ``num_draft`` the batch
        axis is dropped.
    positions : ``(B, W)`` int32 depth of each token (root 0; add the root's
        absolute position), -1 past a request's tokens.
    Both are torch tensors when ``parents`` or ``num_draft`` is one.

    Examples
    --------
    >>> mask, pos = specfast.tree_mask(np.array([-1, -1, 0]))
    >>> pos
    array([0, 1, 1, 2], dtype=int32)
    """
    single = num_draft is None
    par = None if parents is None else _int_array(parents, "parents", 1)
    if single:
        if par is None:
            raise ValueError("tree_mask: give parents, num_draft or both")
        nd = np.array([par.shape[0]], np.int32)
    else:
        nd = _int_array(num_draft, "num_draft", 1)
    counts = nd.tolist()
    if min(counts, default=0) < 0 or max(counts, default=0) > _MAX_DRAFT:
        raise ValueError(f"num_draft must be in [0, {_MAX_DRAFT}]")
    if par is not None and sum(counts) != par.shape[0]:
        raise ValueError(f"sum(num_draft) = {sum(counts)} but parents has {par.shape[0]} entries")
    batch, width = len(counts), max(counts, default=0) + 1
    words = (width + 31) // 32
    mask = np.empty((batch, width, words), np.uint32) if packed else \
        np.empty((batch, width, width), np.uint8)
    positions = np.empty((batch, width), np.int32)
    err = ffi.new("sf_error *")
    status = lib().sf_tree_mask(
        ffi.NULL if par is None else _ptr("int32_t *", par), _ptr("int32_t *", nd),
        batch, width - 1,
        ffi.NULL if packed else _ptr("uint8_t *", mask),
        _ptr("uint32_t *", mask) if packed else ffi.NULL,
        _ptr("int32_t *", positions), err)
    detail = None
    if status == lib().SF_ERR_PARENT and par is not None and err.index >= 0:
        detail = _bad_parent(err.index, nd, par)  # which node, as verify says
    check(status, "specfast.tree_mask", err.index, detail)
    if not packed:
        mask = mask.view(np.bool_)
    if _is_torch(parents) or _is_torch(num_draft):
        mask, positions = _torch().from_numpy(mask), _torch().from_numpy(positions)
    if single:
        return mask[0], positions[0]
    return mask, positions


def _slots(root_slot, batch):
    """root_slot as (batch,) int64: one int or one per request."""
    r = _as_array(root_slot, "root_slot")
    if r.dtype.kind not in "iu":
        raise TypeError(f"root_slot must hold integers, got {root_slot!r}")
    if r.ndim > 1 or (r.ndim == 1 and r.shape[0] != batch):
        raise ValueError(f"root_slot must be an int or have one per request ({batch})")
    if r.size and (r.min() < 0 or r.max() >= 1 << 62):
        raise ValueError("root_slot must be in [0, 2^62)")
    return np.broadcast_to(r.astype(np.int64), (batch,)).copy()


def _paths(accepted_nodes, num_accepted, root_slot):
    """(nodes, num_accepted, root slots) as verify returns them, checked to agree
    on the batch."""
    nodes = _int_array(accepted_nodes, "accepted_nodes", 2)
    acc = _int_array(num_accepted, "num_accepted", 1)
    if nodes.shape[0] != acc.shape[0]:
        raise ValueError("accepted_nodes and num_accepted disagree on the batch size")
    if nodes.shape[1] > _MAX_DRAFT or acc.shape[0] > _MAX_BATCH:
        raise ValueError(f"accepted_nodes of shape {nodes.shape}: at most {_MAX_BATCH} requests "
                         f"of {_MAX_DRAFT} nodes, as verify returns them")
    return nodes, acc, _slots(root_slot, acc.shape[0])


def _axes(ndim, batch_axis, seq_axis):
    """The batch and sequence axes as indices in [0, ndim), batch first."""
    if ndim < 2:
        raise ValueError("kv_compact: the cache needs a batch and a sequence axis")
    axes = []
    for name, axis in (("batch_axis", batch_axis), ("seq_axis", seq_axis)):
        axis = operator.index(axis)
        if not -ndim <= axis < ndim:
            raise ValueError(f"kv_compact: {name}={axis} is not an axis of a {ndim}-D cache")
        axes.append(axis % ndim)
    if not axes[0] < axes[1]:
        raise ValueError("kv_compact: the batch axis must come before the sequence axis")
    return axes


def _refuse_aliases(shape, strides, itemsize=1):
    """Entries that share memory (a stride-0 axis: a broadcast or expanded view;
    or axes whose strides overlap, as an as_strided view may) would have one
    request's move overwrite another's: refused, as torch refuses in-place writes
    there. The test is the usual sufficient one: sorted by stride, each axis steps
    past all that the smaller ones span (every view of one buffer passes). An
    empty cache has nothing to share (numpy gives it any strides)."""
    if 0 in tuple(shape):
        return
    for ax, (n, s) in enumerate(zip(shape, strides)):
        if n > 1 and s == 0:
            raise ValueError(f"kv_compact: axis {ax} of the cache has stride 0 (a broadcast or "
                             "expanded view), so its entries share memory; pass a copy")
    span = itemsize
    for s, n in sorted((abs(s), n) for n, s in zip(shape, strides) if n > 1):
        if s < span:
            raise ValueError("kv_compact: the cache's axes overlap in memory (its entries "
                             "share bytes); pass a copy")
        span += s * (n - 1)


def _merge(shape, strides, axes, name):
    """One (count, stride) for consecutive axes that address memory as one."""
    count, stride = 1, 0
    for ax in reversed(axes):
        if shape[ax] == 1:
            continue
        if count > 1 and strides[ax] != stride * count:
            raise ValueError(f"kv_compact: the {name} axes of the cache cannot be merged")
        if count == 1:
            stride = strides[ax]
        count *= shape[ax]
    return count, stride


def kv_compact(cache, accepted_nodes, num_accepted, root_slot, *, batch_axis=0, seq_axis=-2):
    """Moves each request's accepted tree path to where a chain would hold it.

    After :func:`specfast.verify` on trees, the KV entries of the accepted
    nodes sit at ``root_slot[b] + 1 + node``; this moves entry
    ``accepted_nodes[b, k]`` to slot ``root_slot[b] + 1 + k`` in place, for
    ``k < num_accepted[b]``, so that the cache can be cropped as after a chain.

    Parameters
    ----------
    cache : numpy array or torch tensor of any dtype (its entries are moved as bytes)
        Any layout with a batch axis before a sequence axis, whose axes after
        the sequence axis are contiguous, e.g. ``(batch, heads, seq, head_dim)``
        or ``(layers, 2, batch, heads, seq, head_dim)``; on the CPU the axes
        before the batch axis, and those between it and the sequence axis, must
        each merge into one stride (as in a view of one buffer that keeps their
        order), else ValueError. Modified in place; a broadcast or expanded view
        (an axis with stride 0) is refused.
    accepted_nodes : int array ``(B, max_draft)``, ``num_accepted`` ``(B,)``
        As :func:`specfast.verify` returns them.
    root_slot : int array ``(B,)`` or int
        The cache slot of each tree's root token.
    batch_axis, seq_axis : int
        Which axes of `cache` are the batch and the sequence.

    Returns
    -------
    The cache (the same object).
    """
    nodes, acc, roots = _paths(accepted_nodes, num_accepted, root_slot)
    batch = acc.shape[0]
    if _is_torch(cache):
        _strided(cache, "kv_compact: cache")
        # torch moves a negated or conjugated view's entries (numpy has no view of them)
        if cache.device.type != "cpu" or cache.is_neg() or cache.is_conj():
            ba, sa = _axes(cache.dim(), batch_axis, seq_axis)
            _refuse_aliases(cache.shape, cache.stride())
            return _kv_compact_torch(cache, nodes, acc, roots, ba, sa)
        t = cache.detach()  # the same memory: moved in place, outside autograd
        # bytes are bytes: dtypes numpy lacks (bfloat16, float8, ...) as integers
        # of their size
        ints = {1: _torch().uint8, 2: _torch().int16, 4: _torch().int32, 8: _torch().int64}
        try:
            arr = t.numpy()
        except TypeError:
            if t.element_size() not in ints:
                raise
            arr = t.view(ints[t.element_size()]).numpy()
    else:
        arr = cache
    if not isinstance(arr, np.ndarray):
        raise TypeError("kv_compact: cache must be a numpy array or a torch tensor")
    if arr.dtype.hasobject:
        raise TypeError("kv_compact: the cache must hold numbers, not Python objects")
    ba, sa = _axes(arr.ndim, batch_axis, seq_axis)
    nd = arr.ndim
    if arr.shape[ba] != batch:
        raise ValueError(f"kv_compact: cache batch {arr.shape[ba]} != {batch} requests")
    if arr.size == 0:
        # Nothing to move (numpy gives empty arrays any strides); a stand-in with
        # the same axes up to the sequence still has the paths checked against it.
        arr = np.empty(arr.shape[:sa + 1] + (1,), np.uint8)
        nd = arr.ndim
    tail = list(range(sa + 1, nd))
    row_count, row_stride = _merge(arr.shape, arr.strides, tail, "trailing")
    if row_count > 1 and row_stride != arr.itemsize:
        raise ValueError("kv_compact: the axes after the sequence axis must be contiguous")
    if not arr.flags.writeable:
        raise ValueError("kv_compact: the cache is read-only")
    _refuse_aliases(arr.shape, arr.strides, arr.itemsize)
    n_outer, outer_stride = _merge(arr.shape, arr.strides, list(range(ba)), "leading")
    n_inner, inner_stride = _merge(arr.shape, arr.strides, list(range(ba + 1, sa)), "middle")
    c = ffi.new("sf_kv_cache *")
    c.data = ffi.cast("void *", arr.ctypes.data)
    c.n_outer, c.outer_stride = n_outer, outer_stride
    c.batch, c.batch_stride = batch, arr.strides[ba]
    c.n_inner, c.inner_stride = n_inner, inner_stride
    c.seq_len, c.seq_stride = arr.shape[sa], arr.strides[sa]
    c.row_bytes = row_count * arr.itemsize
    err = ffi.new("sf_error *")
    status = lib().sf_kv_compact(c, _ptr("int32_t *", nodes) if nodes.size else ffi.NULL,
                                 _ptr("int32_t *", acc), nodes.shape[1] if nodes.size else 0,
                                 _ptr("int64_t *", roots), err)
    check(status, "specfast.kv_compact", err.index,
          "accepted nodes must increase along the path and stay inside the cache")
    return cache


def _kv_compact_torch(cache, nodes, acc, roots, ba, sa):
    """The same move for tensors on another device, with torch indexing (ba < sa),
    after the C core's checks on every request before anything moves."""
    torch = _torch()
    batch, width, seq = acc.shape[0], nodes.shape[1], cache.shape[sa]
    if cache.shape[ba] != batch:
        raise ValueError(f"kv_compact: cache batch {cache.shape[ba]} != {batch} requests")
    paths = []
    for b in range(batch):
        n = int(acc[b])
        path = nodes[b, :max(n, 0)].astype(np.int64)
        if not 0 <= n <= width or n and (roots[b] >= seq or path[0] < 0 or
                                         np.any(np.diff(path) <= 0) or
                                         path[-1] >= seq - 1 - roots[b]):
            raise ValueError(f"specfast.kv_compact: request {b}: accepted nodes must increase "
                             "along the path and stay inside the cache")
        paths.append(path)
    for b, path in enumerate(paths):
        n = path.shape[0]
        if n == 0 or np.all(path == np.arange(n)):
            continue
        src = torch.as_tensor(roots[b] + 1 + path, device=cache.device)
        dst = torch.as_tensor(roots[b] + 1 + np.arange(n), device=cache.device)
        view = cache.select(ba, b)  # the sequence axis is now sa - 1
        view.index_copy_(sa - 1, dst, view.index_select(sa - 1, src))
    return cache


def kv_keep_slots(accepted_nodes, num_accepted, root_slot):
    """The cache slots to keep per request, root first, in depth order.

    Returns a list of int64 arrays: ``[root, root + 1 + node_0, ...]``, for
    servers that gather instead of compacting in place.
    """
    nodes, acc, roots = _paths(accepted_nodes, num_accepted, root_slot)
    if acc.size and (acc.min() < 0 or acc.max() > nodes.shape[1]):
        raise ValueError(f"num_accepted must be in [0, {nodes.shape[1]}] (accepted_nodes' width)")
    slots = []
    for b, r in enumerate(roots):
        path = nodes[b, : acc[b]].astype(np.int64)
        if path.size and path.min() < 0:
            raise ValueError(f"accepted_nodes[{b}] holds -1 among its first {acc[b]} entries")
        if np.any(np.diff(path) <= 0):  # a child comes after its parent, as kv_compact checks
            raise ValueError(f"accepted_nodes[{b}] must increase along the path")
        slots.append(np.concatenate([[r], r + 1 + path]))
    return slots
