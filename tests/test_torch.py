"""torch in -> torch out (CPU): same values as the numpy path, bfloat16 included."""

import numpy as np
import pytest

import specfast as sf
from reference import BF16, TOLERANCES, as_f64, pack, random_request, ref_probs, safe_params

torch = pytest.importorskip("torch")

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def to_torch(x, dtype):
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(TORCH_DTYPES[dtype])


def same_in_numpy(t):
    """The numpy array holding exactly the values of a torch logits tensor."""
    if t.dtype == torch.bfloat16:
        if BF16 is None:
            return None
        return t.float().numpy().astype(BF16)
    return t.numpy()


def batch(rng, n=200, vocab=13):
    reqs = [random_request(rng, vocab, 5, tree=bool(i % 2)) for i in range(n)]
    return pack(reqs, "dense")


@pytest.mark.parametrize("method", ["rejection", "coupled"])
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_verify_torch_matches_numpy(dtype, method, rng):
    (logits, tokens, nd), kw = batch(rng)
    tl = to_torch(logits, dtype)
    tkw = dict(kw)
    tkw["draft_probs"] = torch.from_numpy(kw["draft_probs"][1])
    tkw["parents"] = torch.from_numpy(kw["parents"])
    res = sf.verify(tl, torch.from_numpy(tokens), torch.from_numpy(nd), **tkw, method=method)
    for f in ("tokens", "num_accepted", "accepted_nodes"):
        v = getattr(res, f)
        assert isinstance(v, torch.Tensor), f"{f} is {type(v)}"
        assert v.dtype == torch.int32 and v.device.type == "cpu"
    ref_logits = same_in_numpy(tl)
    if ref_logits is None:
        ref_logits = as_f64(tl).astype(np.float32)  # same values; results agree closely
    nkw = dict(kw, draft_probs=kw["draft_probs"][1])
    ref = sf.verify(ref_logits, tokens, nd, **nkw, method=method)
    if same_in_numpy(tl) is not None:
        for f in ("tokens", "num_accepted", "accepted_nodes"):
            np.testing.assert_array_equal(getattr(res, f).numpy(), getattr(ref, f), err_msg=f)
    else:
        assert (res.tokens.numpy() == ref.tokens).all(axis=1).mean() > 0.99


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_sample_and_probs_torch(dtype, rng):
    x = (rng.standard_normal((64, 111)) * 2).astype(np.float32)
    t = to_torch(x, dtype)
    rows = as_f64(t)
    top_p = np.array([safe_params(r, 0.8, 20, 0.9)[0] for r in rows], np.float32)
    p = sf.probs(t, temperature=0.8, top_k=20, top_p=torch.from_numpy(top_p))
    assert isinstance(p, torch.Tensor) and p.dtype == torch.float32 and p.shape == (64, 111)
    np.testing.assert_allclose(p.numpy(), ref_probs(rows, 0.8, 20, top_p), **TOLERANCES[dtype])
    s = sf.sample(t, seed=3, position=torch.arange(64))
    assert isinstance(s, torch.Tensor) and s.dtype == torch.int32 and s.shape == (64,)
    n = same_in_numpy(t)
    if n is not None:
        np.testing.assert_array_equal(s.numpy(), sf.sample(n, seed=3, position=np.arange(64)))
        np.testing.assert_array_equal(
            p.numpy(), sf.probs(n, temperature=0.8, top_k=20, top_p=top_p)
        )


def test_torch_non_contiguous_and_int64_positions(rng):
    x = (rng.standard_normal((30, 50)) * 2).astype(np.float32)
    wide = torch.zeros(30, 80)
    wide[:, 10:60] = torch.from_numpy(x)
    view = wide[:, 10:60]
    assert not view.is_contiguous()
    np.testing.assert_array_equal(
        sf.probs(view, top_k=5).numpy(), sf.probs(torch.from_numpy(x), top_k=5).numpy()
    )
    np.testing.assert_array_equal(
        sf.sample(view, seed=1, position=torch.arange(30, dtype=torch.int64)).numpy(),
        sf.sample(x, seed=1, position=np.arange(30)),
    )
    f = torch.from_numpy(np.asfortranarray(x))  # column-major
    assert f.stride() == (1, 30)
    np.testing.assert_array_equal(sf.probs(f).numpy(), sf.probs(x))


def test_torch_bfloat16_parameter_tensors(rng):
    """A bfloat16 tensor of temperatures (numpy has no bfloat16) samples as the same
    values in float32; for an integer parameter it is a TypeError naming it."""
    x = (rng.standard_normal((30, 50)) * 2).astype(np.float32)
    temps = torch.linspace(0.25, 2.0, 30, dtype=torch.bfloat16)
    np.testing.assert_array_equal(
        sf.sample(torch.from_numpy(x), seed=3, temperature=temps).numpy(),
        sf.sample(x, seed=3, temperature=temps.float().numpy()),
    )
    with pytest.raises(TypeError, match="seed must hold integers"):
        sf.sample(x, seed=torch.ones(30, dtype=torch.bfloat16))


def test_torch_sparse_probs(rng):
    reqs = [random_request(rng, 13, 5, tree=True) for _ in range(100)]
    (logits, tokens, nd), kw = pack(reqs, "sparse")
    _, ids, vals = kw.pop("draft_probs")
    kw["parents"] = torch.from_numpy(kw["parents"])
    res = sf.verify(
        torch.from_numpy(logits), torch.from_numpy(tokens), torch.from_numpy(nd),
        draft_probs=sf.SparseProbs(torch.from_numpy(ids), torch.from_numpy(vals)), **kw,
    )
    kw["parents"] = kw["parents"].numpy()
    ref = sf.verify(logits, tokens, nd, draft_probs=sf.SparseProbs(ids, vals), **kw)
    np.testing.assert_array_equal(res.tokens.numpy(), ref.tokens)


def test_torch_errors_are_python_errors():
    x = torch.randn(4, 8)
    x[1, 2] = float("nan")
    with pytest.raises((ValueError, TypeError)):
        sf.probs(x)
    with pytest.raises((ValueError, TypeError)):
        sf.sample(torch.randint(0, 5, (4, 8)))
    with pytest.raises((ValueError, TypeError)):
        sf.verify(torch.randn(2, 8), torch.tensor([1.0]), torch.tensor([1], dtype=torch.int32))


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr", "mkldnn"])
def test_sparse_and_mkldnn_tensors_are_refused_by_layout(layout):
    """A tensor without strides is refused as such (it was 'must be float32, ...,
    got dtype torch.float32', or torch's own RuntimeError for bfloat16)."""
    make = {"sparse_coo": torch.Tensor.to_sparse, "sparse_csr": torch.Tensor.to_sparse_csr,
            "mkldnn": torch.Tensor.to_mkldnn}[layout]
    x = torch.randn(2, 8)
    calls = [lambda: sf.probs(make(x)), lambda: sf.sample(make(x.bfloat16()), seed=1),
             lambda: sf.verify(x, torch.tensor([1]), torch.tensor([1]),
                               draft_probs=make(torch.full((1, 8), 0.125)))]
    if layout != "mkldnn":  # mkldnn holds floats only
        calls.append(lambda: sf.kv_compact(make(torch.zeros(1, 6, 2)), np.array([[2]]),
                                           np.array([1]), 0, seq_axis=1))
    for call in calls:
        with pytest.raises(TypeError, match=f"must be a dense tensor, got layout .*{layout}"):
            call()


def test_negated_views_subclasses_and_foreign_dtypes(rng):
    """x.conj().imag is a float tensor whose memory holds -x (torch's negative
    bit): read as its values. A subclass of Tensor is a tensor (torch out, and
    requires_grad detached). float8 / complex32 logits: specfast's TypeError."""
    z = torch.complex(torch.zeros(3, 9), torch.from_numpy(rng.standard_normal((3, 9)) * 3).float())
    neg = z.conj().imag
    assert neg.is_neg()
    plain = neg.resolve_neg()
    np.testing.assert_array_equal(sf.probs(neg).numpy(), sf.probs(plain).numpy())
    np.testing.assert_array_equal(sf.sample(neg.bfloat16(), seed=4).numpy(),
                                  sf.sample(plain.bfloat16(), seed=4).numpy())
    q = torch.softmax(plain[:2], -1)
    qz = torch.complex(torch.zeros_like(q), -q).conj().imag
    assert qz.is_neg()
    tz = torch.complex(torch.zeros(1), torch.tensor([-0.7])).conj().imag
    a = sf.verify(plain, torch.tensor([1, 2]), torch.tensor([2]), draft_probs=q, seed=7,
                  temperature=torch.tensor([0.7]))
    b = sf.verify(neg, torch.tensor([1, 2]), torch.tensor([2]), draft_probs=qz, seed=7,
                  temperature=tz)
    assert torch.equal(a.tokens, b.tokens)

    class Logits(torch.Tensor):
        pass

    sub = plain.clone().as_subclass(Logits).requires_grad_()
    out = sf.sample(sub, seed=4)
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, sf.sample(plain, seed=4))
    for dtype in (torch.float8_e4m3fn, torch.float64):
        with pytest.raises(TypeError, match="must be float32, float16 or bfloat16"):
            sf.sample(plain.to(dtype))


def test_kv_compact_moves_a_negated_view_in_place():
    cache = torch.complex(torch.zeros(1, 6, 2), torch.arange(12.0).reshape(1, 6, 2))
    view = cache.conj().imag  # -arange, negative bit set
    expect = view.resolve_neg().clone()
    expect[0, 1:3] = expect[0, [2, 4]]
    assert sf.kv_compact(view, [[1, 3]], [2], 0, seq_axis=1) is view
    assert torch.equal(view.resolve_neg(), expect)
    assert torch.equal(cache.imag, -expect)  # moved in the cache's own memory
