"""The CUDA backend: :func:`verify`, :func:`sample` and :func:`probs` on torch CUDA tensors.

``libspecfast_cuda.so`` is loaded (cffi, ABI mode) the first time a CUDA tensor
arrives, never at import: the CPU package works where there is no GPU, driver or
CUDA library. The kernels run on ``torch.cuda.current_stream()``, the results stay
on the device, and nothing here synchronises with the host or copies to it, so the
calls can be captured in a CUDA graph, provided that

- every array argument is already a CUDA tensor on the logits' device (numpy
  arrays and CPU tensors are copied to the device, which is allowed but not
  capturable); in the kernels' types (int32 tokens, num_draft, parents and
  sparse ids, float32 probabilities and parameters, int64 seed and position,
  rows of unit stride) nothing is converted, else a converted copy is made on
  the device (capturable);
- scalar parameters are Python numbers, and a replay reuses them as captured:
  what changes from step to step (seed, position) must be a device tensor
  that the caller updates in place before each replay;
- one call ran on the device before the capture (the first call loads the
  kernels and sets their shared memory limits);
- ``max_draft`` is given when ``num_draft`` is a CUDA tensor (otherwise it is
  read back with ``num_draft.max()``, a synchronisation);
- errors in device data are left on the device (shapes, and parameters held on
  the host, raise at once): a request that fails has ``num_accepted`` 0 and
  tokens -1 (a row of ``probs``: NaN), and its status code is in
  ``out["status"]`` when ``out`` is given.
  ``check=True`` (or ``SPECFAST_CUDA_CHECK=1``) synchronises and raises the
  exception the CPU backend would raise (during a capture it is refused).
  Without it, values in device tensors are not read on the host: a seed tensor
  of negative values is used as its 64 bits (the CPU raises), and an int64 tensor
  narrowed to int32 (draft tokens, parents, top_k) wraps; with it, both raise as
  on the CPU.

Outputs are allocated with torch (its caching allocator is graph-safe), or taken
from ``out``, a dict of preallocated tensors: ``tokens``, ``num_accepted``,
``accepted_nodes``, ``status`` and ``workspace`` (bytes; one too small for the
call is a ValueError that says how many it needs).
"""

from __future__ import annotations

import functools
import os
import sys

import cffi
import numpy as np

from ._cdef import CDEF
from ._api import (_BF16_SUM_SLACK, _MAX_DRAFT, _MAX_VOCAB, _PARAM_RULES, _as_array,
                   _as_float, _failure_detail, _first_bad_param, _int_range, _is_int,
                   _lift_temperatures, _method, _param_detail, _scalar, _strided, _torch)
from ._lib import fix_for, library_path, open_library

CUDA_CDEF = """
typedef struct sf_cuda_params {
    const float *temperature; int64_t n_temperature; float temperature_value;
    const int32_t *top_k;     int64_t n_top_k;       int32_t top_k_value;
    const float *top_p;       int64_t n_top_p;       float top_p_value;
    const float *min_p;       int64_t n_min_p;       float min_p_value;
    const uint64_t *seed;     int64_t n_seed;        uint64_t seed_value;
    const int64_t *position;  int64_t n_position;    int64_t position_value;
} sf_cuda_params;

int64_t sf_cuda_verify_workspace(const sf_logits *logits, const sf_draft *draft,
                                 sf_method method);
sf_status sf_cuda_verify(const sf_logits *logits, const sf_draft *draft,
                         const sf_cuda_params *params, sf_method method,
                         sf_verify_out *out, int32_t *status,
                         void *workspace, int64_t workspace_bytes, void *stream);
sf_status sf_cuda_sample(const sf_logits *logits, const sf_cuda_params *params,
                         sf_method method, int32_t *tokens, int32_t *status, void *stream);
sf_status sf_cuda_probs(const sf_logits *logits, const sf_cuda_params *params,
                        float *out, int32_t *status, void *stream);
unsigned sf_cuda_version(void);
int sf_cuda_last_error(void);
const char *sf_cuda_error_string(int error);
"""

ffi = cffi.FFI()
ffi.cdef(CDEF + CUDA_CDEF)


@functools.cache
def lib():
    """The loaded CUDA library; raises NotImplementedError when this build has none."""
    fix = fix_for("SPECFAST_CUDA_LIBRARY", "reinstall with a CUDA compiler on the PATH, or "
                  "with `pip install . -Ccmake.define.SPECFAST_CUDA=ON`")
    return open_library(
        ffi, library_path("SPECFAST_CUDA_LIBRARY", "libspecfast_cuda.so"), "sf_cuda_version",
        lambda path, exc: NotImplementedError(
            f"specfast: CUDA tensors need the CUDA backend, which this installation lacks "
            f"({path!r}: {exc}); {fix}"), fix)


def is_cuda(x) -> bool:
    """Whether ``x`` is a torch tensor (or a subclass of one) on a CUDA device; never
    imports torch: a tensor means torch is imported."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor) and x.is_cuda


def _ptr(t):
    return ffi.cast("void *", t.data_ptr()) if t is not None else ffi.NULL


def _check_fits(lo, hi, dtype, name):
    """Narrowing to dtype would wrap a value outside [lo, hi]: an error, as on the CPU."""
    bits = 8 * dtype.itemsize - 1
    if lo < -(1 << bits) or hi >= 1 << bits:
        raise ValueError(f"{name} has values outside the {str(dtype).split('.')[-1]} range")


def _on_device(x, dtype, dev, name, ndim=None, check=False):
    """``x`` as a contiguous CUDA tensor of ``dtype`` on ``dev`` (a no-op when it is one).
    Host values are checked as the CPU checks them; a device tensor's values are read
    (a synchronisation) only with ``check``, else narrowing to ``dtype`` wraps them."""
    torch = _torch()
    ints = dtype in (torch.int32, torch.int64)
    if isinstance(x, torch.Tensor):
        _strided(x, name)
        if ints and (x.dtype == torch.bool or x.is_complex()
                     or (x.is_floating_point() and x.numel())):
            raise TypeError(f"{name} must hold integers, got dtype {x.dtype}")
    if isinstance(x, torch.Tensor) and ints and not is_cuda(x) and not x.is_floating_point():
        x = x.detach().resolve_neg().numpy()  # host integers: checked below as numpy's
        # (torch has no min of its unsigned types); a device tensor is taken unread
    if isinstance(x, torch.Tensor):
        t = x.detach().resolve_neg()  # a negated view's memory holds -x
        if (check and ints and is_cuda(t) and t.numel() and t.dtype != dtype
                and t.element_size() >= dtype.itemsize):
            _check_fits(int(t.min()), int(t.max()), dtype, name)  # synchronises
        if is_cuda(t) and t.device != dev:  # a copy between devices: not capturable
            raise ValueError(f"{name} is on {t.device}, the logits on {dev}")
        t = t.to(device=dev, dtype=dtype)
    else:
        a = _as_array(x, name)
        if ints and a.dtype.kind not in "iu":
            if not (a.size == 0 and a.dtype.kind == "f"):
                raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
        if ints and a.dtype.kind in "iu" and a.dtype.itemsize >= dtype.itemsize and a.size:
            _check_fits(int(a.min()), int(a.max()), dtype, name)
        # native order, no negative strides, no long double: what torch takes
        host = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}
        t = torch.from_numpy(np.ascontiguousarray(a, host[dtype]).reshape(a.shape)).to(dev)
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    return t.contiguous()


def _require_cuda(x, name):
    """The entry points here run on the logits' device: CPU data goes to specfast's own."""
    if not is_cuda(x):
        raise TypeError(f"{name} must be a CUDA tensor, got {type(x).__name__}"
                        + (f" on {x.device}" if hasattr(x, "device") else "")
                        + " (specfast.verify, sample and probs take CPU arrays)")


def _c_logits(x, name, keep):
    _require_cuda(x, name)
    _strided(x, name)
    torch = _torch()
    codes = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
    code = codes.get(x.dtype)
    if code is None:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got dtype {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D (rows, vocab), got shape {tuple(x.shape)}")
    x = x.detach().resolve_neg()  # a negated view's memory holds -x
    if x.shape[1] and (x.stride(1) != 1 or (x.shape[0] > 1 and x.stride(0) < x.shape[1])):
        x = x.contiguous()
    if x.shape[1] < 1 or x.shape[1] > _MAX_VOCAB:
        raise ValueError(f"{name}: vocab size {x.shape[1]} must be in [1, {_MAX_VOCAB}]")
    keep.append(x)
    c = ffi.new("sf_logits *")
    c.data = _ptr(x)
    c.dtype, c.rows, c.vocab = code, x.shape[0], x.shape[1]
    c.row_stride = x.stride(0) if x.shape[0] > 1 else x.shape[1]
    return c, x


def _dtype_kind(value, name):
    """(shape, dtype, numpy kind) of an array parameter, without reading device data."""
    torch = _torch()
    if isinstance(value, torch.Tensor):
        d = value.dtype
        kind = ("f" if d.is_floating_point else "c" if d.is_complex else
                "b" if d == torch.bool else "i" if d.is_signed else "u")
        return tuple(value.shape), d, kind
    a = _as_array(value, name)
    return a.shape, a.dtype, "f" if a.dtype.name == "bfloat16" else a.dtype.kind  # ml_dtypes


def _probs(value, dev, name):
    """Rows of probabilities as a float32 device tensor, as the CPU takes them:
    floats only (ints and bools were cast), a bfloat16 row within its rounding
    of 1 rescaled to sum to 1 (on the device, no sync)."""
    torch = _torch()
    _, dt, kind = _dtype_kind(value, name)
    if kind != "f":  # bfloat16 (torch's or ml_dtypes') is "f" too
        raise TypeError(f"{name} must hold floats, got dtype {dt}")
    t = _on_device(value, torch.float32, dev, name, 2)
    if (dt == torch.bfloat16 or getattr(dt, "name", None) == "bfloat16") and t.numel():
        s = t.sum(dim=1, keepdim=True, dtype=torch.float64)
        t = t * torch.where((s - 1.0).abs() <= _BF16_SUM_SLACK, 1.0 / s, 1.0).float()
    return t


def _params(batch, dev, keep, temperature, top_k, top_p, min_p, seed, position, check,
            unit="request"):
    """An sf_cuda_params: Python scalars by value, arrays as device tensors, refused
    where the CPU backend refuses them (the same scalar rules, shapes and dtypes,
    the batch counted in `unit`s)."""
    torch = _torch()
    p = ffi.new("sf_cuda_params *")
    keep.append(p)
    spec = (("temperature", temperature, torch.float32, "float *"),
            ("top_k", top_k, torch.int32, "int32_t *"),
            ("top_p", top_p, torch.float32, "float *"),
            ("min_p", min_p, torch.float32, "float *"),
            ("seed", seed, torch.int64, "uint64_t *"),
            ("position", position, torch.int64, "int64_t *"))
    for name, value, dtype, ctype in spec:
        integer = dtype != torch.float32
        v = _scalar(value, name, integer)
        if v is not None:
            if integer:
                lo, hi = {"top_k": (0, 1 << 31), "seed": (0, 1 << 64),
                          "position": (-(1 << 63), 1 << 63)}[name]
                if not lo <= v < hi:
                    raise ValueError(f"{name}={v} is out of range [{lo}, {hi})")
            else:
                v = _as_float(v, name)
            setattr(p, name, ffi.NULL)
            setattr(p, "n_" + name, 1)
            setattr(p, name + "_value", v)
            continue
        shape, dt, kind = _dtype_kind(value, name)
        if len(shape) > 1:
            raise ValueError(f"{name} must be a scalar or have one value per {unit} "
                             f"({batch}), got shape {shape}")
        if kind not in "iuf":
            raise TypeError(f"{name} must be numeric, got dtype {dt}")
        if name == "temperature" and kind == "f":
            value = _lift_temperatures(value if isinstance(value, torch.Tensor)
                                       else _as_array(value, name))
        if name == "seed" and isinstance(value, torch.Tensor) and not is_cuda(value):
            value = value.detach().numpy()  # host seeds: checked and taken as numpy's
        if name == "seed" and not isinstance(value, torch.Tensor):
            a = _as_array(value, "seed")
            if a.dtype.kind not in "iu":
                raise TypeError(f"seed must hold integers, got dtype {a.dtype}")
            _int_range(a, "seed", np.uint64, unit)
            value = a.astype(np.uint64).view(np.int64)  # the same 64 bits
        if (check and name == "seed" and isinstance(value, torch.Tensor)
                and not value.is_floating_point() and value.dtype.is_signed):
            _int_range(value.detach().cpu().numpy(), "seed", np.uint64, unit)  # synchronises
        if name == "top_k" and kind in "iu" and (check or not is_cuda(value)):
            # the CPU's rule, checked (and said) before any request's others
            _int_range(value.detach().cpu().numpy() if isinstance(value, torch.Tensor)
                       else _as_array(value, name), "top_k", np.int32, unit)  # synchronises
        # a seed is taken as its 64 bits (uint64 past 2^63 included), never narrowed
        t = _on_device(value, dtype, dev, name, check=check and name != "seed").reshape(-1)
        if t.numel() not in (1, batch):
            raise ValueError(
                f"{name} must be a scalar or have one value per {unit} ({batch}), "
                f"got shape {tuple(t.shape)}"
            )
        keep.append(t)
        setattr(p, name, ffi.cast(ctype, t.data_ptr()))
        setattr(p, "n_" + name, t.numel())
        setattr(p, name + "_value", 0)
    return p


def _out(out, name, shape, dtype, dev):
    """``out[name]`` checked to be a contiguous ``dtype`` CUDA tensor of ``shape`` on
    ``dev`` (the kernel writes through its pointer), or a new one."""
    torch = _torch()
    t = out.get(name)
    if t is None:
        return torch.empty(shape, dtype=dtype, device=dev)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"out[{name!r}] must be a torch tensor, got {type(t).__name__}")
    if t.dtype != dtype or t.device != dev or tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"out[{name!r}] must be a {dtype} tensor of shape {tuple(shape)} on {dev}, "
            f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    if not t.is_contiguous() or t.is_neg():
        raise ValueError(f"out[{name!r}] must be contiguous (and not a negated view)")
    return t


def _out_dict(out, names):
    """``out`` as a dict; a key that names no output would be ignored, and a graph
    replay would then read a buffer nothing writes: refused."""
    if out is not None and not isinstance(out, dict):
        raise TypeError(f"out must be a dict of tensors, got {type(out).__name__}")
    out = dict(out or {})
    unknown = sorted(set(out) - set(names))
    if unknown:
        raise ValueError(f"out: unknown keys {unknown}; the outputs are {list(names)}")
    return out


def _workspace(out, need, dev):
    """``out["workspace"]``, checked to be a contiguous tensor on ``dev`` from a
    16-byte boundary that holds ``need`` bytes; a new one when none is given."""
    torch = _torch()
    ws = out.get("workspace")
    if ws is None:
        return torch.empty(need, dtype=torch.uint8, device=dev)
    if not isinstance(ws, torch.Tensor) or ws.device != dev or not ws.is_contiguous():
        raise ValueError(f"out['workspace'] must be a contiguous tensor on {dev}")
    if ws.data_ptr() % 16:
        raise ValueError("out['workspace'] must start on a 16-byte boundary")
    have = ws.numel() * ws.element_size()
    if have < need:
        raise ValueError(f"out['workspace'] holds {have} bytes; this call needs {need} "
                         "(it grows with the draft's nodes, its kind and the vocabulary)")
    return ws


def _stream(dev):
    return ffi.cast("void *", _torch().cuda.current_stream(dev).cuda_stream)


def _launch_error(what):
    e = lib().sf_cuda_last_error()
    text = ffi.string(lib().sf_cuda_error_string(e)).decode()
    raise RuntimeError(f"{what}: the CUDA kernel did not launch ({text})")


def _raise_host(status, what, params):
    from ._lib import check

    if status == 11:  # SF_ERR_UNSUPPORTED: the launch failed
        _launch_error(what)
    detail = None
    if status == 3:
        detail = f"{_PARAM_RULES}; got " + ", ".join(f"{k}={_shown(v)}" for k, v in params.items())
    check(status, what, -1, detail)


def _check_host_params(what, params, batch, read_device):
    """Parameters held on the host are checked now, as the CPU backend does;
    those in device tensors are checked by the kernel (no synchronisation), or
    here too with ``read_device`` (check=True), so that the lowest bad request
    is the one named, as on the CPU, wherever its values are held."""
    from ._lib import check

    if batch == 0:
        return  # no request reads them
    if not read_device:
        params = {k: _ON_DEVICE if is_cuda(v) else v for k, v in params.items()}
    held = {k: v for k, v in params.items() if v is not _ON_DEVICE}
    first = _first_bad_param(held)
    if first is not None:  # -1: a value given once for all, which held shows
        check(3, what, first, _param_detail(held if first < 0 else params, first))


class _OnDevice:
    """A device-held value in an error message that must not read it (a copy to
    the host would synchronise, and break a graph capture)."""

    def __repr__(self):
        return "(on the device)"


_ON_DEVICE = _OnDevice()


def _shown(v):
    return _ON_DEVICE if is_cuda(v) else repr(v)


def _raise_device(status, what, params, draft=None):
    """Synchronises, then raises for the lowest (phase, index) failed request;
    draft: verify's (tokens, num_draft, parents, probs, vocab), for the detail."""
    from ._lib import check

    s = status.cpu().numpy().astype(np.int64)
    bad = np.flatnonzero(s)
    if not bad.size:
        return
    order = (s[bad] >> 8) * (1 << 40) + bad
    index = int(bad[np.argmin(order)])
    code = int(s[index] & 255)
    # Shape errors concern the whole call on the CPU backend.
    check(code, what, -1 if code == 2 else index, _failure_detail(code, index, params, draft))


def _want_check(check):
    if check is None:
        check = os.environ.get("SPECFAST_CUDA_CHECK", "") not in ("", "0")
    torch = _torch()
    if check and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("check=True (or SPECFAST_CUDA_CHECK=1) synchronises with the "
                           "device, which a CUDA graph capture forbids")
    return bool(check)


def verify(target_logits, draft_tokens, num_draft, *, draft_probs=None, parents=None,
           temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, position=0,
           method="rejection", max_draft=None, check=None, out=None):
    """:func:`specfast.verify` on a CUDA tensor: same arguments, same tokens.

    ``draft_probs`` may also be a pair ``(ids, values)`` whose ids are an integer
    tensor, for sparse drafts (as a :class:`specfast.SparseProbs` of CUDA tensors).
    ``max_draft``: the width of the outputs minus one, needed without a
    synchronisation when ``num_draft`` is a CUDA tensor. Returns a
    :class:`specfast.VerifyResult` of CUDA tensors.
    """
    from ._api import SparseProbs, VerifyResult

    torch = _torch()
    m = _method(method)
    check = _want_check(check)
    keep = []
    cl, logits = _c_logits(target_logits, "target_logits", keep)
    dev = logits.device
    vocab = logits.shape[1]
    tokens = _on_device(draft_tokens, torch.int32, dev, "draft_tokens", 1, check)
    if is_cuda(num_draft):
        nd = _on_device(num_draft, torch.int32, dev, "num_draft", 1, check)
        if max_draft is None:
            max_draft = int(nd.max()) if nd.numel() else 0  # synchronises
    else:
        nd_host = num_draft
        if isinstance(nd_host, torch.Tensor):
            _strided(nd_host, "num_draft")
            nd_host = nd_host.detach().resolve_neg().cpu().numpy()
        nd_host = _as_array(nd_host, "num_draft")
        if nd_host.dtype.kind not in "iu" and (nd_host.size or nd_host.dtype.kind != "f"):
            raise TypeError(f"num_draft must hold integers, got dtype {nd_host.dtype}")
        if nd_host.ndim != 1:
            raise ValueError(f"num_draft must be 1-D, got shape {nd_host.shape}")
        if nd_host.size and nd_host.min() < 0:
            raise ValueError("num_draft must be >= 0")
        if int(nd_host.sum()) != tokens.shape[0]:
            raise ValueError(
                f"sum(num_draft) = {int(nd_host.sum())} but draft_tokens has "
                f"{tokens.shape[0]} entries"
            )
        most = int(nd_host.max()) if nd_host.size else 0
        if most > _MAX_DRAFT:
            raise ValueError(
                f"num_draft: at most {_MAX_DRAFT} draft nodes per request, got {most}")
        max_draft = most if max_draft is None else max_draft
        nd = _on_device(nd_host, torch.int32, dev, "num_draft", 1)
    if not _is_int(max_draft) or not 0 <= max_draft <= _MAX_DRAFT:
        raise ValueError(f"max_draft must be an integer in [0, {_MAX_DRAFT}], "
                         f"got {_shown(max_draft)}")
    if not is_cuda(num_draft) and max_draft < most:
        raise ValueError(f"max_draft={max_draft} but num_draft holds {most}")
    max_draft = int(max_draft)
    batch, n = nd.shape[0], tokens.shape[0]
    if logits.shape[0] != n + batch:
        raise ValueError(
            f"target_logits has {logits.shape[0]} rows; sum(num_draft + 1) = {n + batch} needed"
        )
    keep += [tokens, nd]
    d = ffi.new("sf_draft *")
    d.tokens, d.n, d.num_draft, d.batch = _ptr(tokens), n, _ptr(nd), batch
    if parents is not None:
        par = _on_device(parents, torch.int32, dev, "parents", 1, check)
        if par.shape[0] != n:
            raise ValueError(f"parents has {par.shape[0]} entries, draft_tokens has {n}")
        keep.append(par)
        d.parents = _ptr(par)
    q = None  # the probabilities as the kernel reads them: for an error's detail
    if draft_probs is None:
        d.kind = 0
    elif isinstance(draft_probs, SparseProbs) or (
            isinstance(draft_probs, tuple) and len(draft_probs) == 2
            and isinstance(draft_probs[0], torch.Tensor)
            and not draft_probs[0].is_floating_point()):  # (ids, values); rows are dense
        ids, vals = ((draft_probs.indices, draft_probs.values)
                     if isinstance(draft_probs, SparseProbs) else draft_probs)
        ids = _on_device(ids, torch.int32, dev, "SparseProbs indices", 2, check)
        vals = _probs(vals, dev, "SparseProbs values")
        if ids.shape != vals.shape or ids.shape[0] != n or ids.shape[1] < 1:
            raise ValueError(
                f"sparse draft_probs must be two ({n}, K) arrays, got {tuple(ids.shape)} "
                f"and {tuple(vals.shape)}"
            )
        keep += [ids, vals]
        d.kind, d.sparse_k = 2, ids.shape[1]
        d.sparse_ids, d.sparse_probs = _ptr(ids), _ptr(vals)
        q = (ids, vals)
    else:
        q = _probs(draft_probs, dev, "draft_probs")
        if tuple(q.shape) != (n, vocab):
            raise ValueError(f"draft_probs must have shape ({n}, {vocab}), got {tuple(q.shape)}")
        keep.append(q)
        d.kind, d.dense = 1, _ptr(q)
    pvals = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    params = _params(batch, dev, keep, temperature, top_k, top_p, min_p, seed, position, check)
    _check_host_params("specfast.verify", pvals, batch, check)
    out = _out_dict(out, ("tokens", "num_accepted", "accepted_nodes", "status", "workspace"))
    width = max_draft + 1
    o_tok = _out(out, "tokens", (batch, width), torch.int32, dev)
    o_acc = _out(out, "num_accepted", (batch,), torch.int32, dev)
    o_nodes = _out(out, "accepted_nodes", (batch, max_draft), torch.int32, dev)
    status = _out(out, "status", (batch,), torch.int32, dev)
    if batch == 0:
        # torch gives empty tensors a NULL data pointer, which the C call refuses.
        return VerifyResult(o_tok, o_acc, o_nodes)
    vo = ffi.new("sf_verify_out *")
    vo.tokens = ffi.cast("int32_t *", o_tok.data_ptr())
    vo.num_accepted = ffi.cast("int32_t *", o_acc.data_ptr())
    vo.accepted_nodes = ffi.cast("int32_t *", o_nodes.data_ptr()) if max_draft else ffi.NULL
    vo.max_draft = max_draft
    with torch.cuda.device(dev):  # the workspace depends on the device (its clusters)
        need = lib().sf_cuda_verify_workspace(cl, d, m)
        ws = _workspace(out, need, dev) if need else None
        st = lib().sf_cuda_verify(cl, d, params, m, vo, ffi.cast("int32_t *", status.data_ptr()),
                                  _ptr(ws) if need else ffi.NULL, need, _stream(dev))
    if st:
        _raise_host(st, "specfast.verify", pvals)
    if check:
        _raise_device(status, "specfast.verify", pvals,
                      (tokens, nd, par if parents is not None else None, q, vocab))
    return VerifyResult(o_tok, o_acc, o_nodes)


def _rows(what, logits, name, call, check, out, temperature, top_k, top_p, min_p, seed,
          position):
    """sample and probs: ``call(c_logits, params, result, status, stream)`` launches
    the kernel that writes ``out[name]``: one token per row, or the rows' probs."""
    torch = _torch()
    check = _want_check(check)
    keep = []
    cl, x = _c_logits(logits, "logits", keep)
    dev = x.device
    rows = x.shape[0]
    pvals = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    params = _params(rows, dev, keep, temperature, top_k, top_p, min_p, seed, position, check,
                     "row")
    _check_host_params(what, pvals, rows, check)
    out = _out_dict(out, (name, "status"))
    if name == "tokens":
        result = _out(out, name, (rows,), torch.int32, dev)
        ptr = ffi.cast("int32_t *", result.data_ptr())
    else:
        result = _out(out, name, tuple(x.shape), torch.float32, dev)
        ptr = ffi.cast("float *", result.data_ptr())
    status = _out(out, "status", (rows,), torch.int32, dev)
    if rows == 0:
        return result  # as verify's empty batch: no NULL pointers into the C call
    with torch.cuda.device(dev):
        st = call(cl, params, ptr, ffi.cast("int32_t *", status.data_ptr()), _stream(dev))
    if st:
        _raise_host(st, what, pvals)
    if check:
        _raise_device(status, what, pvals)
    return result


def sample(logits, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, position=0,
           method="rejection", check=None, out=None):
    """:func:`specfast.sample` on a CUDA tensor; returns ``(rows,)`` int32 on the device."""
    m = _method(method)
    return _rows("specfast.sample", logits, "tokens",
                 lambda cl, params, *rest: lib().sf_cuda_sample(cl, params, m, *rest),
                 check, out, temperature, top_k, top_p, min_p, seed, position)


def probs(logits, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, check=None, out=None):
    """:func:`specfast.probs` on a CUDA tensor; returns ``(rows, V)`` float32 on the device."""
    return _rows("specfast.probs", logits, "probs", lambda *args: lib().sf_cuda_probs(*args),
                 check, out, temperature, top_k, top_p, min_p, 0, 0)
