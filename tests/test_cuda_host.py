"""The CUDA backend's host side (``specfast._cuda``) without a GPU.

The kernels stand in as a fake library that records what it is given and writes
the status codes a test asks for; torch tensors stay on the CPU. What is checked
is the part that runs on the host: the caller's tensors and parameters are
validated before any kernel sees a pointer, scalars travel by value and arrays as
per-request pointers, and the codes a launch or a kernel returns become the
exceptions the CPU backend raises. tests/test_cuda.py runs the real kernels.
"""

import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from specfast import _cuda  # noqa: E402
from specfast._api import _MAX_VOCAB  # noqa: E402


class FakeKernels:
    """Records each call; writes ``codes`` (request -> status) and returns ``launch``."""

    def __init__(self):
        self.calls, self.codes, self.launch = [], {}, 0

    def _finish(self, name, status, rows, params=None, **seen):
        if params is not None:  # read now: the arrays live as long as the call
            seen["params"] = {
                k: getattr(params, k + "_value") if getattr(params, k) == _cuda.ffi.NULL
                else [getattr(params, k)[i] for i in range(getattr(params, "n_" + k))]
                for k in ("temperature", "top_k", "top_p", "min_p", "seed", "position")}
        self.calls.append((name, seen))
        for i in range(rows):
            status[i] = self.codes.get(i, 0)
        return self.launch

    def sf_cuda_sample(self, cl, params, method, tokens, status, stream):
        return self._finish("sample", status, cl.rows, method=method, params=params)

    def sf_cuda_probs(self, cl, params, out, status, stream):
        return self._finish("probs", status, cl.rows, params=params)

    def sf_cuda_verify_workspace(self, cl, draft, method):
        return 96

    def sf_cuda_verify(self, cl, draft, params, method, out, status, ws, ws_bytes, stream):
        return self._finish("verify", status, draft.batch, batch=draft.batch, n=draft.n,
                            kind=draft.kind, max_draft=out.max_draft, ws_bytes=ws_bytes)

    def sf_cuda_last_error(self):
        return 2

    def sf_cuda_error_string(self, error):
        return _cuda.ffi.new("char[]", b"out of memory")


@pytest.fixture
def kernels(monkeypatch):
    fake = FakeKernels()
    monkeypatch.setattr(_cuda, "lib", lambda: fake)
    monkeypatch.setattr(_cuda, "_require_cuda", lambda x, name: None)  # CPU logits stand in
    monkeypatch.setattr(_cuda, "_stream", lambda dev: _cuda.ffi.NULL)
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    return fake


def chain(batch=3, vocab=50):
    """A ragged batch (num_draft 1, 2, 0, ...) as torch tensors."""
    nd = np.array([1, 2, 0] * (batch // 3) + [1] * (batch % 3))
    tokens = torch.arange(int(nd.sum()), dtype=torch.int32) % vocab
    return torch.zeros(int(nd.sum()) + batch, vocab), tokens, nd


@pytest.mark.parametrize("bad, error", [
    (torch.empty(3, dtype=torch.int64), ValueError),
    (torch.empty(4, dtype=torch.int32), ValueError),
    (torch.empty(6, dtype=torch.int32)[::2], ValueError),
    (np.empty(3, np.int32), TypeError),
], ids=["dtype", "shape", "strided", "numpy"])
def test_out_tensors_checked_before_any_kernel(kernels, bad, error):
    x = torch.zeros(3, 50)
    for key in ("tokens", "status"):
        with pytest.raises(error, match=f"out\\['{key}'\\]"):
            _cuda.sample(x, out={key: bad})
    with pytest.raises(error, match="out\\['num_accepted'\\]"):
        _cuda.verify(*chain(), out={"num_accepted": bad})
    with pytest.raises(ValueError, match="out\\['probs'\\]"):
        _cuda.probs(x, out={"probs": torch.empty(3, 49)})
    for ws in (torch.empty(400, dtype=torch.uint8)[::2],   # strided
               torch.empty(400, dtype=torch.uint8)[1:]):   # off a 16-byte boundary
        with pytest.raises(ValueError, match="out\\['workspace'\\]"):
            _cuda.verify(*chain(), out={"workspace": ws})
    with pytest.raises(ValueError, match="holds 80 bytes; this call needs 96"):
        _cuda.verify(*chain(), out={"workspace": torch.empty(10, dtype=torch.int64)})
    assert kernels.calls == []


def test_given_out_tensors_are_the_results(kernels):
    logits, tokens, nd = chain()
    out = {"tokens": torch.empty(3, 3, dtype=torch.int32),
           "num_accepted": torch.empty(3, dtype=torch.int32),
           "accepted_nodes": torch.empty(3, 2, dtype=torch.int32),
           "status": torch.full((3,), 7, dtype=torch.int32),
           "workspace": torch.empty(200, dtype=torch.uint8)}
    r = _cuda.verify(logits, tokens, nd, out=out)
    assert r.tokens is out["tokens"] and r.num_accepted is out["num_accepted"]
    assert r.accepted_nodes is out["accepted_nodes"]
    assert out["status"].tolist() == [0, 0, 0]  # the kernel's writes land in it
    assert kernels.calls[-1][1] == dict(batch=3, n=3, kind=0, max_draft=2, ws_bytes=96)


def test_scalars_by_value_arrays_per_request(kernels):
    x = torch.zeros(4, 50)
    _cuda.sample(x, temperature=0.5, top_k=np.int64(7), seed=2**64 - 1, position=-3)
    assert kernels.calls[-1][1]["params"] == dict(
        temperature=0.5, top_k=7, top_p=1.0, min_p=0.0, seed=2**64 - 1, position=-3)
    _cuda.sample(x, top_p=np.array([0.5, 0.25, 0.75, 1.0]), min_p=torch.tensor([0.125]),
                 seed=np.array([1, 2, 3, 2**63], np.uint64), position=torch.arange(4) * 10,
                 method="coupled")
    name, seen = kernels.calls[-1]
    assert seen["method"] == 1
    assert seen["params"] == dict(temperature=1.0, top_k=0, top_p=[0.5, 0.25, 0.75, 1.0],
                                  min_p=[0.125], seed=[1, 2, 3, 2**63],  # 64 bits, unsigned
                                  position=[0, 10, 20, 30])


def test_temperature_too_small_for_float32_is_not_zero(kernels):
    """As on the CPU: a positive temperature that float32 rounds to 0 (greedy) is
    taken as float32's smallest, a number or a float64 array or tensor alike."""
    tiny = float(np.nextafter(np.float32(0), np.float32(1)))
    x = torch.zeros(2, 50)
    _cuda.sample(x, temperature=1e-46)
    assert kernels.calls[-1][1]["params"]["temperature"] == tiny
    for t in (np.array([1e-300, 0.0]), torch.tensor([1e-300, 0.0], dtype=torch.float64)):
        _cuda.sample(x, temperature=t)
        assert kernels.calls[-1][1]["params"]["temperature"] == [tiny, 0.0]


@pytest.mark.parametrize("kw, error, match", [
    (dict(top_p=np.array([0.5, 0.6])), ValueError, r"one value per row \(4\)"),
    (dict(seed=-1), ValueError, "out of range"),
    (dict(seed=np.array([1, -2, 3, 4])), ValueError, r"non-negative \(row 1: -2\)"),
    (dict(top_k=2.5), TypeError, "integer"),
    (dict(top_k=torch.tensor([1.0, 2.0, 3.0, 4.0])), TypeError, "integers"),
    (dict(temperature=None), TypeError, "number or an array"),
    (dict(method="greedy"), ValueError, "method"),
], ids=["length", "seed", "seeds", "top_k", "top_k-float", "none", "method"])
def test_bad_parameters_raise_before_any_kernel(kernels, kw, error, match):
    with pytest.raises(error, match=match):
        _cuda.sample(torch.zeros(4, 50), **kw)
    assert kernels.calls == []


@pytest.mark.parametrize("change, match", [
    (lambda a: dict(a, nd=np.array([1, 1, 0])), "sum\\(num_draft\\)"),
    (lambda a: dict(a, nd=np.array([1, 2, -1, 1])), ">= 0"),
    (lambda a: dict(a, logits=a["logits"][:-1]), "rows"),
    (lambda a: dict(a, logits=torch.zeros(6, 50, dtype=torch.float64)), "float32"),
    (lambda a: dict(a, draft_probs=torch.zeros(3, 49)), "draft_probs must have shape"),
    (lambda a: dict(a, draft_probs=(torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, 3))),
     "sparse draft_probs"),
    (lambda a: dict(a, parents=torch.zeros(2, dtype=torch.int32)), "parents has 2"),
    (lambda a: dict(a, tokens=a["tokens"].float() + 0.5), "integers"),
    (lambda a: dict(a, max_draft=1), "max_draft=1 but num_draft holds 2"),
    (lambda a: dict(a, max_draft=-1), "max_draft must be an integer"),
    (lambda a: dict(a, max_draft=2.0), "max_draft must be an integer"),
    (lambda a: dict(a, max_draft=1025), "max_draft must be an integer in \\[0, 1024\\]"),
    (lambda a: dict(a, logits=torch.zeros(1027, 5), tokens=torch.zeros(1025, dtype=torch.int32),
                    nd=np.array([1025, 0])), "at most 1024 draft nodes"),
], ids=["sum", "negative", "rows", "dtype", "dense", "sparse", "parents", "float-tokens",
        "max-small", "max-negative", "max-float", "max-large", "too-deep"])
def test_bad_verify_input_raises_before_any_kernel(kernels, change, match):
    logits, tokens, nd = chain()
    a = change(dict(logits=logits, tokens=tokens, nd=nd, draft_probs=None, parents=None,
                    max_draft=None))
    with pytest.raises((ValueError, TypeError), match=match):
        _cuda.verify(a["logits"], a["tokens"], a["nd"], draft_probs=a["draft_probs"],
                     parents=a["parents"], max_draft=a["max_draft"])
    assert kernels.calls == []


def test_kernel_status_becomes_the_cpu_exception(kernels):
    logits, tokens, nd = chain(batch=6)
    kernels.codes = {4: 4 | 2 << 8, 5: 6 | 1 << 8}  # a NaN row at 4; a bad draft token at 5
    r = _cuda.verify(logits, tokens, nd, check=False)  # left on the device
    assert r.tokens.shape == (6, 3)
    # The draft checks (phase 1) come before the rows (phase 2), as on the CPU.
    with pytest.raises(ValueError, match="draft token.*request 5"):
        _cuda.verify(logits, tokens, nd, check=True)
    kernels.codes = {1: 3 | 0 << 8}
    with pytest.raises(ValueError, match="sampling parameter.*top_p=0.7"):
        _cuda.sample(torch.zeros(3, 50), top_p=np.array([0.9, 0.7, 0.8]), check=True)


def test_kernel_status_names_the_bad_draft_node(kernels):
    """check=True reads the failed request's draft back and says which node broke
    which rule, as the CPU's message does."""
    logits, tokens, nd = chain(batch=6)  # request 3: node 3; request 4: nodes 4, 5
    tokens[5] = 77
    kernels.codes = {3: 6 | 1 << 8}
    with pytest.raises(ValueError, match=r"request 3\)$"):  # its draft is fine: no detail
        _cuda.verify(logits, tokens, nd, check=True)
    kernels.codes = {4: 6 | 1 << 8}
    with pytest.raises(ValueError, match=r"request 4\): node 1: token 77 is not in \[0, 50\)"):
        _cuda.verify(logits, tokens, nd, check=True)
    tokens[5] = 1
    q = torch.full((6, 50), 0.02)
    q[4, 3] = float("nan")
    kernels.codes = {4: 8 | 1 << 8}
    with pytest.raises(ValueError, match=r"request 4\): node 0: draft_probs at token 3 is nan"):
        _cuda.verify(logits, tokens, nd, draft_probs=q, check=True)


def test_launch_failure_is_a_runtime_error(kernels):
    kernels.launch = 11
    with pytest.raises(RuntimeError, match="did not launch \\(out of memory\\)"):
        _cuda.probs(torch.zeros(2, 50))
    kernels.launch = 2
    with pytest.raises(ValueError, match="specfast.sample"):
        _cuda.sample(torch.zeros(2, 50))


def test_logits_off_the_device_are_refused_by_name():
    """specfast.cuda's entry points take CUDA logits; CPU tensors and numpy arrays
    failed deep in torch (or with an AttributeError), and an empty batch returned
    CPU tensors."""
    for fn, name in ((_cuda.sample, "logits"), (_cuda.probs, "logits")):
        for x in (torch.zeros(2, 5), np.zeros((2, 5), np.float32), torch.zeros(0, 5)):
            with pytest.raises(TypeError, match=f"^{name} must be a CUDA tensor"):
                fn(x)
    with pytest.raises(TypeError, match="^target_logits must be a CUDA tensor, got Tensor on cpu"):
        _cuda.verify(torch.zeros(3, 5), torch.tensor([1, 2]), [2])


def test_specfast_cuda_is_an_attribute_of_specfast():
    """The README's specfast.cuda.verify works after a bare `import specfast`."""
    code = "import specfast; print(specfast.cuda.verify.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "specfast._cuda", out.stderr


def test_the_public_module_is_the_backend_and_loads_nothing():
    """specfast.cuda (the entry points with check, max_draft and out) is the backend
    itself, and importing it opens no library: a CPU-only install imports it too."""
    code = ("import specfast.cuda as c, specfast._cuda as k; "
            "assert (c.verify, c.sample, c.probs) == (k.verify, k.sample, k.probs); "
            "print(k.lib.cache_info().currsize)")
    env = dict(os.environ, SPECFAST_CUDA_LIBRARY="/nonexistent/libspecfast_cuda.so")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "0", out.stderr


# ---- libspecfast_cuda.so's own checks, where this installation built it ----

def real_lib():
    try:
        return _cuda.lib()
    except (NotImplementedError, OSError) as exc:
        pytest.skip(f"CUDA backend not built: {exc}")


def c_call(change=lambda c: None, entry="verify"):
    """One sf_cuda_* call whose structs are valid but for `change`. The pointers
    are placeholders: the host checks must fail before anything reads them."""
    ffi, L = _cuda.ffi, real_lib()
    fake = ffi.cast("void *", 4096)
    c = dict(logits=ffi.new("sf_logits *", (fake, 0, 5, 50, 50)),
             draft=ffi.new("sf_draft *"), params=ffi.new("sf_cuda_params *"),
             out=ffi.new("sf_verify_out *", (fake, fake, fake, 2)), method=0,
             workspace=fake, ws_bytes=1 << 20)
    d = c["draft"]
    d.tokens, d.n, d.num_draft, d.batch = fake, 3, fake, 2
    for k in ("temperature", "top_k", "top_p", "min_p", "seed", "position"):
        setattr(c["params"], "n_" + k, 1)
    c["params"].temperature_value, c["params"].top_p_value = 1.0, 1.0
    change(c)
    if entry == "verify":
        return L.sf_cuda_verify(c["logits"], c["draft"], c["params"], c["method"], c["out"],
                                fake, c["workspace"], c["ws_bytes"], ffi.NULL)
    rows = ffi.cast("int32_t *", fake) if entry == "sample" else ffi.cast("float *", fake)
    fn = L.sf_cuda_sample if entry == "sample" else L.sf_cuda_probs
    args = (c["logits"], c["params"], c["method"]) if entry == "sample" else (c["logits"], c["params"])
    return fn(*args, rows, ffi.cast("int32_t *", fake), ffi.NULL)


def _sparse(c):
    fake = _cuda.ffi.cast("void *", 4096)
    d = c["draft"]
    d.kind, d.sparse_k, d.sparse_ids, d.sparse_probs = 2, 4, fake, fake


def _set(path, value):
    def change(c):
        obj, field = path.split(".")
        if field:
            setattr(c[obj], field, value)
        else:
            c[obj] = value
    return change


@pytest.mark.parametrize("entry", ["verify", "sample", "probs"])
@pytest.mark.parametrize("change, code", [
    (_set("logits.", _cuda.ffi.NULL), 1),
    (_set("logits.dtype", 3), 1),
    (_set("logits.vocab", 0), 2),
    (_set("logits.vocab", _MAX_VOCAB + 1), 2),
    (_set("logits.row_stride", 49), 2),
    (_set("logits.row_stride", 2**62), 2),  # row offsets in bytes would wrap
    (_set("params.", _cuda.ffi.NULL), 1),
    (lambda c: (_set("params.top_p", _cuda.ffi.cast("float *", 4096))(c),
                _set("params.n_top_p", 3)(c)), 2),
    (_set("params.top_p_value", 1.5), 3),
    (_set("logits.data", _cuda.ffi.cast("void *", 4098)), 1),  # float32 at a 2-byte address
    (lambda c: (_set("params.top_p", _cuda.ffi.cast("float *", 4097))(c),
                _set("params.n_top_p", 1)(c)), 1),
    (lambda c: (_set("params.seed", _cuda.ffi.cast("uint64_t *", 4100))(c),
                _set("params.n_seed", 1)(c)), 1),
    (_set("params.temperature_value", float("nan")), 3),
    (_set("params.top_k_value", -1), 3),
    (_set("params.min_p_value", -0.5), 3),
], ids=["no-logits", "dtype", "vocab-0", "vocab-big", "stride", "stride-wraps", "no-params",
        "params-count", "misaligned-logits", "misaligned-top_p", "misaligned-seed",
        "top_p", "temperature", "top_k", "min_p"])
def test_c_entry_checks_shapes_and_pointers(entry, change, code):
    assert c_call(change, entry) == code


@pytest.mark.parametrize("change, code", [
    (_set("draft.", _cuda.ffi.NULL), 1),
    (_set("out.", _cuda.ffi.NULL), 1),
    (_set("out.max_draft", 1025), 1),
    (_set("out.accepted_nodes", _cuda.ffi.NULL), 1),
    (_set("method.", 2), 1),
    (_set("draft.kind", 3), 1),
    (_set("draft.n", 4), 2),
    (_set("draft.batch", -1), 2),
    (_set("draft.tokens", _cuda.ffi.NULL), 1),
    (_set("draft.kind", 1), 1),  # dense without its array
    (lambda c: (_sparse(c), _set("draft.sparse_k", 0)(c)), 1),
    (lambda c: (_sparse(c), _set("draft.sparse_ids", _cuda.ffi.NULL)(c)), 1),
    (lambda c: (_sparse(c), _set("workspace.", _cuda.ffi.NULL)(c)), 1),  # overrides need one
    (lambda c: (_sparse(c), _set("ws_bytes.", 8)(c)), 1),
    (lambda c: (_sparse(c), _set("workspace.", _cuda.ffi.cast("void *", 4104))(c)), 1),
    (_set("draft.tokens", _cuda.ffi.cast("int32_t *", 4098)), 1),
    (_set("out.num_accepted", _cuda.ffi.cast("int32_t *", 4097)), 1),
    (lambda c: (_sparse(c), _set("draft.sparse_probs", _cuda.ffi.cast("float *", 4102))(c)), 1),
], ids=["no-draft", "no-out", "max-draft", "no-nodes", "method", "kind", "rows", "batch",
        "no-tokens", "dense-null", "sparse-k", "sparse-null", "no-workspace",
        "small-workspace", "misaligned-workspace", "misaligned-tokens", "misaligned-out",
        "misaligned-sparse"])
def test_c_verify_checks_its_draft(change, code):
    assert c_call(change) == code


def test_c_call_without_a_gpu_fails_cleanly():
    """Valid arguments where no GPU or driver is present: SF_ERR_UNSUPPORTED and
    the CUDA error's text, no crash; Python makes it a RuntimeError."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the placeholder pointers would reach a kernel")
    # The calls the checks above alter pass them all: only the launch fails.
    for entry in ("verify", "sample", "probs"):
        assert c_call(lambda c: None, entry) == 11
    assert c_call(_sparse) == 11
    L = real_lib()
    assert L.sf_cuda_last_error() != 0
    assert _cuda.ffi.string(L.sf_cuda_error_string(L.sf_cuda_last_error()))
    with pytest.raises(RuntimeError, match="did not launch"):
        _cuda._raise_host(11, "specfast.sample", {})


@pytest.mark.parametrize("array", [np.array, torch.tensor], ids=["numpy", "torch"])
def test_host_integers_that_would_wrap_are_errors(kernels, array):
    """int64 data narrowed to int32 on its way to the device must not wrap:
    token 2^32 + 5 is not token 5."""
    logits, tokens, nd = chain()
    with pytest.raises(ValueError, match="draft_tokens has values outside"):
        _cuda.verify(logits, array([1, 2**32 + 5, 3]), nd)
    with pytest.raises(ValueError, match=r"top_k must be in \[0, 2\^31\) \(row 0"):
        _cuda.sample(torch.zeros(2, 50), top_k=array([2**32 + 40, 1]))  # as the CPU says
    with pytest.raises(ValueError, match="parents has values outside"):
        _cuda.verify(logits, tokens, nd, parents=array([-1, -1, -(2**31) - 1]))
    with pytest.raises(ValueError, match="position has values outside"):
        _cuda.sample(torch.zeros(2, 50), position=np.array([2**63, 1], np.uint64))
    assert kernels.calls == []


@pytest.mark.parametrize("kw, index", [
    (dict(top_p=2.0), -1),
    (dict(temperature=-1), -1),
    (dict(temperature=np.array([1.0, 0.5, 2e30])), 2),
    (dict(top_k=np.array([0, -3, 5])), 1),
    (dict(min_p=torch.tensor([0.5, 0.1, 1.5])), 2),
    (dict(top_p=np.array([0.9, np.nan, 0.9])), 1),
], ids=["top_p", "temperature", "temperature-array", "top_k-array", "min_p-tensor", "nan"])
def test_host_parameters_checked_at_once(kernels, kw, index):
    """Parameters the host holds are checked before the launch, with the CPU's
    message (device tensors are left to the kernel: no synchronisation); a
    negative top_k in the CPU's words for it, before the launch. A bad value
    given once for all is the whole call's error, not request 0's (index -1)."""
    said = (r"top_k must be in \[0, 2\^31\)" if "top_k" in kw
            else "sampling parameter out of range" + (f" \\(row {index}\\)" if index >= 0 else ":"))
    with pytest.raises(ValueError, match=said) as e:
        _cuda.sample(torch.zeros(3, 50), **kw)
    assert getattr(e.value, "index", -1) == index
    with pytest.raises(ValueError, match=f"request {index}" if index >= 0 else "range:") as e:
        _cuda.verify(*chain(), **kw)
    assert getattr(e.value, "index", -1) == index
    assert kernels.calls == []


def test_host_values_taken_as_the_kernel_reads_them(kernels):
    """Host parameters are checked in float32, as the kernel reads them (1e30 in
    float32 is a valid temperature); unsigned torch tensors are taken (uint64
    seeds as their 64 bits); no request, no check."""
    x = torch.zeros(2, 50)
    _cuda.sample(x, temperature=np.array([np.float32(1e30), 1.0], np.float32))
    _cuda.sample(x, top_p=1 + 1e-9)  # float32: 1.0
    _cuda.sample(x, seed=torch.tensor([2**63 + 5, 1], dtype=torch.uint64),
                 position=torch.tensor([3, 4], dtype=torch.uint32))
    assert kernels.calls[-1][1]["params"]["seed"] == [2**63 + 5, 1]
    _cuda.verify(torch.zeros(3, 50), torch.tensor([1], dtype=torch.uint16), np.array([1, 0]))
    _cuda.sample(torch.zeros(0, 50), top_p=0.0)  # an empty batch reads no parameter
    with pytest.raises(ValueError, match="too large for a float"):
        _cuda.sample(x, temperature=10**400)
    with pytest.raises(ValueError, match="non-negative"):
        _cuda.sample(x, seed=torch.tensor([-1, 2]))


def test_c_empty_call_checks_no_parameter():
    """No row, no parameter read: an empty call succeeds (no launch) whatever
    the parameters say, as on the CPU."""
    def empty(c):
        c["logits"].rows = 0
        c["params"].top_p_value = 0.0
    assert c_call(empty, "sample") == 0 and c_call(empty, "probs") == 0
