"""Tree attention masks, positions and KV compaction against plain references."""

import zlib

import numpy as np
import pytest

import specfast


def random_parents(rng, n):
    return np.array([rng.integers(-1, i) for i in range(n)], np.int32)


def reference_mask(parents):
    n = len(parents)
    mask = np.eye(n + 1, dtype=bool)
    depth = np.zeros(n + 1, np.int32)
    for i in range(n):
        t = i + 1
        p = parents[i] + 1
        mask[t] |= mask[p]
        depth[t] = depth[p] + 1
    return mask, depth


@pytest.mark.parametrize("n", [0, 1, 7, 40, 256])
def test_tree_mask_matches_ancestor_walk(n):
    rng = np.random.default_rng(n)
    parents = random_parents(rng, n)
    mask, pos = specfast.tree_mask(parents)
    ref_mask, ref_pos = reference_mask(parents)
    np.testing.assert_array_equal(mask, ref_mask)
    np.testing.assert_array_equal(pos, ref_pos)


def test_packed_mask_and_ragged_batch():
    rng = np.random.default_rng(1)
    sizes = [3, 0, 37, 5]
    parents = np.concatenate([random_parents(rng, n) for n in sizes]).astype(np.int32)
    dense, pos = specfast.tree_mask(parents, np.array(sizes))
    packed, pos2 = specfast.tree_mask(parents, np.array(sizes), packed=True)
    width = max(sizes) + 1
    assert dense.shape == (4, width, width) and packed.shape == (4, width, 2)
    bits = np.unpackbits(packed.view(np.uint8), axis=-1, bitorder="little")[..., :width]
    np.testing.assert_array_equal(bits.astype(bool), dense)
    np.testing.assert_array_equal(pos, pos2)
    start = 0
    for b, n in enumerate(sizes):
        ref_mask, ref_pos = reference_mask(parents[start:start + n])
        np.testing.assert_array_equal(dense[b, : n + 1, : n + 1], ref_mask)
        pad = width - n - 1  # padding sees itself only
        np.testing.assert_array_equal(dense[b, n + 1:, n + 1:], np.eye(pad, dtype=bool))
        assert not dense[b, n + 1:, :n + 1].any() and not dense[b, :n + 1, n + 1:].any()
        np.testing.assert_array_equal(pos[b, : n + 1], ref_pos)
        assert (pos[b, n + 1:] == -1).all()
        start += n


def test_a_padded_batch_attends_without_nan():
    """Two attention layers over a padded batch (2 and 0 drafts) with the mask, as
    attention is written (softmax of the scores with masked ones at -inf; torch's SDPA
    returns 0 for a row of no keys, a plain kernel NaN, which the second layer's values
    spread to every row): no NaN, and the real tokens' outputs are the request's
    alone (padding is seen by none)."""
    torch = pytest.importorskip("torch")
    mask, _ = specfast.tree_mask(np.array([-1, -1], np.int32), np.array([2, 0]))
    mask = torch.from_numpy(mask)  # (B, W, W)
    x = torch.randn(2, 3, 8, dtype=torch.float64)

    def layers(x, m):
        for _ in range(2):
            scores = (x @ x.transpose(1, 2)).masked_fill(~m, -torch.inf)
            x = torch.softmax(scores, dim=-1) @ x
        return x

    out = layers(x, mask)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out[1:, :1], layers(x[1:, :1], mask[1:, :1, :1]))


def test_chain_mask_is_causal():
    mask, pos = specfast.tree_mask(None, np.array([4]))
    np.testing.assert_array_equal(mask[0], np.tril(np.ones((5, 5), bool)))
    np.testing.assert_array_equal(pos[0], np.arange(5))


def test_bad_parents_raise():
    with pytest.raises(ValueError, match="parent"):
        specfast.tree_mask(np.array([-1, 1]))
    with pytest.raises(ValueError):
        specfast.tree_mask(np.array([-1, 0]), np.array([3]))


def reference_compact(cache, nodes, acc, roots, batch_axis, seq_axis):
    out = cache.copy()
    c = np.moveaxis(out, (batch_axis, seq_axis), (0, -1))
    src = np.moveaxis(cache, (batch_axis, seq_axis), (0, -1))
    for b in range(len(acc)):
        for k in range(acc[b]):
            c[b, ..., roots[b] + 1 + k] = src[b, ..., roots[b] + 1 + nodes[b, k]]
    return out


def random_paths(rng, batch, n_nodes, seq, roots):
    nodes = np.full((batch, n_nodes), -1, np.int32)
    acc = np.zeros(batch, np.int32)
    for b in range(batch):
        room = min(n_nodes, seq - roots[b] - 1)
        k = rng.integers(0, room + 1)
        path = np.sort(rng.choice(room, size=k, replace=False)) if k else []
        nodes[b, :k] = path
        acc[b] = k
    return nodes, acc


LAYOUTS = {
    "bhsd": ((3, 2, 17, 5), 0, 2),
    "lkbhsd": ((2, 2, 4, 3, 19, 8), 2, 4),
    "bsd": ((5, 33, 7), 0, 1),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int16], ids=["f32", "f16", "bf16bits"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_kv_compact_matches_gather(layout, dtype):
    shape, ba, sa = LAYOUTS[layout]
    rng = np.random.default_rng(zlib.crc32(layout.encode()))
    cache = rng.standard_normal(shape).astype(dtype) if dtype != np.int16 else \
        rng.integers(-30000, 30000, shape).astype(np.int16)
    batch, seq = shape[ba], shape[sa]
    roots = rng.integers(0, seq // 2, batch)
    nodes, acc = random_paths(rng, batch, 9, seq, roots)
    expect = reference_compact(cache, nodes, acc, roots, ba, sa)
    specfast.kv_compact(cache, nodes, acc, roots, batch_axis=ba, seq_axis=sa)
    np.testing.assert_array_equal(cache, expect)


@pytest.mark.parametrize("view", ["transposed", "every-other-batch-row"])
def test_kv_compact_moves_within_strided_views(view):
    """A view whose axes before the sequence are strided (not the trailing ones) is
    compacted in place, and memory outside the view is untouched."""
    base = np.arange(4 * 9 * 2 * 3, dtype=np.float32).reshape(4, 9, 2, 3)
    if view == "transposed":  # (batch, seq, heads, d) seen as (batch, heads, seq, d)
        whole = base.copy()
        cache = whole.transpose(0, 2, 1, 3)
    else:
        whole = np.arange(8 * 2 * 9 * 3, dtype=np.float32).reshape(8, 2, 9, 3)
        cache = whole[::2]
    before = whole.copy()
    nodes, acc, roots = np.array([[1, 3], [0, -1], [2, 4], [0, 1]]), [2, 1, 2, 2], [0, 1, 2, 3]
    expect = reference_compact(np.ascontiguousarray(cache), nodes, acc, roots, 0, 2)
    specfast.kv_compact(cache, nodes, acc, roots, batch_axis=0, seq_axis=2)
    np.testing.assert_array_equal(cache, expect)
    if view != "transposed":
        np.testing.assert_array_equal(whole[1::2], before[1::2])


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_kv_compact_on_other_devices_moves_as_on_cpu(layout):
    """The torch path used for tensors off the CPU (run here on CPU tensors)."""
    torch = pytest.importorskip("torch")
    from specfast._tree import _kv_compact_torch, _paths

    shape, ba, sa = LAYOUTS[layout]
    rng = np.random.default_rng(zlib.crc32(layout.encode()) + 1)
    cache = rng.standard_normal(shape).astype(np.float32)
    batch, seq = shape[ba], shape[sa]
    roots = rng.integers(0, seq // 2, batch)
    nodes, acc = random_paths(rng, batch, 9, seq, roots)
    expect = reference_compact(cache, nodes, acc, roots, ba, sa)
    t = torch.from_numpy(cache.copy())
    _kv_compact_torch(t, *_paths(nodes, acc, roots), ba, sa)
    np.testing.assert_array_equal(t.numpy(), expect)


@pytest.mark.parametrize("nodes, acc, roots", [
    ([[1, 3], [0, -1]], [2, 3], [0, 2]),     # more accepted than the path's width
    ([[1, 3], [0, -1]], [2, -1], [0, 2]),    # negative count
    ([[1, 3], [0, 1]], [2, 2], [0, 10]),     # root past the cache, path already in place
    ([[1, 3], [3, 1]], [2, 2], [0, 2]),      # path not increasing
    ([[1, 3], [0, -1]], [2, 2], [0, 2]),     # -1 inside the path
    ([[1, 3], [2, 7]], [2, 2], [0, 2]),      # node past the cache's end
], ids=["count-past-width", "negative-count", "root-past-cache", "decreasing", "padding",
        "node-past-end"])
def test_kv_compact_torch_path_refuses_what_the_core_refuses(nodes, acc, roots):
    """Off-CPU tensors take the torch path: it refuses the same requests as the C
    core, with a ValueError, before moving any request (it moved the valid ones
    first, and let some through or failed inside numpy)."""
    torch = pytest.importorskip("torch")
    from specfast._tree import _kv_compact_torch, _paths

    base = np.arange(2 * 10.0, dtype=np.float32).reshape(2, 1, 10, 1)
    with pytest.raises(ValueError, match="inside the cache"):
        specfast.kv_compact(base.copy(), nodes, acc, roots, seq_axis=2)
    t = torch.from_numpy(base.copy())
    with pytest.raises(ValueError, match="inside the cache"):
        _kv_compact_torch(t, *_paths(nodes, acc, roots), 0, 2)
    np.testing.assert_array_equal(t.numpy(), base)
    with pytest.raises(ValueError, match="batch"):
        _kv_compact_torch(torch.zeros(3, 1, 10, 1), *_paths([[0]], [1], 0), 0, 2)


def test_kv_compact_torch_bfloat16_in_place():
    torch = pytest.importorskip("torch")
    cache = torch.randn(2, 4, 12, 6, dtype=torch.bfloat16)
    before = cache.view(torch.int16).numpy().copy()
    nodes = np.array([[0, 2, 5], [1, -1, -1]], np.int32)
    acc = np.array([3, 1], np.int32)
    roots = np.array([3, 0])
    expect = reference_compact(before, nodes, acc, roots, 0, 2)
    out = specfast.kv_compact(cache, nodes, acc, roots, batch_axis=0, seq_axis=2)
    assert out is cache
    np.testing.assert_array_equal(cache.view(torch.int16).numpy(), expect)


def test_kv_compact_rejects_paths_that_do_not_increase_or_overflow():
    cache = np.zeros((1, 2, 8, 4), np.float32)
    with pytest.raises(ValueError):
        specfast.kv_compact(cache, np.array([[2, 1]]), np.array([2]), np.array([0]), seq_axis=2)
    with pytest.raises(ValueError):
        specfast.kv_compact(cache, np.array([[0, 9]]), np.array([2]), np.array([0]), seq_axis=2)
    with pytest.raises(ValueError, match=r"at most .* of 1024 nodes"):  # wider than verify's
        specfast.kv_compact(cache, np.full((1, 1025), -1), np.array([0]), 0, seq_axis=2)


def test_verify_then_compact_keeps_the_accepted_path():
    # Greedy verification of a tree whose argmax path is node 1 then node 3.
    V = 10
    parents = np.array([-1, -1, 0, 1], np.int32)
    tokens = np.array([4, 7, 2, 5], np.int32)
    logits = np.zeros((5, V), np.float32)
    logits[0, 7] = 5      # root row: argmax 7 -> node 1
    logits[2, 5] = 5      # row after node 1: argmax 5 -> node 3
    logits[4, 9] = 5      # row after node 3: bonus 9
    r = specfast.verify(logits, tokens, np.array([4]), parents=parents, temperature=0.0)
    np.testing.assert_array_equal(r.tokens[0], [7, 5, 9, -1, -1])
    np.testing.assert_array_equal(r.accepted_nodes[0], [1, 3, -1, -1])
    cache = np.arange(8, dtype=np.float32).reshape(1, 1, 8, 1)  # root at slot 2
    specfast.kv_compact(cache, r.accepted_nodes, r.num_accepted, 2, seq_axis=2)
    assert cache[0, 0, 3, 0] == 4 and cache[0, 0, 4, 0] == 6  # nodes 1, 3 moved up
    assert [list(s) for s in specfast.kv_keep_slots(r.accepted_nodes, r.num_accepted, 2)] == [[2, 4, 6]]


def test_tree_helpers_take_an_empty_batch_from_lists():
    cache = np.zeros((0, 2, 8, 4), np.float32)
    assert specfast.kv_compact(cache, np.zeros((0, 2), np.int32), [], []) is cache
    assert specfast.kv_keep_slots(np.zeros((0, 2), np.int32), [], []) == []


@pytest.mark.parametrize("root", [2**63 - 2, 2**63, 2**70, -1, [2**70]])
def test_kv_compact_root_slot_out_of_range(root):
    """A root slot near 2^63 made root + 1 + node wrap negative, past the bounds
    check: memmove wrote before the cache (heap corruption)."""
    cache = np.zeros((1, 10, 4), np.float32)
    with pytest.raises(ValueError):
        specfast.kv_compact(cache, np.array([[1]]), np.array([1]), root)
    with pytest.raises(ValueError):
        specfast.kv_keep_slots(np.array([[1]]), np.array([1]), root)


@pytest.mark.parametrize("call, error", [
    # moving PyObject pointers without their reference counts crashed later
    (lambda: specfast.kv_compact(np.empty((1, 6, 1), object), [[1, 3]], [2], 0), TypeError),
    (lambda: specfast.kv_compact(np.array(1.0), np.zeros((0, 0), int), np.zeros(0, int), 0),
     ValueError),
    (lambda: specfast.kv_compact(np.zeros((2, 3, 10, 4)), [[1, 3], [0, -1]], [2, 1], 2,
                                 batch_axis=4), ValueError),
    (lambda: specfast.kv_keep_slots([[1, 3], [0, -1]], [5, 2], [2, 4]), ValueError),
    (lambda: specfast.kv_keep_slots([[1, 3], [0, -1]], [2, 2], [2, 4]), ValueError),
    (lambda: specfast.kv_keep_slots(np.array([[1, 3]]), np.array([2, 1]), [2, 4]), ValueError),
    # a path goes down the tree: kv_compact refuses these too
    (lambda: specfast.kv_keep_slots([[3, 1]], [2], 0), ValueError),
    (lambda: specfast.kv_keep_slots([[2, 2]], [2], 0), ValueError),
    (lambda: specfast.tree_mask(None, [2**31 - 1]), ValueError),  # before allocating 4 EiB
], ids=["object-cache", "0-d-cache", "axis", "accepted-past-width", "accepted-padding",
        "batch", "path-up", "path-repeats", "huge-tree"])
def test_tree_helpers_reject_bad_input(call, error):
    with pytest.raises(error):
        call()


def test_tree_mask_names_the_node_whose_parent_is_bad():
    """As verify does: the request, the node and the rule."""
    with pytest.raises(specfast.RequestError, match=r"request 1\): node 2: parent 2 is not in "
                                                   r"\[-1, 2\)") as e:
        specfast.tree_mask(np.array([-1, -1, 0, 2]), [1, 3])
    assert e.value.index == 1


@pytest.mark.parametrize("kind", ["torch-batch", "torch-heads", "numpy-seq", "meta-batch", "c-core"])
def test_kv_compact_refuses_caches_whose_entries_share_memory(kind):
    """An expanded or broadcast axis (stride 0) would let one request's move overwrite
    another's: refused before anything moves (it was written through silently)."""
    nodes, acc = np.array([[2, -1], [1, 3]]), np.array([1, 2])
    if kind == "c-core":  # what a direct C caller gets
        from specfast._lib import ffi, lib
        base = np.arange(20.0, dtype=np.float32)
        c = ffi.new("sf_kv_cache *", {"data": ffi.cast("void *", base.ctypes.data),
                                      "n_outer": 1, "batch": 2, "batch_stride": 0, "n_inner": 1,
                                      "seq_len": 10, "seq_stride": 4, "row_bytes": 4})
        n32, a32 = nodes.astype(np.int32), acc.astype(np.int32)
        roots = np.zeros(2, np.int64)
        ptr = lambda a, t: ffi.cast(t, a.ctypes.data)
        status = lib().sf_kv_compact(c, ptr(n32, "int32_t *"), ptr(a32, "int32_t *"), 2,
                                     ptr(roots, "int64_t *"), ffi.NULL)
        assert status != 0 and np.array_equal(base, np.arange(20.0))
        return
    if kind == "numpy-seq":
        own = np.arange(2 * 10.0, dtype=np.float32).reshape(2, 1, 10, 1)
        cache = np.lib.stride_tricks.as_strided(own, (2, 1, 10, 1), (40, 40, 0, 4), writeable=True)
    else:
        torch = pytest.importorskip("torch")
        device = "meta" if kind == "meta-batch" else "cpu"
        if kind == "torch-heads":
            cache = torch.arange(20.0).reshape(2, 1, 10, 1).expand(2, 3, 10, 1)
        else:
            cache = torch.arange(10.0, device=device).reshape(1, 1, 10, 1).expand(2, 1, 10, 1)
    before = np.array(cache) if kind != "meta-batch" else None
    with pytest.raises(ValueError, match="stride 0"):
        specfast.kv_compact(cache, nodes, acc, 0, batch_axis=0, seq_axis=2)
    if before is not None:
        np.testing.assert_array_equal(np.array(cache), before)


def test_kv_compact_edge_layouts():
    """An empty cache is a no-op (its paths still checked); a tensor that requires
    grad is compacted in place."""
    empty = np.zeros((2, 3, 0, 4), np.float32)
    assert specfast.kv_compact(empty, np.zeros((2, 0), int), np.zeros(2, int), 0) is empty
    with pytest.raises(ValueError):
        specfast.kv_compact(empty, np.ones((2, 1), int), np.ones(2, int), 0)
    torch = pytest.importorskip("torch")
    cache = torch.arange(2 * 10.0).reshape(2, 10, 1).requires_grad_()
    specfast.kv_compact(cache, [[1, 3], [0, -1]], [2, 1], [2, 4], seq_axis=1)
    assert cache[0, :6, 0].tolist() == [0, 1, 2, 4, 6, 5]


def test_kv_compact_moves_bytes_of_any_dtype():
    """Entries are moved as bytes: torch dtypes numpy lacks (float8) too."""
    torch = pytest.importorskip("torch")
    ref = torch.arange(2 * 10 * 4, dtype=torch.float32).reshape(2, 10, 4)
    want = ref.clone()
    specfast.kv_compact(want, [[1, 3], [0, -1]], [2, 1], [2, 4], seq_axis=1)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16):
        cache = ref.to(dtype)
        assert specfast.kv_compact(cache, [[1, 3], [0, -1]], [2, 1], [2, 4], seq_axis=1) is cache
        assert torch.equal(cache.float(), want.to(dtype).float()), dtype


def test_kv_compact_of_an_empty_batch_with_draft_width():
    cache = np.zeros((0, 4, 16, 8), np.float32)
    out = specfast.kv_compact(cache, np.zeros((0, 4), np.int32), np.zeros(0, np.int32),
                              np.zeros(0, np.int64))
    assert out is cache


def test_kv_compact_refuses_overlapping_axes():
    """An as_strided view whose request 1 slot s is request 0's slot s + 1: a move of
    one request would write the other's entries. Refused, nothing moved."""
    base = np.arange(12.0, dtype=np.float32)
    view = np.lib.stride_tricks.as_strided(base, (2, 1, 10, 1), (4, 4, 4, 4), writeable=True)
    with pytest.raises(ValueError, match="overlap"):
        specfast.kv_compact(view, np.array([[2], [0]]), np.array([1, 0]), np.array([0, 0]),
                            seq_axis=2)
    np.testing.assert_array_equal(base, np.arange(12.0))


def test_tree_mask_gives_torch_for_torch():
    torch = pytest.importorskip("torch")
    mask, pos = specfast.tree_mask(torch.tensor([-1, -1, 0]), torch.tensor([3]))
    want_mask, want_pos = specfast.tree_mask(np.array([-1, -1, 0]), np.array([3]))
    assert isinstance(mask, torch.Tensor) and isinstance(pos, torch.Tensor)
    assert mask.dtype == torch.bool and np.array_equal(mask.numpy(), want_mask)
    assert np.array_equal(pos.numpy(), want_pos)
