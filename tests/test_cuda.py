"""The CUDA backend against the CPU backend, case by case (ggml's backend-ops idea).

Coupled and greedy decisions must be bit-identical; rejection sampling uses the same
Philox streams and the same integer masses, so it must agree on every case here too;
probs must agree exactly. Every case is a random ragged batch (odd vocabulary sizes,
chains and trees, num_draft 0 included, per-request temperature / top-k / top-p /
min-p / seed / position) run on both backends.

Without a CUDA device (or with SPECFAST_CUDA_EMU=1) the same kernels run on the CPU,
compiled against tests/cuda_emu's emulated runtime, with CPU tensors as device
memory: every decision is checked there too; what needs a real GPU (streams, graph
capture, a host tensor refused as not on the device) is skipped.
"""

import contextlib
import os
import re
import subprocess
import sys
import zlib

import numpy as np
import pytest

import specfast as sf
from reference import BF16, _f32_normalised, draft_arg, pack, random_request, to_dtype

torch = pytest.importorskip("torch")

from specfast import _cuda  # noqa: E402

EMULATED = os.environ.get("SPECFAST_CUDA_EMU", "") not in ("", "0") or not torch.cuda.is_available()
if EMULATED:
    import cuda_emu

    try:
        EMU_LIB = cuda_emu.load()
    except cuda_emu.Unavailable as exc:  # pragma: no cover
        pytest.skip(f"no CUDA device, and no emulator: {exc}", allow_module_level=True)
    DEV = torch.device("cpu")
else:
    try:
        _cuda.lib()
    except (NotImplementedError, ImportError) as exc:  # pragma: no cover
        pytest.skip(f"CUDA backend not built: {exc}", allow_module_level=True)
    DEV = torch.device("cuda")

needs_gpu = pytest.mark.skipif(EMULATED, reason="needs a real CUDA device")


@pytest.fixture(autouse=True)
def _backend(monkeypatch, request):
    """Emulated: the kernels' library is the emulator's, CPU tensors count as on the
    device (so device values are checked by the kernels, as on a GPU), no streams;
    the threads of a block run in thread order, reversed or shuffled, by test (a
    race shows as a test that fails in one order)."""
    if EMULATED:
        h = zlib.crc32(request.node.nodeid.encode())
        monkeypatch.setenv("SPECFAST_CUDA_EMU_ORDER", ["forward", "reverse", str(h)][h % 3])
        monkeypatch.setattr(_cuda, "lib", lambda: EMU_LIB)
        monkeypatch.setattr(_cuda, "is_cuda", lambda x: isinstance(x, torch.Tensor))
        monkeypatch.setattr(_cuda, "_stream", lambda dev: _cuda.ffi.NULL)
        monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())


# 4099: a cluster of 3 blocks per request; 17000: 8 blocks, the last ones with
# no tokens; 32000 and up: 8 blocks.
VOCABS = [1, 7, 111, 1000, 4099, 17000, 32000]
DTYPES = ["float32", "float16", "bfloat16"]
KINDS = ["none", "dense", "sparse"]
METHODS = ["rejection", "coupled"]


def to_torch(a):
    """A numpy array (ml_dtypes bfloat16 included) as a CUDA tensor of the same dtype."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16).to(DEV)
    return torch.from_numpy(np.ascontiguousarray(a)).to(DEV)


def cuda_draft(spec, place=to_torch):
    if spec is None:
        return None
    if spec[0] == "dense":
        return place(spec[1])
    return (to_torch(spec[1]), to_torch(spec[2]))


def batch_case(rng, vocab, dtype, kind, tree, batch, max_draft=5):
    reqs = [random_request(rng, vocab, max_draft, tree=tree) for _ in range(batch)]
    (logits, tokens, nd), kw = pack(reqs, kind, with_parents=tree)
    return (to_dtype(logits, dtype), tokens, nd), kw


def run_both(args, kw, method, place=to_torch):
    """The CPU's and the CUDA backend's results; `place` puts the logits and a
    dense q on the device."""
    logits, tokens, nd = args
    cpu = sf.verify(logits, tokens, nd, method=method,
                    **{**kw, "draft_probs": draft_arg(kw["draft_probs"])})
    ckw = dict(kw)
    ckw["draft_probs"] = cuda_draft(kw["draft_probs"], place)
    for key in ("temperature", "top_k", "top_p", "min_p", "seed", "position"):
        ckw[key] = to_torch(np.asarray(ckw[key]))
    if ckw.get("parents") is not None:
        ckw["parents"] = to_torch(ckw["parents"])
    gpu = _cuda.verify(place(logits), to_torch(tokens), nd, method=method, check=True, **ckw)
    return cpu, gpu


def assert_same(cpu, gpu, what):
    for name in ("tokens", "num_accepted", "accepted_nodes"):
        a = np.asarray(getattr(cpu, name))
        b = getattr(gpu, name).cpu().numpy()
        if not np.array_equal(a, b):
            rows = np.flatnonzero((a != b).reshape(a.shape[0], -1).any(axis=1))
            raise AssertionError(
                f"{what}: {name} differs in requests {rows[:10].tolist()}: "
                f"cpu {a[rows[:3]].tolist()} cuda {b[rows[:3]].tolist()}"
            )


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS, ids=lambda v: f"V{v}")
def test_verify_matches_cpu(vocab, dtype, method, kind, tree, rng):
    if vocab < 4 and kind == "sparse":
        pytest.skip("sparse drafts of 4 ids need 4 tokens")
    for rep in range(3):
        args, kw = batch_case(rng, vocab, dtype, kind, tree, batch=int(rng.integers(1, 24)))
        cpu, gpu = run_both(args, kw, method)
        assert_same(cpu, gpu, f"rep {rep}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [151936, 128256, 262144], ids=lambda v: f"V{v}")
def test_verify_large_vocab(vocab, dtype, rng):
    """262144 float32: slices too large to stage in shared memory (read from global)."""
    for method in METHODS:
        for kind in KINDS:
            args, kw = batch_case(rng, vocab, dtype, kind, True, batch=6, max_draft=4)
            cpu, gpu = run_both(args, kw, method)
            assert_same(cpu, gpu, f"{method} {kind}")


def deep_request(rng, vocab, nd, tree):
    """nd nodes, walked deep: a chain, or a spine with 0-2 rejected siblings before
    each node of it, whose rows are peaked at the spine's drafts for 33 rows (so they
    are accepted) and less so below (where the tests decide)."""
    req = random_request(rng, vocab, 0, tree=False)  # its parameters
    parents, spine = [], []
    while len(parents) < nd:
        for _ in range(int(rng.integers(0, 3)) if tree else 0):
            parents.append(spine[-1] if spine else -1)
        parents.append(spine[-1] if spine else -1)
        spine.append(len(parents) - 1)
    parents = np.array(parents, np.int32)
    nd = len(parents)
    logits = (rng.standard_normal((nd + 1, vocab)) * 1.5).astype(np.float32)
    top = logits.argmax(axis=1)
    logits[np.arange(nd + 1), top] += np.where(np.arange(nd + 1) < 33, 30.0, 3.0).astype(np.float32)
    tokens = rng.integers(0, vocab, nd).astype(np.int32)
    tokens[spine] = top[parents[spine] + 1]
    q = rng.dirichlet(np.full(vocab, 0.5), size=nd)
    q[np.arange(nd), tokens] += 0.5
    ids = np.argsort(-q, axis=1, kind="stable")[:, :4].astype(np.int32)  # the token among them
    vals = np.take_along_axis(q, ids, 1)
    return dict(req, logits=logits, tokens=tokens, parents=parents, dense=_f32_normalised(q),
                sparse_ids=ids, sparse_vals=_f32_normalised(vals),
                temperature=float(rng.choice([0.5, 1.0, 1.3])))


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("kind", KINDS)
def test_verify_deep_requests_match_cpu(kind, tree, rng):
    """Nodes past the 32 whose acceptance inputs are read when the request starts:
    theirs are read as their rows are reached."""
    reqs = [deep_request(rng, 300, int(rng.integers(40, 80)), tree) for _ in range(8)]
    args, kw = pack(reqs, kind, with_parents=tree)
    cpu, gpu = run_both(args, kw, "rejection")
    assert_same(cpu, gpu, "deep")
    assert np.asarray(cpu.accepted_nodes).max() >= 34  # nodes past the 32 were tested


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [4099, 32000], ids=lambda v: f"V{v}")
def test_verify_filter_edges_match_cpu(vocab, dtype, kind, rng):
    """Filters at their edges: top-k past 4096 and near the vocabulary, top-p near 0
    and 1, ties at the cuts (few distinct logits), masked tokens, temperatures from
    1e-30 to 1e29, on rows of the kernels' sizes."""
    for method in METHODS:
        for rep in range(2):
            reqs = [random_request(rng, vocab, 4, tree=True) for _ in range(12)]
            for r in reqs:
                x = r["logits"]
                if rng.random() < 0.5:
                    x[:] = np.round(x * 2) / 2  # ties
                x[rng.random(x.shape) < 0.2] = -np.inf
                x[:, int(rng.integers(vocab))] = 3.0  # no row all masked
                r["top_k"] = int(rng.choice([0, 1, 50, 4095, 4097, 5000, vocab - 1, vocab]))
                r["top_p"] = float(rng.choice([1.0, 0.999, 0.5, 0.01]))
                r["min_p"] = float(rng.choice([0.0, 0.0, 0.2]))
                r["temperature"] = float(rng.choice([1e-30, 0.05, 1.0, 30.0, 1e29]))
            (logits, tokens, nd), kw = pack(reqs, kind, with_parents=True)
            cpu, gpu = run_both((to_dtype(logits, dtype), tokens, nd), kw, method)
            assert_same(cpu, gpu, f"{method} rep {rep}")


def _row_params(rng, rows):
    return dict(
        temperature=rng.choice([0.0, 0.3, 1.0, 2.0], rows).astype(np.float32),
        top_k=rng.choice([0, 1, 5, 50], rows).astype(np.int32),
        top_p=rng.choice([1.0, 0.95, 0.5, 0.1], rows).astype(np.float32),
        min_p=rng.choice([0.0, 0.0, 0.1], rows).astype(np.float32),
        seed=rng.integers(0, 2**63, rows).astype(np.uint64),
        position=rng.integers(0, 2**40, rows).astype(np.int64),
    )


def _logits(rng, rows, vocab, dtype, ties=False):
    x = (rng.standard_normal((rows, vocab)) * 2).astype(np.float32)
    if ties:  # few distinct values: ties at the top-k / top-p cuts
        x = np.round(x)
    mask = rng.random((rows, vocab)) < 0.1
    mask[:, 0] = False
    x[mask] = -np.inf
    return to_dtype(x, dtype)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 7, 111, 4099, 32000, 151936], ids=lambda v: f"V{v}")
def test_sample_matches_cpu(vocab, dtype, method, ties, rng):
    rows = 37
    x = _logits(rng, rows, vocab, dtype, ties)
    p = _row_params(rng, rows)
    cpu = sf.sample(x, method=method, **p)
    gpu = _cuda.sample(to_torch(x), method=method, check=True,
                       **{k: to_torch(v) for k, v in p.items()})
    np.testing.assert_array_equal(cpu, gpu.cpu().numpy())


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 111, 4099, 32000], ids=lambda v: f"V{v}")
def test_probs_matches_cpu(vocab, dtype, ties, rng):
    rows = 9
    x = _logits(rng, rows, vocab, dtype, ties)
    p = _row_params(rng, rows)
    del p["seed"], p["position"]
    cpu = sf.probs(x, **p)
    gpu = _cuda.probs(to_torch(x), check=True, **{k: to_torch(v) for k, v in p.items()})
    np.testing.assert_array_equal(cpu, gpu.cpu().numpy())


@pytest.mark.skipif(not EMULATED, reason="the emulator's devices (tests/cuda_emu)")
@pytest.mark.parametrize("device", [1, 2, 3, 4], ids=["no-clusters-99KB", "clusters-64KB",
                                                      "clusters-of-2", "sm80-code"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [4099, 32000, 131072], ids=lambda v: f"V{v}")
def test_devices_with_fewer_resources_match_cpu(vocab, dtype, device, rng, monkeypatch):
    """Where the device launches no clusters (one block per request), runs clusters of
    at most 2 blocks (a small MIG slice), runs code built for sm_80 (no cluster paths:
    one block per request) or grants a block less shared memory (slices read from
    global memory, no e table), every kernel still runs and agrees with the CPU
    backend; the emulator refuses a launch past the device's limits, as the GPU does
    (or, for sm_80 code in clusters, would combine nothing)."""
    monkeypatch.setenv("SPECFAST_CUDA_EMU_DEVICE", str(device))
    for method in METHODS:
        for kind in KINDS:
            args, kw = batch_case(rng, vocab, dtype, kind, True, batch=4, max_draft=4)
            cpu, gpu = run_both(args, kw, method)
            assert_same(cpu, gpu, f"{method} {kind}")
    x = _logits(rng, 5, vocab, dtype)
    p = _row_params(rng, 5)
    cpu = sf.sample(x, **p)
    gpu = _cuda.sample(to_torch(x), check=True, **{k: to_torch(v) for k, v in p.items()})
    np.testing.assert_array_equal(cpu, gpu.cpu().numpy())
    del p["seed"], p["position"]
    np.testing.assert_array_equal(
        sf.probs(x, **p),
        _cuda.probs(to_torch(x), check=True, **{k: to_torch(v) for k, v in p.items()}).numpy())


def test_scalar_params_and_strided_rows(rng):
    x = (rng.standard_normal((8, 300)) * 2).astype(np.float32)
    wide = np.zeros((8, 320), np.float32)
    wide[:, :300] = x
    for kw in (dict(temperature=0.7, top_k=20, seed=5, position=9),
               dict(temperature=1.0, top_p=0.8, seed=2**64 - 1, position=-3)):
        cpu = sf.sample(x, **kw)
        gpu = _cuda.sample(to_torch(wide)[:, :300], check=True, **kw)
        np.testing.assert_array_equal(cpu, gpu.cpu().numpy())


def negated(x):
    """A view with torch's negative bit (x.conj().imag): its memory holds -x."""
    t = torch.complex(torch.zeros_like(x), -x).conj().imag
    assert t.is_neg() and torch.equal(t, x)
    return t


def test_negated_views_are_read_as_their_values(rng):
    """The kernels read memory: a negated view is resolved first (it was read as -x)."""
    args, kw = batch_case(rng, 300, "float32", "dense", False, 6)
    logits = torch.from_numpy(args[0]).to(DEV)
    q = torch.from_numpy(kw["draft_probs"][1]).to(DEV)
    ref = _cuda.verify(logits, to_torch(args[1]), args[2], draft_probs=q, seed=3, check=True)
    got = _cuda.verify(negated(logits), to_torch(args[1]), args[2], draft_probs=negated(q),
                       seed=3, check=True)
    assert_same(ref, got, "negated views")
    np.testing.assert_array_equal(_cuda.probs(negated(logits), check=True).cpu().numpy(),
                                  sf.probs(args[0]))
    with pytest.raises(ValueError, match="negated"):
        _cuda.probs(logits, out={"probs": negated(torch.zeros_like(logits))})


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_batches_match_cpu(dtype):
    x = to_dtype(np.zeros((0, 50), np.float32), dtype)
    none = np.zeros(0, np.int32)
    assert _cuda.sample(to_torch(x), check=True).shape == sf.sample(x).shape == (0,)
    assert tuple(_cuda.probs(to_torch(x), check=True).shape) == sf.probs(x).shape == (0, 50)
    cpu = sf.verify(x, none, none)
    gpu = _cuda.verify(to_torch(x), to_torch(none), to_torch(none), check=True)
    assert_same(cpu, gpu, "empty batch")
    assert np.asarray(cpu.tokens).shape[0] == 0


def test_device_num_draft_and_max_draft(rng):
    args, kw = batch_case(rng, 500, "float32", "dense", True, batch=10)
    logits, tokens, nd = args
    cpu = sf.verify(logits, tokens, nd, **{**kw, "draft_probs": draft_arg(kw["draft_probs"])})
    ckw = dict(kw, draft_probs=cuda_draft(kw["draft_probs"]), parents=to_torch(kw["parents"]))
    gpu = _cuda.verify(to_torch(logits), to_torch(tokens), to_torch(nd),
                       max_draft=int(nd.max()), check=True, **ckw)
    assert_same(cpu, gpu, "device num_draft")


@pytest.mark.parametrize("finite", [20, 4097, 4098, 6000], ids=lambda f: f"finite{f}")
@pytest.mark.parametrize("top_k", [4097, 5000])
def test_a_large_top_k_cuts_as_on_cpu(top_k, finite, rng):
    """Past 4096 the CPU finds top-k by a scan and CUDA by a radix select: both cut the
    row where it has top_k finite logits (q not summed then) and neither where it has
    fewer, also where the tokens past the weighted ones all weigh 0 (1000 below the
    max). q sums to 0.9, an error only where the row is not cut."""
    vocab = 6000
    x = np.full((3, vocab), -np.inf, np.float32)
    x[:, :finite] = -1000.0
    x[:, :20] = rng.standard_normal((3, 20))
    x[0, 1] = -np.inf  # node 0's draft: rejected, the residual formed for node 1
    q = np.full((2, vocab), 0.9 / vocab, np.float32)
    cut = np.isfinite(x[0]).sum() >= top_k  # finite - 1 in the row formed whole
    tokens, nd, parents = np.array([1, 2], np.int32), np.array([2]), np.array([-1, -1], np.int32)
    for method in METHODS:
        kw = dict(method=method, parents=parents, top_k=top_k, seed=7)
        try:
            cpu = sf.verify(x, tokens, nd, draft_probs=q, **kw)
        except ValueError as exc:
            assert not cut and method == "rejection", exc
            with pytest.raises(ValueError, match=re.escape(str(exc))):
                _cuda.verify(to_torch(x), to_torch(tokens), nd, draft_probs=to_torch(q),
                             check=True, **dict(kw, parents=to_torch(parents)))
            continue
        assert cut or method == "coupled"
        gpu = _cuda.verify(to_torch(x), to_torch(tokens), nd, draft_probs=to_torch(q),
                           check=True, **dict(kw, parents=to_torch(parents)))
        assert_same(cpu, gpu, f"{method} top_k {top_k} finite {finite}")


def test_errors_are_reported(rng):
    x = np.zeros((3, 50), np.float32)
    x[1, 7] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        _cuda.sample(to_torch(x), check=True)
    status = torch.empty(3, dtype=torch.int32, device=DEV)
    _cuda.sample(to_torch(x), out={"status": status}, check=False)
    assert status.cpu().tolist() == [0, 4 | 2 << 8, 0]
    # probs: the failed row reads NaN (not what the buffer held), the others as on the CPU
    buf = torch.full((3, 50), 7.0, device=DEV)
    x[1, 9] = 1.0
    _cuda.probs(to_torch(x), top_k=to_torch(np.array([0, 0, 3], np.int32)),
                out={"probs": buf, "status": status}, check=False)
    got = buf.cpu().numpy()
    assert np.isnan(got[1]).all() and status.cpu().tolist() == [0, 4 | 2 << 8, 0]
    np.testing.assert_array_equal(got[[0, 2]], sf.probs(x[[0, 2]], top_k=np.array([0, 3])))
    with pytest.raises(ValueError, match="draft token out of range"):
        _cuda.verify(to_torch(np.zeros((4, 50), np.float32)),
                     to_torch(np.array([1, 99], np.int32)), np.array([1, 1]), check=True)
    with pytest.raises(ValueError, match="sampling parameter"):
        _cuda.sample(to_torch(np.zeros((2, 5), np.float32)), top_p=to_torch(np.array([0.5, 2.0], np.float32)),
                     check=True)


def test_check_names_the_lowest_bad_request_wherever_its_values_are():
    """With check=True a bad device-held parameter of a lower request is named
    before a bad host-held one of a higher request, as the CPU names the lowest."""
    x = np.zeros((6, 40), np.float32)  # 3 requests, 1 draft each
    tokens, nd = np.array([1, 2, 3], np.int32), np.array([1, 1, 1])
    top_p = np.array([1.0, 2.0, 1.0], np.float32)  # request 1
    min_p = np.array([0.0, 0.0, -1.0], np.float32)  # request 2
    with pytest.raises(ValueError, match="request 1") as cpu:
        sf.verify(x, tokens, nd, top_p=top_p, min_p=min_p)
    with pytest.raises(ValueError) as gpu:
        _cuda.verify(to_torch(x), to_torch(tokens), nd, check=True, top_p=to_torch(top_p),
                     min_p=min_p)
    assert str(gpu.value) == str(cpu.value)
    with pytest.raises(ValueError, match="row 1"):
        _cuda.sample(to_torch(x[:3]), check=True, top_p=to_torch(top_p), min_p=min_p)


def test_top_k_and_seed_arrays_are_refused_as_on_the_cpu():
    """A negative top_k (host-held, or device-held with check=True) is refused with the
    CPU's words and before any request's other faults (request 0's temperature here),
    and a negative device-held seed names its request: the same message as the CPU's."""
    x = np.zeros((4, 40), np.float32)  # 2 requests, 1 draft each
    tokens, nd = np.array([1, 2], np.int32), np.array([1, 1])
    bad = dict(temperature=np.array([-1.0, 1.0], np.float32), top_k=np.array([0, -1]))
    with pytest.raises(ValueError, match=r"top_k must be in \[0, 2\^31\) \(request 1: -1\)") as cpu:
        sf.verify(x, tokens, nd, **bad)
    for top_k in (bad["top_k"], to_torch(bad["top_k"])):
        with pytest.raises(ValueError) as gpu:
            _cuda.verify(to_torch(x), to_torch(tokens), nd, check=True,
                         **dict(bad, top_k=top_k))
        assert str(gpu.value) == str(cpu.value)
    seed = np.array([3, -1])
    with pytest.raises(ValueError) as cpu:
        sf.verify(x, tokens, nd, seed=seed)
    with pytest.raises(ValueError) as gpu:
        _cuda.verify(to_torch(x), to_torch(tokens), nd, seed=to_torch(seed), check=True)
    assert str(gpu.value) == str(cpu.value) == "seed must be non-negative (request 1: -1)"
    assert isinstance(gpu.value, sf.RequestError) and gpu.value.index == 1


def test_an_error_message_does_not_read_device_values_unless_checking():
    """A bad host-held parameter raises at once; without check its message shows
    a device-held one as such instead of copying it to the host (a synchronisation,
    which breaks a graph capture); with check it shows the value."""
    x = to_torch(np.zeros((4, 40), np.float32))
    tokens, nd = to_torch(np.array([1, 2], np.int32)), np.array([1, 1])
    top_p = to_torch(np.array([0.5, 0.75], np.float32))
    with pytest.raises(ValueError, match=r"temperature=-1.0, top_k=0, top_p=\(on the device\)"):
        _cuda.verify(x, tokens, nd, temperature=np.array([1.0, -1.0]), top_p=top_p, check=False)
    with pytest.raises(ValueError, match=r"range: .*got temperature=-1.0, top_k=0, min_p=0.0$"):
        _cuda.verify(x, tokens, nd, temperature=-1.0, top_p=top_p)  # the call's: top_p unsaid
    with pytest.raises(ValueError, match=r"\(request 1\).*temperature=-1.0, top_k=0, top_p=0.75"):
        _cuda.verify(x, tokens, nd, temperature=np.array([1.0, -1.0]), top_p=top_p, check=True)
    with pytest.raises(ValueError, match=r"max_draft .* got \(on the device\)"):
        _cuda.verify(x, tokens, to_torch(np.array([1, 1], np.int32)),
                     max_draft=to_torch(np.array(1, np.int32)))


BAD_PARAMS = {
    "temperature (1, B)": dict(temperature=np.array([[1.0, 0.5]], np.float32)),
    "top_k (B, 1)": dict(top_k=np.array([[3], [5]], np.int32)),
    "seed (1, B)": dict(seed=np.array([[1, 2]], np.uint64)),
    "position (B, 1) tensor": dict(position=torch.tensor([[1], [2]])),
    "complex temperature": dict(temperature=1 + 0j),
    "complex top_p array": dict(top_p=np.array([0.5, 0.9], np.complex64)),
    "numpy bool min_p": dict(min_p=np.bool_(True)),
    "bool tensor temperature": dict(temperature=torch.tensor([True, False])),
    "float top_k": dict(top_k=np.float64(2.5)),
}


@pytest.mark.parametrize("kw", BAD_PARAMS.values(), ids=BAD_PARAMS.keys())
def test_bad_params_are_refused_as_on_cpu(kw):
    """A parameter of the wrong shape or type is refused as the CPU backend refuses it,
    not flattened or cast into some other batch's values."""
    x = np.zeros((4, 40), np.float32)  # 2 requests, 1 draft each
    tokens, nd = np.array([1, 2], np.int32), np.array([1, 1])
    with pytest.raises((TypeError, ValueError)) as cpu:
        sf.verify(x, tokens, nd, **kw)
    with pytest.raises(cpu.type) as gpu:
        _cuda.verify(to_torch(x), to_torch(tokens), nd, check=True, **kw)
    name = next(iter(kw))
    assert str(gpu.value).startswith(name) and str(cpu.value).startswith(name)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, np.int64], ids=str)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_draft_probs_of_integers_are_refused_as_on_cpu(dtype, sparse):
    """q of ints or bools is a TypeError on both backends (CUDA cast it to float)."""
    x = np.zeros((4, 40), np.float32)
    tokens, nd = np.array([1, 2], np.int32), np.array([1, 1])
    q = np.zeros((2, 40 if not sparse else 3))
    q = torch.from_numpy(q).to(dtype) if isinstance(dtype, torch.dtype) else q.astype(dtype)
    ids = np.tile(np.arange(3, dtype=np.int32), (2, 1))
    with pytest.raises(TypeError) as cpu:
        sf.verify(x, tokens, nd, draft_probs=sf.SparseProbs(ids, q) if sparse else q)
    cq = (to_torch(ids), q if isinstance(q, torch.Tensor) else to_torch(q)) if sparse else q
    with pytest.raises(TypeError) as gpu:
        _cuda.verify(to_torch(x), to_torch(tokens), nd, draft_probs=cq, check=True)
    name = "SparseProbs values" if sparse else "draft_probs"
    assert str(gpu.value).startswith(f"{name} must hold floats")
    assert str(cpu.value).startswith(f"{name} must hold floats")


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_bfloat16_draft_probs_are_rescaled_as_on_cpu(kind, rng):
    """A bfloat16 q row within 2^-8 of 1 sums to 1 on both backends, to the same bits:
    rows put 3e-3 off (past the 1e-3 check) decide as on the CPU, and not as errors."""
    args, kw = batch_case(rng, 1000, "float32", kind, True, 8)
    spec = kw["draft_probs"]
    kw["draft_probs"] = spec[:-1] + (to_dtype(spec[-1] * np.float32(1.003), "bfloat16"),)
    kw["temperature"] = np.maximum(kw["temperature"], np.float32(0.5))  # no greedy rows
    cpu, gpu = run_both(args, kw, "rejection")
    assert_same(cpu, gpu, kind)


def test_arguments_the_cpu_takes_are_taken_alike(rng):
    """Host arrays numpy holds in other layouts (reversed views, another byte order,
    long double), a tuple of dense q rows, a one-value negated view and ml_dtypes
    bfloat16 parameters give the CPU's tokens (they raised torch's own errors, were
    read as a sparse pair, as -x, or refused)."""
    args, kw = batch_case(rng, 40, "float32", "dense", False, 2, max_draft=3)
    logits, tokens, nd = args
    q = kw["draft_probs"][1]
    base = dict(temperature=np.float32(0.8), seed=5)

    def both(**over):
        a = {**base, "draft_probs": q, **over}
        cpu = sf.verify(logits, a.pop("tokens", tokens), a.pop("nd", nd), **a)
        a = {**base, "draft_probs": q, **over}
        gpu = _cuda.verify(to_torch(logits), a.pop("tokens", tokens), a.pop("nd", nd),
                           check=True, **a)
        assert_same(cpu, gpu, str(sorted(over)))

    both(tokens=tokens[::-1].copy()[::-1], nd=nd[::-1].copy()[::-1])  # negative strides
    both(tokens=tokens.astype(">i4"), nd=nd.astype(">i8"), draft_probs=q.astype(">f4"))
    both(draft_probs=q.astype(np.longdouble), temperature=np.longdouble(0.8))
    both(draft_probs=tuple(q))
    both(temperature=negated(torch.tensor([0.8])))
    if BF16 is not None:
        both(temperature=np.array([0.5, 2.0], BF16))


def test_check_reads_device_integers_as_the_cpu_does(rng):
    """With check=True, device integers that narrowing to int32 would wrap, and
    negative device seeds, raise what the CPU raises (they gave the wrapped value's
    tokens); without it they are taken unread. Bool tensors are not integers."""
    args, kw = batch_case(rng, 40, "float32", "none", False, 2, max_draft=3)
    logits, tokens, nd = args
    wide = to_torch(tokens.astype(np.int64))
    wide[0] = 2**32 + int(tokens[0])
    with pytest.raises(ValueError, match="draft_tokens has values outside the int32 range"):
        sf.verify(logits, wide.cpu().numpy(), nd)
    with pytest.raises(ValueError, match="draft_tokens has values outside the int32 range"):
        _cuda.verify(to_torch(logits), wide, nd, check=True)
    assert_same(sf.verify(logits, tokens, nd), _cuda.verify(to_torch(logits), wide, nd,
                                                            check=False), "wrapped")
    seed = to_torch(np.array([-1, 3]))
    for call in (lambda: sf.verify(logits, tokens, nd, seed=seed.cpu().numpy()),
                 lambda: _cuda.verify(to_torch(logits), to_torch(tokens), nd, seed=seed,
                                      check=True)):
        with pytest.raises(ValueError, match="seed must be non-negative"):
            call()
    top_k = to_torch(np.array([2**32 + 2, 0]))
    with pytest.raises(ValueError, match="top_k"):
        _cuda.verify(to_torch(logits), to_torch(tokens), nd, top_k=top_k, check=True)
    for name in ("draft_tokens", "parents"):
        flags = to_torch(np.zeros(len(tokens), bool))
        a = {"draft_tokens": to_torch(tokens), "parents": None, name: flags}
        with pytest.raises(TypeError, match=f"{name} must hold integers, got dtype torch.bool"):
            _cuda.verify(to_torch(logits), a["draft_tokens"], nd, parents=a["parents"])


def test_shapes_and_kinds_of_host_arguments_as_on_cpu():
    """A 0-d draft_tokens or parents is not 1-D (taking host arrays as numpy made it
    one long); a seed tensor of floats is not integers, checked or not."""
    x = np.zeros((2, 8), np.float32)
    for kw in (dict(draft_tokens=np.array(3)), dict(draft_tokens=3),
               dict(draft_tokens=[3], parents=np.array(-1))):
        a = dict(dict(draft_tokens=[3]), **kw)
        name = "parents" if "parents" in kw else "draft_tokens"
        for call in (sf.verify, lambda *args, **k: _cuda.verify(*args, check=True, **k)):
            with pytest.raises(ValueError, match=f"{name} must be 1-D"):
                call(x if call is sf.verify else to_torch(x), a["draft_tokens"], [1],
                     parents=a.get("parents"))
    seed = to_torch(np.array([-1.0, 2.0], np.float32))
    for check in (True, False):
        with pytest.raises(TypeError, match="seed must hold integers"):
            _cuda.sample(to_torch(x), seed=seed, check=check)
    with pytest.raises(TypeError, match="seed must hold integers"):
        sf.sample(x, seed=seed.cpu().numpy())


def test_unknown_out_keys_are_refused():
    """A misspelt out key was ignored: a graph replay would read a buffer nothing writes."""
    x = to_torch(np.zeros((2, 8), np.float32))
    with pytest.raises(ValueError, match=r"out: unknown keys \['token'\]"):
        _cuda.sample(x, out={"token": torch.zeros(2, dtype=torch.int32, device=DEV)})
    with pytest.raises(ValueError, match=r"unknown keys \['tokens'\]"):
        _cuda.probs(x, out={"tokens": torch.zeros(2, dtype=torch.int32, device=DEV)})
    with pytest.raises(TypeError, match="out must be a dict"):
        _cuda.verify(x, to_torch(np.array([1], np.int32)), [1], out=[x])


def test_sparse_tensors_are_refused_by_layout_as_on_cpu():
    """Sparse logits, tokens or q: the CPU's TypeError naming the layout."""
    x, tokens, q = torch.zeros(2, 8), torch.tensor([1], dtype=torch.int32), torch.full((1, 8), 0.125)
    for args in ([x.to_sparse(), tokens, q], [x, tokens.to_sparse(), q], [x, tokens, q.to_sparse()]):
        with pytest.raises(TypeError, match="must be a dense tensor, got layout torch.sparse_coo"):
            _cuda.verify(*(a.to(DEV) for a in args[:2]), torch.tensor([1]),
                         draft_probs=args[2].to(DEV), check=True)
    with pytest.raises(TypeError, match="must be a dense tensor"):
        _cuda.sample(x.to_sparse().to(DEV), check=True)


BAD_LOGITS = 4 | 2 << 8  # SF_ERR_LOGITS, met while running


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [50, 2061, 4099, 32000], ids=lambda v: f"V{v}")
def test_bad_logits_are_reported_wherever_they_sit(vocab, dtype, bad, rng):
    """A NaN or +inf in a 16-byte chunk or a row's tail, in either half of a 16-bit
    pair, stops its row in greedy and sampled draws and in verify's fused max and
    bound (a big logit beside it: the pair's NaN hides it from the thread's max)."""
    pos = sorted({0, 1, 7, 8, 15, 16, vocab // 2, vocab - 9, vocab - 8, vocab - 2, vocab - 1})
    x = rng.standard_normal((len(pos) + 1, vocab)).astype(np.float32)
    for r, p in enumerate(pos):
        x[r, (p + 2) % vocab] = 100.0
        x[r, p] = bad
    x = to_dtype(x, dtype)
    want = [BAD_LOGITS] * len(pos) + [0]
    for temperature in (0.0, 1.0):
        status = torch.empty(len(x), dtype=torch.int32, device=DEV)
        _cuda.sample(to_torch(x), temperature=temperature, out={"status": status}, check=False)
        assert status.cpu().tolist() == want, temperature
    # Request r: the bad row, then the clean last row (drafted to, dense probs).
    rows = np.concatenate([np.stack([x[r], x[-1]]) for r in range(len(x))])
    q = np.full((len(x), vocab), 1.0 / vocab, np.float32)
    status = torch.empty(len(x), dtype=torch.int32, device=DEV)
    _cuda.verify(to_torch(rows), to_torch(np.zeros(len(x), np.int32)), np.ones(len(x), np.int32),
                 draft_probs=to_torch(q), out={"status": status}, check=False)
    assert status.cpu().tolist() == want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [50, 4099, 32000], ids=lambda v: f"V{v}")
def test_greedy_takes_the_first_max_across_signed_zeros(vocab, dtype, rng):
    """-0 and +0 are one max: greedy takes the lower id, in one thread, across
    threads and across the blocks of a cluster."""
    rows = []
    for a, b in [(3, 9), (9, 3), (0, vocab - 1), (vocab - 1, 0), (vocab // 2, 5),
                 (min(2047, vocab - 2), min(2049, vocab - 3))]:
        row = np.full(vocab, -np.inf, np.float32)
        row[rng.integers(0, vocab, 10)] = -1.0
        row[a], row[b] = -0.0, 0.0
        rows.append(row)
    x = to_dtype(np.stack(rows), dtype)
    np.testing.assert_array_equal(sf.sample(x, temperature=0.0),
                                  _cuda.sample(to_torch(x), temperature=0.0, check=True).cpu().numpy())
    # verify's greedy row, its slices on the blocks of a cluster: one request a row
    none = np.zeros(len(x), np.int32)
    cpu = sf.verify(x, none[:0], none, temperature=0.0)
    gpu = _cuda.verify(to_torch(x), to_torch(none[:0]), none, temperature=0.0, check=True)
    assert_same(cpu, gpu, "greedy verify")


@pytest.mark.parametrize("temperature", [0.0, 1.0, 1e-30, 1e29])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_of_subnormals(dtype, temperature, rng):
    """Every logit subnormal, of either sign: nothing may flush them to zero (the
    emulator never does; on a GPU this checks the build's -ftz=false)."""
    width = {"float32": 32, "float16": 16, "bfloat16": 16}[dtype]
    mant = {"float32": 23, "float16": 10, "bfloat16": 7}[dtype]
    ut = np.uint32 if width == 32 else np.uint16
    bits = (rng.integers(1, 1 << mant, (6, 4099)) | (rng.integers(0, 2, (6, 4099)) << (width - 1))).astype(ut)
    x = bits.view({"float32": np.float32, "float16": np.float16, "bfloat16": BF16}[dtype])
    np.testing.assert_array_equal(
        sf.sample(x, temperature=temperature, seed=3),
        _cuda.sample(to_torch(x), temperature=temperature, seed=3, check=True).cpu().numpy())
    # and verify's fused max and bound: row r + 1 drafted from row r, dense q
    q = np.full((5, 4099), 1 / 4099, np.float32)
    kw = dict(temperature=temperature, seed=3)
    cpu = sf.verify(x, np.arange(5, dtype=np.int32), [5], draft_probs=q, **kw)
    gpu = _cuda.verify(to_torch(x), to_torch(np.arange(5, dtype=np.int32)), [5],
                       draft_probs=to_torch(q), check=True, **kw)
    assert_same(cpu, gpu, "subnormal verify")


@pytest.mark.parametrize("filters", [{}, dict(top_p=0.9), dict(min_p=0.05)],
                         ids=["none", "top_p", "min_p"])
def test_bf16_rows_of_every_value(filters, rng):
    """Long bf16 rows read each token's e from a table of the row where it holds the
    token's exponent, and compute it elsewhere: rows of bf16 values drawn from every
    bit pattern at or below the row's max, for maxima from tiny to huge and of either
    sign, at temperatures from 1e-30 to 1e29, give the CPU's probabilities exactly
    and its draws."""
    every = np.arange(1 << 16, dtype=np.uint16).view(BF16).astype(np.float32)
    every = every[~np.isnan(every) & (every != np.inf)]
    maxima = [0.0, 1e-30, 0.5, 3.0, 30.0, 3e4, 1e38, -2.0, -1e-20, -1e38]
    temps = [1.0, 0.05, 30.0, 1e-30, 1e29]
    vocab = 20000
    rows = []
    for m in maxima:
        m = float(np.float32(m).astype(BF16))
        below = every[every <= m]
        row = rng.choice(below, vocab)
        row[rng.integers(vocab)] = m
        rows += [row] * len(temps)
    x = to_dtype(np.array(rows, np.float32), "bfloat16")
    t = np.array(temps * len(maxima), np.float32)
    kw = {k: np.full(len(t), v, np.float32) for k, v in filters.items()}
    np.testing.assert_array_equal(
        sf.probs(x, temperature=t, **kw),
        _cuda.probs(to_torch(x), temperature=to_torch(t), check=True,
                    **{k: to_torch(v) for k, v in kw.items()}).cpu().numpy())
    seeds = np.arange(len(t), dtype=np.uint64)
    np.testing.assert_array_equal(
        sf.sample(x, temperature=t, seed=seeds, **kw),
        _cuda.sample(to_torch(x), temperature=to_torch(t), seed=to_torch(seeds), check=True,
                     **{k: to_torch(v) for k, v in kw.items()}).cpu().numpy())


@pytest.mark.parametrize("offset", [1, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_that_start_off_16_bytes(dtype, offset, rng):
    """Rows whose start is not 16-byte aligned take the unvectorised loads: same
    draws and probabilities (a 16-byte load there would be caught by the
    hardening stage's sanitizers)."""
    x = (rng.standard_normal((9, 2100)) * 2).astype(np.float32)
    x[::2, 0] = 9.0
    x[1, 2099] = 9.0
    wide = np.zeros((9, 2108), np.float32)
    wide[:, offset:offset + 2100] = x
    xd = to_dtype(x, dtype)
    rows = to_torch(to_dtype(wide, dtype))[:, offset:offset + 2100]
    for temperature in (0.0, 1.0):
        np.testing.assert_array_equal(
            sf.sample(xd, temperature=temperature, seed=1),
            _cuda.sample(rows, temperature=temperature, seed=1, check=True).cpu().numpy())
    np.testing.assert_array_equal(sf.probs(xd, top_p=0.9),
                                  _cuda.probs(rows, top_p=0.9, check=True).cpu().numpy())


@pytest.mark.parametrize("offset", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_verify_rows_that_start_off_16_bytes(dtype, offset, rng):
    """Logits and dense q rows at a column offset of a wider buffer (each row's
    start off 16 bytes, odd row strides) take the unvectorised loads: the same
    decisions (a 16-byte load there is caught by the hardening stage's
    sanitizers, as a GPU would fault)."""
    def place(a):
        wide = np.zeros((a.shape[0], a.shape[1] + 5), np.float32)
        wide[:, offset:offset + a.shape[1]] = a.astype(np.float32)
        return to_torch(to_dtype(wide, a.dtype.name))[:, offset:offset + a.shape[1]]

    for tree in (False, True):
        for method in METHODS:
            args, kw = batch_case(rng, 4099, dtype, "dense", tree, batch=6)
            cpu, gpu = run_both(args, kw, method, place)
            assert_same(cpu, gpu, f"tree {tree} {method}")


@pytest.mark.parametrize("bad", [
    torch.empty(3, dtype=torch.int64, device=DEV),   # dtype
    torch.empty(4, dtype=torch.int32, device=DEV),   # shape
    pytest.param(torch.empty(3, dtype=torch.int32), marks=needs_gpu),  # on the host
    torch.empty(6, dtype=torch.int32, device=DEV)[::2],  # strided
], ids=["dtype", "shape", "host", "strided"])
def test_out_tensors_are_checked(bad):
    """The kernels write through out's pointers: a wrong one is an error, not a fault."""
    x = to_torch(np.zeros((3, 50), np.float32))
    for key in ("tokens", "status"):
        with pytest.raises(ValueError, match=f"out\\['{key}'\\]"):
            _cuda.sample(x, out={key: bad})
    with pytest.raises(ValueError, match="out\\['num_accepted'\\]"):
        _cuda.verify(to_torch(np.zeros((5, 50), np.float32)), to_torch(np.array([1, 2], np.int32)),
                     np.array([1, 1, 0]), out={"num_accepted": bad})
    with pytest.raises(TypeError, match="torch tensor"):
        _cuda.probs(x, out={"probs": np.zeros((3, 50), np.float32)})


@needs_gpu
def test_cuda_graph_capture(rng):
    x = to_torch(_logits(rng, 16, 1000, "bfloat16"))
    seed = torch.arange(16, device=DEV, dtype=torch.int64)
    out = {"tokens": torch.empty(16, dtype=torch.int32, device=DEV),
           "status": torch.empty(16, dtype=torch.int32, device=DEV)}
    ref = _cuda.sample(x, seed=seed, position=3, check=True).clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _cuda.sample(x, seed=seed, position=3, out=out, check=False)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _cuda.sample(x, seed=seed, position=3, out=out, check=False)
    out["tokens"].fill_(-7)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out["tokens"], ref)


_CAPTURE_FIRST = """
import torch
import specfast as sf
from specfast import _cuda
B, K, V = 8, 4, 151936
torch.manual_seed(3)
logits = torch.randn(B * (K + 1), V, device="cuda").mul_(3).to(torch.bfloat16)
rows = (torch.arange(B, device="cuda")[:, None] * (K + 1) + torch.arange(K, device="cuda"))
near = logits[rows.view(-1)].float() + 0.3 * torch.randn(B * K, V, device="cuda")
q = torch.softmax(near / 0.8, dim=1)  # a close drafter: some nodes accepted
tokens = torch.multinomial(q, 1).view(-1).to(torch.int32)
nd = torch.full((B,), K, dtype=torch.int32, device="cuda")
seed = torch.arange(B, dtype=torch.int64, device="cuda") + 11
position = torch.arange(B, dtype=torch.int64, device="cuda") * 7
kw = dict(draft_probs=q, temperature=0.8, top_p=0.95, seed=seed, position=position,
          max_draft=K)
out = {"tokens": torch.full((B, K + 1), -7, dtype=torch.int32, device="cuda"),
       "num_accepted": torch.empty(B, dtype=torch.int32, device="cuda"),
       "accepted_nodes": torch.empty(B, K, dtype=torch.int32, device="cuda"),
       "status": torch.empty(B, dtype=torch.int32, device="cuda"),
       "workspace": torch.empty(1 << 24, dtype=torch.uint8, device="cuda")}
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):  # the first call of the process: nothing warmed up
    _cuda.verify(logits, tokens, nd, out=out, check=False, **kw)
g.replay()
torch.cuda.synchronize()
assert not out["status"].any(), out["status"]
ref = _cuda.verify(logits, tokens, nd, check=True, **kw)
assert torch.equal(out["tokens"], ref.tokens), (out["tokens"], ref.tokens)
kw.pop("max_draft")
cpu = sf.verify(logits.cpu(), tokens.cpu(), nd.cpu(), **{
    k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kw.items()})
assert torch.equal(cpu.tokens, ref.tokens.cpu())
print("captured first", out["num_accepted"].tolist())
"""


@needs_gpu
def test_verify_captured_before_any_call():
    """verify's first call in a process, under CUDA-graph capture (the bar case's
    vocabulary, bf16, dense q, device seeds and positions): its one-time set-up
    (shared-memory grants, device attributes, occupancy queries) must not break the
    capture, and the replay gives the tokens of an uncaptured call and of the CPU."""
    r = subprocess.run([sys.executable, "-c", _CAPTURE_FIRST], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "captured first" in r.stdout, r.stdout + r.stderr


def _outcome(fn):
    """("error",) when fn raises a ValueError, else its (tokens, num_accepted) as lists."""
    try:
        r = fn()
    except ValueError:
        return ("error",)
    def host(t):
        return np.asarray(t.cpu() if hasattr(t, "cpu") else t).tolist()

    return host(r.tokens), host(r.num_accepted)


@pytest.mark.parametrize("case", ["outside-cut", "outside-cut-tree", "sum-off", "min-p",
                                  "min-p-no-try-keeps", "underflow-no-try-keeps",
                                  "kept-mass-over"])
def test_dense_draft_probs_checked_as_on_cpu(case):
    """Which q values are checked where a residual is formed whole: under a cut only
    those of tokens with a weight (a negative q elsewhere is not an error), and q's sum
    only without a cut, or, where the residual is left empty, q's mass over the kept
    tokens (above 1 + 1e-3: no distribution); the same outcome, error or tokens, on
    both backends. In the *-no-try-keeps chains q covers p, so no try keeps a token and
    the last sibling's residual is formed whole too (from the row: its e was not
    kept)."""
    vocab = 64
    logits = np.zeros((3, vocab), np.float32)
    logits[:, 16:19] = [5.0, 4.0, 3.0]  # the top 3, in the 16-token group of token 20
    q = np.full((2, vocab), 1.0 / vocab, np.float32)
    tokens = np.array([40, 41], np.int32)  # outside the top 3: p = 0 under top_k=3
    kw = dict(top_k=3, seed=5, position=11)
    parents = None
    nd = np.array([2], np.int32)
    if case in ("outside-cut", "outside-cut-tree"):
        q[:, 20] -= 0.02  # negative, outside the cut
        q[:, 21] += 0.02
        if case == "outside-cut-tree":  # two siblings of the root, both rejected
            parents = np.array([-1, -1], np.int32)
    elif case == "sum-off":
        q *= 0.9
        kw = dict(seed=5, position=11)
        logits[0, 40] = -np.inf  # rejected for sure
        parents = np.array([-1, -1], np.int32)  # with a later sibling: q read whole
    elif case in ("underflow-no-try-keeps", "kept-mass-over"):
        kw = dict(top_k=vocab - 2, seed=5, position=11)
        logits[0, 40] = -np.inf  # the draft: rejected for sure
        logits[0, 31] = -300.0  # the one finite token the cut drops
        logits[0, 30] = -200.0  # kept by top-k, its e underflows to 0: weight 0
        p = np.exp(logits[0].astype(np.float64) - logits[0].max())
        # covers p (the residual is empty), within the sum's slack or past it
        q[0] = (1.0005 if case == "underflow-no-try-keeps" else 1.002) * p / p.sum()
        q[0, 30] = -0.01
    else:
        kw = dict(min_p=0.5, seed=5, position=11)  # keeps token 16 only
        q[:, 18] -= 0.02  # above no cut of top-k or top-p, weight 0 by min-p
        q[:, 19] += 0.02
        if case == "min-p-no-try-keeps":
            q[:, 16] = 1.0  # covers p (one-hot at 16): the residual is empty
    cpu = _outcome(lambda: sf.verify(logits, tokens, nd, draft_probs=q, parents=parents, **kw))
    gpu = _outcome(lambda: _cuda.verify(
        to_torch(logits), to_torch(tokens), nd, draft_probs=to_torch(q),
        parents=None if parents is None else to_torch(parents), check=True, **kw))
    assert gpu == cpu
    assert (cpu == ("error",)) == (case in ("sum-off", "kept-mass-over"))


@pytest.mark.parametrize("vocab", [96, 17000], ids=lambda v: f"V{v}")
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_residual_tries_decide_in_order_as_on_cpu(shape, vocab):
    """The CUDA kernel draws a residual's 16 tries at once, the CPU one after another; the
    first try that keeps its token or meets a bad q decides on both. With q bad (-0.01)
    at a third of the tokens, each seed ends in an error or a token: the same on both,
    and both outcomes occur. At V=17000 a cluster of blocks shares the vocabulary, so
    tries land in other blocks' spans; in the tree the tries draw from the residual that
    rejecting an earlier sibling formed whole."""
    rng = np.random.default_rng(4)
    n = 1 if shape == "chain" else 2
    logits = rng.standard_normal((n + 1, vocab)).astype(np.float32)
    logits[0, 5:5 + n] = -np.inf  # the drafts (tokens 5, 6) have p = 0: rejected
    q = np.full((n, vocab), 1.0 / vocab, np.float32)
    q[-1, 1::3] = -0.01  # the last sibling's q (node 0's is read whole: it stays good)
    tokens, nd = np.arange(5, 5 + n, dtype=np.int32), np.array([n], np.int32)
    parents = np.full(n, -1, np.int32)
    outcomes = []
    for seed in range(24):
        kw = dict(seed=seed, position=3)
        cpu = _outcome(lambda: sf.verify(logits, tokens, nd, draft_probs=q, parents=parents,
                                         **kw))
        gpu = _outcome(lambda: _cuda.verify(to_torch(logits), to_torch(tokens), nd,
                                            draft_probs=to_torch(q), parents=to_torch(parents),
                                            check=True, **kw))
        assert gpu == cpu, f"seed {seed}"
        outcomes.append(cpu == ("error",))
    assert any(outcomes) and not all(outcomes)


def _error(fn):
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("case", ["duplicate", "duplicate-wide", "unused-with-mass", "over-one",
                                  "sum-off", "token-first", "parent", "good"])
def test_sparse_draft_checks_as_on_cpu(case):
    """The draft checks spread over the block report the request and the status the
    CPU's node-by-node checks report (token before parent before probabilities)."""
    vocab, k = 500, 40 if case == "duplicate-wide" else 4
    nd = np.array([2, 3, 1], np.int32)
    n = int(nd.sum())
    logits = np.zeros((n + 3, vocab), np.float32)
    tokens = np.arange(n, dtype=np.int32) + 7
    ids = np.tile(np.arange(k, dtype=np.int32) + 100, (n, 1))
    ids[:, 0] = tokens
    vals = np.full((n, k), 1.0 / k, np.float32)
    parents = np.array([-1, 0, -1, 0, 0, -1], np.int32)
    bad = 3  # request 1's second node
    if case.startswith("duplicate"):
        ids[bad, k - 1] = ids[bad, k // 2]
    elif case == "unused-with-mass":
        ids[bad, 2] = -1
    elif case == "over-one":
        vals[bad, 1] = 1.5
    elif case == "sum-off":
        vals[bad] *= 0.9
    elif case == "token-first":  # a node with a bad token and bad probs: the token
        vals[4, 1] = -0.1
        vals[5, 1] = -0.1  # and request 2's probs: request 1 is reported
        tokens[4] = vocab
        ids[4, 0] = 0
    elif case == "parent":
        parents[bad] = 1
    kw = dict(parents=parents, seed=3)
    cpu = _error(lambda: sf.verify(logits, tokens, nd, draft_probs=sf.SparseProbs(ids, vals), **kw))
    gpu = _error(lambda: _cuda.verify(
        to_torch(logits), to_torch(tokens), nd, draft_probs=(to_torch(ids), to_torch(vals)),
        parents=to_torch(parents), check=True, seed=3))
    assert gpu == cpu
    assert (cpu is None) == (case == "good")
