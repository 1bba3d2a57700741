"""The public functions: validate, allocate the outputs, call the library."""

from __future__ import annotations

import operator
import sys
import threading
from typing import Any, NamedTuple

import numpy as np

from ._lib import RequestError, check, ffi, lib

_METHODS = {"rejection": 0, "coupled": 1}
_F32, _F16, _BF16 = 0, 1, 2
_LOGIT_DTYPES = {np.dtype(np.float32): _F32, np.dtype(np.float16): _F16}
_MAX_VOCAB = (1 << 24) - (1 << 15)  # SF_MAX_VOCAB, SF_MAX_DRAFT, SF_MAX_BATCH of specfast.h
_MAX_DRAFT = 1024
_MAX_BATCH = 1 << 20


class SparseProbs:
    """A top-K draft distribution per draft node.

    Parameters
    ----------
    indices : array of int, shape ``(N, K)``
        Token ids the drafter sampled from; ``-1`` marks an unused slot.
    values : array of float, shape ``(N, K)``
        Their probabilities; each row sums to 1 and unused slots hold 0.

    Examples
    --------
    >>> q = specfast.SparseProbs(np.array([[5, 9]]), np.array([[0.75, 0.25]]))
    """

    __slots__ = ("_indices", "_values", "_torch")

    def __init__(self, indices, values):
        if any(_is_torch(a) and a.is_cuda for a in (indices, values)):
            # kept as given for the CUDA backend, which checks and moves them
            self._torch, self._indices, self._values = True, indices, values
            return
        self._torch = _is_torch(indices) or _is_torch(values)
        idx = _int_array(indices, "SparseProbs indices", ndim=2)
        val = _float_array(values, "SparseProbs values", ndim=2, probs=True)
        if idx.shape != val.shape:
            raise ValueError(
                f"SparseProbs: indices {idx.shape} and values {val.shape} must have the same shape"
            )
        if idx.shape[1] < 1:
            raise ValueError("SparseProbs: K (the second dimension) must be at least 1")
        self._indices = idx
        self._values = val

    # Read-only: they were checked (and converted) together.
    indices = property(lambda self: self._indices, doc="``(N, K)`` int32 token ids")
    values = property(lambda self: self._values, doc="``(N, K)`` float32 probabilities")

    def __repr__(self) -> str:
        return f"SparseProbs(N={self.indices.shape[0]}, K={self.indices.shape[1]})"

    def dense(self, vocab: int) -> np.ndarray:
        """The same distributions as ``(N, vocab)`` float32 rows (CPU arrays)."""
        vocab = operator.index(vocab)
        if not 1 <= vocab <= _MAX_VOCAB:
            raise ValueError(f"SparseProbs.dense: vocab must be in [1, {_MAX_VOCAB}], got {vocab}")
        idx, val = np.asarray(self.indices), np.asarray(self.values, np.float32)
        if idx.size and (idx.min() < -1 or idx.max() >= vocab):
            raise ValueError(f"SparseProbs.dense: ids must be in [-1, {vocab})")
        if _repeats(idx):
            raise ValueError("SparseProbs.dense: a row repeats a token id")
        if np.any((idx == -1) & (val != 0)):
            raise ValueError("SparseProbs.dense: an unused slot (id -1) holds a nonzero "
                             "probability")
        q = np.zeros((idx.shape[0], vocab), np.float32)
        rows, cols = np.nonzero(idx >= 0)
        q[rows, idx[rows, cols]] = val[rows, cols]
        return q


class VerifyResult(NamedTuple):
    """What :func:`verify` returns, per request.

    tokens : ``(B, max(num_draft) + 1)`` int32, accepted drafts then one
        corrected or bonus token, padded with -1.
    num_accepted : ``(B,)`` int32.
    accepted_nodes : ``(B, max(num_draft))`` int32, local indices of the
        accepted draft nodes in depth order, padded with -1.
    """

    tokens: Any
    num_accepted: Any
    accepted_nodes: Any


def _is_torch(x) -> bool:
    torch = sys.modules.get("torch")  # a tensor means torch is imported; never import it here
    return torch is not None and isinstance(x, torch.Tensor)


def _strided(t, name):
    """Refuses a sparse, mkldnn or nested tensor, which has no strides to read."""
    if t.layout != _torch().strided:
        raise TypeError(f"{name} must be a dense tensor, got layout {t.layout} "
                        "(call .to_dense())")
    if t.is_nested:  # its layout says strided
        raise TypeError(f"{name} must be a regular tensor, got a nested one")


def _torch_to_numpy(t, name):
    _strided(t, name)
    if t.device.type != "cpu":
        raise TypeError(f"{name} is on {t.device}: specfast takes CPU tensors, and CUDA "
                        "tensors when the logits are on a CUDA device")
    try:
        # A negated view (x.conj().imag) holds its values negated: resolved to a copy.
        return t.detach().resolve_neg().numpy()
    except TypeError:  # a dtype numpy lacks (float8, complex32, quantized)
        raise TypeError(f"{name} has dtype {t.dtype}, which specfast does not take") from None


_I32 = np.dtype(np.int32)


def _is_int(v) -> bool:
    """An int or numpy int, not a bool (a bool is an int to Python, not to us)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _asarray(x, name):
    """np.asarray(x) of an argument: a masked array (its mask would be dropped),
    a list of lists of different lengths or a list holding booleans (taken as 0
    and 1) are refused, naming the argument."""
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(f"{name} is a masked array, whose mask would be ignored: "
                        "pass its .filled(value)")
    if isinstance(x, (list, tuple)) and not {bool, np.bool_}.isdisjoint(map(type, x)):
        raise TypeError(f"{name} must hold numbers, not booleans")
    try:
        return np.asarray(x)
    except ValueError as exc:  # ragged
        raise ValueError(f"{name}: {exc}") from None


def _as_array(x, name):
    """np.asarray(x), with Python ints kept integer: numpy makes float64 of an
    empty list and of ints that mix [0, 2^63) with [2^63, 2^64) (random 64-bit
    seeds), and object arrays of ints past 64 bits."""
    a = _asarray(x, name)
    if a.dtype.kind not in "fO" or not isinstance(x, (list, tuple, int)):
        return a
    if a.size == 0:
        return a.astype(np.int64)
    flat = np.array(x, dtype=object).reshape(-1)
    if not all(_is_int(v) for v in flat):
        return a
    lo, hi = int(min(flat)), int(max(flat))
    for dtype in (np.int64, np.uint64):
        info = np.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return np.array([int(v) for v in flat], dtype).reshape(a.shape)
    raise ValueError(f"{name} holds integers out of range (from {lo} to {hi})")


def _c_array(a, dtype=None):
    """a as a C-contiguous array (of dtype) whose data is aligned to its type:
    the C core refuses a misaligned pointer (C forbids reading through one, and
    a GPU faults), and numpy makes one of a buffer at an odd offset."""
    return np.require(a, dtype, "CA")


def _int_array(x, name, ndim):
    if (type(x) is np.ndarray and x.dtype == _I32 and x.ndim == ndim and x.flags.c_contiguous
            and x.flags.aligned):
        return x  # the common case, checked first: this runs every decoding step
    if _is_torch(x):
        x = _torch_to_numpy(x, name)
    a = _as_array(x, name)
    if a.dtype.kind not in "iu":
        if a.size == 0 and a.dtype.kind == "f":
            a = a.astype(np.int32)
        else:
            raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
    if a.dtype != np.int32:
        if a.size and (a.min() < -(1 << 31) or a.max() >= (1 << 31)):
            raise ValueError(f"{name} has values outside the int32 range")
        a = a.astype(np.int32)
    return _c_array(a)


# bfloat16 keeps 8 significant bits: rounding each probability can move a row's
# sum by up to 2^-8, past the 1e-3 that the kernels allow.
_BF16_SUM_SLACK = 2.0 ** -8


def _float_array(x, name, ndim, probs=False):
    """x as contiguous float32. probs: rows of probabilities, and a bfloat16 row
    whose sum is within its rounding of 1 is rescaled to sum to 1."""
    bf16 = False
    if _is_torch(x):
        bf16 = str(x.dtype) == "torch.bfloat16"
        x = _torch_to_numpy(x.float() if bf16 else x, name)
    a = _asarray(x, name)
    if a.dtype.name == "bfloat16":  # ml_dtypes; float32 holds it exactly
        a, bf16 = a.astype(np.float32), True
    if a.dtype.kind != "f":
        raise TypeError(f"{name} must hold floats, got dtype {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
    a = _c_array(a, np.float32)
    if probs and bf16 and a.size:  # a is a copy here
        # Times a float32 1 / sum, as the CUDA backend does: the same bits.
        s = a.sum(axis=-1, dtype=np.float64, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):  # a row summing to 0 or inf
            inv = np.where(np.abs(s - 1.0) <= _BF16_SUM_SLACK, 1.0 / s, 1.0).astype(np.float32)
        a *= inv
    return a


def _logits(x, name="target_logits"):
    """Returns (array, dtype code, row stride) for 2-D logits, zero-copy when
    the rows are contiguous."""
    if type(x) is np.ndarray and x.ndim == 2 and x.flags.c_contiguous and x.flags.aligned:
        code = _LOGIT_DTYPES.get(x.dtype)
        if code is not None and 1 <= x.shape[1] <= _MAX_VOCAB:
            return x, code, x.shape[1]
    if _is_torch(x):
        _strided(x, name)
        if str(x.dtype) == "torch.bfloat16":
            if x.device.type != "cpu":
                _torch_to_numpy(x, name)
            x = x.detach().resolve_neg()
            if x.dim() == 2 and x.stride(1) != 1:
                x = x.contiguous()
            a, code = x.view(_torch().int16).numpy(), _BF16
        else:
            try:
                a = _torch_to_numpy(x, name)
            except TypeError:
                if x.device.type != "cpu":
                    raise
                raise TypeError(f"{name} must be float32, float16 or bfloat16, "
                                f"got dtype {x.dtype}") from None
            code = None
    else:
        a = _asarray(x, name)
        code = None
    if code is None:
        if not a.dtype.isnative:
            a = a.astype(a.dtype.newbyteorder("="))
        code = _LOGIT_DTYPES.get(a.dtype)
        if code is None:
            if a.dtype.name == "bfloat16":  # ml_dtypes
                a, code = a.view(np.uint16), _BF16
            else:
                raise TypeError(
                    f"{name} must be float32, float16 or bfloat16, got dtype {a.dtype}"
                )
    if a.ndim != 2:
        raise ValueError(f"{name} must be 2-D (rows, vocab), got shape {a.shape}")
    item = a.itemsize
    if (a.strides[1] != item or a.strides[0] % item or a.strides[0] < a.shape[1] * item
            or not a.flags.aligned):
        a = _c_array(a)
    stride = a.strides[0] // item if a.shape[0] > 1 else a.shape[1]
    if a.shape[1] < 1 or a.shape[1] > _MAX_VOCAB:
        raise ValueError(f"{name}: vocab size {a.shape[1]} must be in [1, {_MAX_VOCAB}]")
    return a, code, stride


def _torch():
    try:
        import torch
    except ImportError as exc:  # the CUDA backend called without torch installed
        raise ImportError(f"specfast's CUDA backend works on torch tensors: pip install "
                          f"torch ({exc})") from exc
    return torch


_CTYPES = {
    "temperature": ("float", np.dtype(np.float32)),
    "top_k": ("int32_t", np.dtype(np.int32)),
    "top_p": ("float", np.dtype(np.float32)),
    "min_p": ("float", np.dtype(np.float32)),
    "seed": ("uint64_t", np.dtype(np.uint64)),
    "position": ("int64_t", np.dtype(np.int64)),
}


def _scalar(value, name, integer):
    """A Python number for a scalar parameter, or None when `value` is an array."""
    if isinstance(value, bool) or value is None:
        raise TypeError(f"{name} must be a number or an array, got {value!r}")
    if isinstance(value, float) or (not integer and isinstance(value, int)):
        if integer and not value.is_integer():
            raise TypeError(f"{name} must be an integer, got {value!r}")
        return int(value) if integer else value
    if isinstance(value, int):
        return value
    if isinstance(value, np.generic):
        if value.dtype.kind not in "iuf":
            raise TypeError(f"{name} must be numeric, got {value!r}")
        v = value.item()
        # A longdouble's item() is itself: no Python type holds it.
        return _scalar(float(v) if isinstance(v, np.generic) else v, name, integer)
    return None


def _array_param(value, name, batch, keep, unit):
    ctype, dtype = _CTYPES[name]
    if _is_torch(value):
        if value.dtype == _torch().bfloat16:  # numpy has none; float32 holds it exactly
            if dtype != np.float32:
                raise TypeError(f"{name} must hold integers, got dtype {value.dtype}")
            value = value.float()
        value = _torch_to_numpy(value, name)
    a = _as_array(value, name)
    if a.dtype.name == "bfloat16" and dtype == np.float32:  # ml_dtypes
        a = a.astype(np.float32)
    if name == "temperature" and a.dtype.kind == "f":
        a = _lift_temperatures(a)
    if a.ndim > 1 or (a.ndim == 1 and a.shape[0] not in (1, batch)):
        raise ValueError(
            f"{name} must be a scalar or have one value per {unit} ({batch}), got shape {a.shape}"
        )
    if dtype != np.float32 and a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
    if a.dtype.kind not in "iuf":
        raise TypeError(f"{name} must be numeric, got dtype {a.dtype}")
    _int_range(a, name, dtype, unit)
    a = _c_array(a.reshape(-1), dtype)
    keep.append(a)
    return _ptr(f"{ctype} *", a), a.shape[0]


def _int_range(a, name, dtype, unit="request"):
    """Refuses the entries of integer parameter array a that the core's C type
    `dtype` does not hold as they are (seed: uint64, top_k: int32, position:
    int64), naming the first (a request, or a row of sample and probs). Both
    backends."""
    if not a.size:
        return
    if dtype == np.uint64 and a.dtype.kind == "i" and a.min() < 0:
        raise _bad_param(f"{name} must be non-negative", a, a < 0, unit)
    if dtype == np.int32 and (a.min() < 0 or a.max() >= 1 << 31):
        raise _bad_param(f"{name} must be in [0, 2^31)", a, (a < 0) | (a >= 1 << 31), unit)
    if dtype == np.int64 and a.dtype == np.uint64 and a.max() >= 1 << 63:
        raise _bad_param(f"{name} must be below 2^63", a, a >= 1 << 63, unit)


def _bad_param(message, a, bad, unit="request") -> ValueError:
    """The error of parameter array a, whose entries `bad` (a mask) break the rule
    `message` says: a RequestError naming the first where a has one per request."""
    i = int(np.flatnonzero(bad)[0]) if a.ndim else 0
    value = a.reshape(-1)[i].item()
    if a.ndim and a.shape[0] > 1:
        return RequestError(f"{message} ({unit} {i}: {value})", i)
    return ValueError(f"{message} (got {value})")


_PLAIN = (int, float)


def _single(v, name):
    """The number in a one-element array of the parameter's C type (which means
    the same as the number), else v itself."""
    if v.shape == (1,) and v.dtype == _CTYPES[name][1]:
        return v.item()
    return v


_ARRAY_TYPES = {}
# Parsed once: ffi.new with a type object skips the parse on every call.
_T_DRAFT, _T_OUT, _T_ERR, _T_LOGITS, _T_PARAMS = (
    ffi.typeof(t) for t in ("sf_draft *", "sf_verify_out *", "sf_error *", "sf_logits *",
                            "sf_params *"))
_T_F3, _T_I3, _T_U1, _T_I32P, _T_U64P = (
    ffi.typeof(t) for t in ("float[3]", "int64_t[3]", "uint64_t[1]", "int32_t *", "uint64_t *"))


class _Frame(threading.local):
    """Per-thread C structs that every call reuses instead of allocating its
    own (a call fills each field it passes): on a lone request, allocating
    them cost more than the core's work. A call made inside another on the
    same thread (a signal handler or __del__ running between the outer call's
    filling and its C call) takes a fresh frame: see _take_frame."""

    def __init__(self):
        self.busy = False
        self.floats = ffi.new(_T_F3)  # temperature, top_p, min_p
        self.ints = ffi.new(_T_I3)  # top_k (read as int32), unused, position
        self.seeds = ffi.new(_T_U1)
        i32 = ffi.cast(_T_I32P, self.ints)
        self.params = ffi.new(_T_PARAMS, (self.floats, 1, i32, 1, self.floats + 1, 1,
                                          self.floats + 2, 1, self.seeds, 1, self.ints + 2, 1))
        self.err = ffi.new(_T_ERR)


_frame = _Frame()


def _take_frame():
    """This thread's frame, marked busy until the caller clears ``busy``."""
    f = _frame
    if f.busy:
        f = _Frame()
    f.busy = True
    return f


_PARAM_NAMES = ("temperature", "top_k", "top_p", "min_p", "seed", "position")


def _params(f, batch, temperature, top_k, top_p, min_p, seed, position, keep, unit="request"):
    """An sf_params; scalars in frame f's buffers, arrays are passed as is. `unit`:
    what the batch counts in messages (request, or row)."""
    # A server's lone request passes its seed and position as arrays.
    if type(seed) is np.ndarray:
        seed = _single(seed, "seed")
    if type(position) is np.ndarray:
        position = _single(position, "position")
    if (type(seed) is np.ndarray or type(position) is np.ndarray
            or type(temperature) is np.ndarray or type(top_k) is np.ndarray
            or type(top_p) is np.ndarray or type(min_p) is np.ndarray):
        # One-element arrays (a lone request's own values) take the numbers' path.
        temperature, top_k, top_p, min_p, seed, position = [
            _single(v, name) if type(v) is np.ndarray else v
            for v, name in zip((temperature, top_k, top_p, min_p, seed, position),
                               _PARAM_NAMES)]
    if (type(temperature) in _PLAIN and type(top_p) in _PLAIN and type(min_p) in _PLAIN
            and type(top_k) is int and type(seed) is int and type(position) is int
            and 0 <= top_k < 1 << 31 and 0 <= seed < 1 << 64 and -(1 << 63) <= position < 1 << 63):
        # Every parameter a plain number: the common case, in the frame.
        floats, ints = f.floats, f.ints
        try:
            floats[0] = temperature
            floats[1] = top_p
            floats[2] = min_p
        except OverflowError:  # an int beyond any float: the path below says which
            pass
        else:
            if 0 < temperature < _F32_TINY:  # below float32's range: see _as_float
                floats[0] = _F32_TINY
            ints[0] = top_k
            ints[2] = position
            f.seeds[0] = seed
            return f.params
    floats = ffi.new(_T_F3)
    ints = ffi.new(_T_I3)  # top_k (as int32), seed, position
    keep += [floats, ints]
    t = _float_param(temperature, "temperature", floats, 0, batch, keep, unit)
    tp = _float_param(top_p, "top_p", floats, 1, batch, keep, unit)
    mp = _float_param(min_p, "min_p", floats, 2, batch, keep, unit)
    k = _int_param(top_k, "top_k", ffi.cast(_T_I32P, ints), batch, keep, unit)
    sd = _int_param(seed, "seed", ffi.cast(_T_U64P, ints + 1), batch, keep, unit)
    ps = _int_param(position, "position", ints + 2, batch, keep, unit)
    p = ffi.new(_T_PARAMS, t + k + tp + mp + sd + ps)
    keep.append(p)
    return p


_INT_RANGES = {"top_k": (0, 1 << 31), "seed": (0, 1 << 64), "position": (-(1 << 63), 1 << 63)}


def _exact_array(v, dtype, batch) -> bool:
    """A numpy array the C core can read as is: 1-D, contiguous, of the C
    type, with one value or one per request."""
    return (type(v) is np.ndarray and v.dtype == dtype and v.ndim == 1
            and v.shape[0] in (1, batch) and v.flags.c_contiguous and v.flags.aligned)


def _as_float(v, name):
    try:
        x = float(v)
    except OverflowError:  # an int beyond any float
        raise ValueError(f"{name} is out of range: too large for a float") from None
    return _F32_TINY if name == "temperature" and 0 < x < _F32_TINY else x


# The smallest float32 above 0. A temperature too small for float32 is read as
# this, not as 0 (greedy): like every temperature below the core's floor it then
# spreads the mass over the tokens tied at the top.
_F32_TINY = float(np.nextafter(np.float32(0), np.float32(1)))


def _lift_temperatures(a):
    """Float temperatures (a numpy array or torch tensor) with those that float32
    would round to 0 made _F32_TINY: see _as_float."""
    if a.dtype.itemsize <= 4:  # no float16 or float32 is below _F32_TINY
        return a
    where = _torch().where if _is_torch(a) else np.where
    return where((a > 0) & (a < _F32_TINY), _F32_TINY, a)


def _float_param(v, name, buf, i, batch, keep, unit):
    """(pointer, count) of a float parameter: a number goes into buf[i]."""
    if type(v) in _PLAIN:
        buf[i] = _as_float(v, name)
        return buf + i, 1
    if _exact_array(v, _CTYPES[name][1], batch):
        keep.append(v)
        return _ptr("float *", v), v.shape[0]
    x = _scalar(v, name, False)
    if x is None:
        return _array_param(v, name, batch, keep, unit)
    buf[i] = _as_float(x, name)
    return buf + i, 1


def _int_param(v, name, slot, batch, keep, unit):
    """(pointer, count) of an integer parameter: a number goes into *slot."""
    ctype, dtype = _CTYPES[name]
    if _exact_array(v, dtype, batch) and (name != "top_k" or not v.size or v.min() >= 0):
        keep.append(v)
        return _ptr(ctype + " *", v), v.shape[0]
    x = _scalar(v, name, True)
    if x is None:
        return _array_param(v, name, batch, keep, unit)
    lo, hi = _INT_RANGES[name]
    if not lo <= x < hi:
        raise ValueError(f"{name}={x} is out of range [{lo}, {hi})")
    slot[0] = x
    return slot, 1


def _method(method):
    code = _METHODS.get(method) if isinstance(method, str) else None
    if code is None:
        raise ValueError(f"method must be 'rejection' or 'coupled', got {method!r}")
    return code


def _ptr(ctype, a):
    """A pointer to the data of contiguous array `a` (which it keeps alive)."""
    t = _ARRAY_TYPES.get(ctype)
    if t is None:
        t = _ARRAY_TYPES[ctype] = ffi.typeof(ctype.replace("*", "[]"))
    return ffi.from_buffer(t, a)


def _c_logits(a, code, stride, keep):
    if a.flags.c_contiguous:
        data = ffi.from_buffer(a)
        keep.append(data)
    else:  # strided rows
        data = ffi.cast("void *", a.ctypes.data)
    c = ffi.new(_T_LOGITS, (data, code, a.shape[0], a.shape[1], stride))
    keep.append(c)
    return c


_PARAM_RULES = (
    "0 <= temperature <= 1e30, top_k >= 0, 0 < top_p <= 1 and 0 <= min_p <= 1"
)


# The rules of _PARAM_RULES (shared.h's sf_params_ok), for checks made in Python
# (the CUDA backend's host-held values, generate's): on numpy arrays of the values
# as the C code reads them, float32 and int32.
_PARAM_OK = {
    "temperature": lambda v: (v >= 0) & (v <= np.float32(1e30)),  # SF_MAX_TEMPERATURE
    "top_k": lambda v: (v >= 0) & (v < 1 << 31),
    "top_p": lambda v: (v > 0) & (v <= 1),
    "min_p": lambda v: (v >= 0) & (v <= 1),
}


def _param_values(v) -> np.ndarray:
    """A parameter's values, 1-D on the host (a device tensor is copied back)."""
    if _is_torch(v):
        t = v.detach().resolve_neg().reshape(-1).cpu()  # a negated view holds -v
        return (t.float() if str(t.dtype) == "torch.bfloat16" else t).numpy()
    return np.asarray(v).reshape(-1)


def _first_bad_param(param_values) -> int | None:
    """The first request whose parameters break _PARAM_RULES, -1 where a value
    given once for all does (before any request, as sf_params_check), or None;
    each value is a number or one per request."""
    first = None
    for k, v in param_values.items():
        vv = _param_values(v)
        if k != "top_k":
            with np.errstate(over="ignore"):
                vv = vv.astype(np.float32)  # what C reads (too large: inf)
        bad = np.flatnonzero(~_PARAM_OK[k](vv))
        if bad.size and vv.size == 1:
            return -1
        if bad.size and (first is None or bad[0] < first):
            first = int(bad[0])
    return first


def _param_detail(param_values, index) -> str:
    """_PARAM_RULES and request index's values (-1: the values given once), for
    the error message."""
    shown = []
    for k, v in param_values.items():
        vv = _param_values(v)
        if vv.size != 1 and index < 0:
            continue
        value = vv[0 if vv.size == 1 else index]
        value = value.item() if isinstance(value, np.generic) else value  # or a stand-in
        # The rules hold for the float32 values the kernels read: say where
        # rounding to float32 made a value 0 or inf.
        with np.errstate(over="ignore"):
            as32 = float(np.float32(value)) if isinstance(value, float) else value
        rounded = as32 != value and (as32 == 0 or np.isinf(as32))
        shown.append(f"{k}={value!r}" + (f" (float32 {as32!r})" if rounded else ""))
    return f"{_PARAM_RULES}; got " + ", ".join(shown)


def _raise(status, what, index, param_values, draft=None):
    check(status, what, index, _failure_detail(status, index, param_values, draft))


def _failure_detail(status, index, param_values, draft=None):
    """What a failed call's message adds for request index: the parameters for
    SF_ERR_PARAM, the draft node for the draft checks (draft: verify's (tokens,
    num_draft, parents, probs, vocab)), else None. For either backend."""
    if status == lib().SF_ERR_PARAM:
        return _param_detail(param_values, index)
    return _draft_detail(status, index, *draft) if draft and index >= 0 else None


def _host(x):
    return x.detach().cpu().numpy() if _is_torch(x) else x


def _q_ok(v):
    """shared.h's sf_prob_ok on float32 values: a draft probability in [0, 1.001]."""
    return (v >= 0) & (v <= np.float32(1.001))


def _sum_off(v) -> str | None:
    """The sum of probabilities v and what is wrong with it, where it is not 1
    within 1e-3 (the kernels' rule), for a message; else None."""
    total = float(np.sum(v, dtype=np.float64))
    return None if abs(total - 1.0) <= 1e-3 else f"{total!r}, not 1 within 1e-3"


def _bad_parent(index, num_draft, parents):
    """Which node of request `index` has a parent outside [-1, its index), and
    which, for a message (verify's and tree_mask's); None where none does."""
    n0 = int(np.sum(num_draft[:index], dtype=np.int64))
    for j in range(int(num_draft[index])):
        if not -1 <= int(parents[n0 + j]) < j:
            return f"node {j}: parent {int(parents[n0 + j])} is not in [-1, {j})"
    return None


def _draft_detail(status, index, tokens, num_draft, parents, probs, vocab):
    """Which draft node of request `index` broke the rule of `status` and how:
    looked for only once the core has failed, so its cost does not matter. None
    where it cannot say. probs: dense rows, (ids, values) or None. Dense rows are
    checked where the kernel reads them: this looks at the drafted token first,
    then at the whole row."""
    tokens, num_draft, parents = _host(tokens), _host(num_draft), _host(parents)
    if status == lib().SF_ERR_PARENT:
        return _bad_parent(index, num_draft, parents)
    n0 = int(np.sum(num_draft[:index], dtype=np.int64))
    for j in range(int(num_draft[index])):
        t = int(tokens[n0 + j])
        if status == lib().SF_ERR_TOKEN and not 0 <= t < vocab:
            return f"node {j}: token {t} is not in [0, {vocab})"
        if status != lib().SF_ERR_DRAFT_PROBS or probs is None:
            continue
        if isinstance(probs, tuple):  # sparse: (ids, values)
            ids = _host(probs[0])[n0 + j]
            val = _host(probs[1])[n0 + j].astype(np.float32)
            bad = np.flatnonzero((ids < -1) | (ids >= vocab) | ~_q_ok(val)
                                 | ((ids == -1) & (val != 0)))
            if bad.size:
                a = bad[0]
                return (f"node {j}: slot {a} holds token {int(ids[a])} with probability "
                        f"{float(val[a])!r} (ids in [-1, {vocab}), values in [0, 1.001], "
                        "0 for an unused -1)")
            if _repeats(ids[None]):
                return f"node {j}: a token id appears twice"
            off = _sum_off(val)
            if off:
                return f"node {j}: the probabilities sum to {off}"
            continue
        row = _host(probs)[n0 + j].astype(np.float32)
        bad = np.flatnonzero(~_q_ok(row))
        if bad.size:
            at = t if 0 <= t < vocab and not _q_ok(row[t]) else int(bad[0])
            return (f"node {j}: draft_probs at {'its token' if at == t else 'token'} {at} "
                    f"is {float(row[at])!r}, not in [0, 1.001]")
        off = _sum_off(row)
        if off:
            return f"node {j}: draft_probs sums to {off}"
    return None


def _repeats(ids) -> bool:
    """Whether a row of ids (N, K) names a token twice (-1 marks an unused slot)."""
    s = np.sort(ids, axis=1)
    return bool(np.any((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)))


def verify(target_logits, draft_tokens, num_draft, *, draft_probs=None, parents=None,
           temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, position=0,
           method="rejection"):
    """Verifies a ragged batch of draft chains or trees against the target.

    Parameters
    ----------
    target_logits : array, shape ``(T, V)``, float32, float16 or bfloat16
        Request b owns ``num_draft[b] + 1`` consecutive rows: its row 0 holds
        the logits at its last accepted token, row ``1 + i`` those after draft
        node i. Rows may be strided; each row must be contiguous.
    draft_tokens : int array, shape ``(N,)``, ``N = sum(num_draft)``
    num_draft : int array, shape ``(B,)``
        Draft nodes per request (0 allowed).
    draft_probs : None, float32 array ``(N, V)`` or :class:`SparseProbs`
        The distribution each node's token was drawn from. None: the drafts are
        deterministic (one-hot). A token whose draft probability is 0 is rejected.
        Other float dtypes are widened to float32; a bfloat16 row within 2^-8 of
        summing to 1 (its rounding alone can move the sum that far) is rescaled
        to sum to 1.
    parents : None or int array ``(N,)``
        Per node, the local index of its parent within its request, -1 for a
        child of row 0; parents precede children. None: chains.
    temperature, top_k, top_p, min_p, seed, position : scalar or ``(B,)``
        The target distribution is :func:`probs` of each row. ``position`` is the
        absolute index of the token that a request's row 0 predicts; with
        ``seed`` it keys every random draw.
    method : {"rejection", "coupled"}
        "rejection": speculative (recursive) rejection sampling. "coupled":
        Gumbel-max coupling; a draft is accepted iff it equals the target's
        own token, so the output does not depend on the drafter.

    Returns
    -------
    VerifyResult
        ``tokens`` ``(B, max(num_draft) + 1)``, ``num_accepted`` ``(B,)``,
        ``accepted_nodes`` ``(B, max(num_draft))``; numpy in, numpy out; torch
        in, torch out.

    Notes
    -----
    Limits: ``V <= 2**24 - 2**15``, ``B <= 2**20``, at most 1024 draft nodes per request;
    beyond them a ValueError. Memory: besides the outputs and 8 bytes per request,
    each pool thread keeps scratch between calls of at most about ``36 * V`` bytes
    + 508 KiB (``V / 32`` for block sums; ``8 * V`` with dense draft probabilities in
    a tree with siblings; up to ``24 * V`` for the candidates of the cut of ``top_p``
    without ``top_k`` or of ``top_k > 4096``, and ``4 * V`` + 508 KiB for the
    former's histogram)
    plus ``16 * K`` bytes per draft node with :class:`SparseProbs` of width K.
    In rejection sampling the residual ``max(0, p - q)`` of a rejected last
    sibling is drawn by up to 16 tries from p, each reading q at the token it
    draws; it is formed whole (reading the q row) only where a later sibling is
    tried against it or no try keeps a token. Dense draft probabilities are
    checked where they are read (values in [0, 1.001]): at the drafted token, at
    each try's token, and where a residual is formed whole at every token with a
    weight under the filters; there their sum (1 within 1e-3) too where no filter is set,
    since under ``top_k``, ``top_p`` or ``min_p`` only the kept tokens are read.
    Greedy and coupled verification do not read dense draft probabilities (a
    ``SparseProbs`` is checked whole under every method).

    A torch CUDA tensor runs on the GPU (:mod:`specfast.cuda`), on the current
    stream, with no host synchronisation: errors found in its device data leave
    the failed request with ``num_accepted`` 0 and tokens -1 instead of raising,
    unless ``SPECFAST_CUDA_CHECK=1``; :func:`specfast.cuda.verify` also takes
    ``check``, ``max_draft`` and ``out`` (CUDA graph capture).

    Examples
    --------
    >>> logits = np.random.randn(3, 100).astype(np.float32)   # one request, 2 drafts
    >>> r = specfast.verify(logits, np.array([7, 42]), np.array([2]), seed=1)
    >>> r.tokens.shape, r.num_accepted.shape
    ((1, 3), (1,))
    """
    torch_out = type(target_logits) is not np.ndarray and _is_torch(target_logits)
    if torch_out and target_logits.is_cuda:
        from . import _cuda

        return _cuda.verify(target_logits, draft_tokens, num_draft, draft_probs=draft_probs,
                            parents=parents, temperature=temperature, top_k=top_k, top_p=top_p,
                            min_p=min_p, seed=seed, position=position, method=method)
    m = _method(method)
    a, code, stride = _logits(target_logits)
    vocab = a.shape[1]
    tokens = _int_array(draft_tokens, "draft_tokens", 1)
    nd = _int_array(num_draft, "num_draft", 1)
    batch, n = nd.shape[0], tokens.shape[0]
    keep = [a, tokens, nd]
    d = ffi.new(_T_DRAFT, (_ptr("int32_t *", tokens), n, _ptr("int32_t *", nd), batch))
    if parents is not None:
        par = _int_array(parents, "parents", 1)
        if par.shape[0] != n:
            raise ValueError(f"parents has {par.shape[0]} entries, draft_tokens has {n}")
        keep.append(par)
        d.parents = _ptr("int32_t *", par)
    q = draft_probs  # as the core reads it: for an error's detail
    if draft_probs is None:
        d.kind = 0
    elif isinstance(draft_probs, SparseProbs):
        if not all(isinstance(a, np.ndarray) for a in (draft_probs.indices, draft_probs.values)):
            raise TypeError("draft_probs: a SparseProbs of CUDA tensors needs CUDA logits")
        if draft_probs.indices.shape[0] != n:
            raise ValueError(
                f"draft_probs has {draft_probs.indices.shape[0]} rows, draft_tokens has {n}"
            )
        d.kind, d.sparse_k = 2, draft_probs.indices.shape[1]
        q = (draft_probs.indices, draft_probs.values)
        d.sparse_ids = _ptr("int32_t *", draft_probs.indices)
        d.sparse_probs = _ptr("float *", draft_probs.values)
    else:
        q = _float_array(draft_probs, "draft_probs", 2, probs=True)
        if q.shape != (n, vocab):
            raise ValueError(f"draft_probs must have shape ({n}, {vocab}), got {q.shape}")
        keep.append(q)
        d.kind, d.dense = 1, _ptr("float *", q)
    if batch == 1:
        lowest = max_draft = total = int(nd[0])
    elif batch <= 64:  # numpy reductions cost more than the list on small batches
        counts = nd.tolist()
        lowest, max_draft, total = min(counts, default=0), max(counts, default=0), sum(counts)
    else:
        lowest, max_draft, total = int(nd.min()), int(nd.max()), int(nd.sum(dtype=np.int64))
    if lowest < 0:
        raise ValueError("num_draft must be >= 0")
    if max_draft > _MAX_DRAFT:
        raise ValueError(f"num_draft: at most {_MAX_DRAFT} draft nodes per request, got {max_draft}")
    if batch > _MAX_BATCH:
        raise ValueError(f"num_draft: at most {_MAX_BATCH} requests per call, got {batch}")
    if total != n:
        raise ValueError(f"sum(num_draft) = {total} but draft_tokens has {n} entries")
    if a.shape[0] != n + batch:
        raise ValueError(
            f"target_logits has {a.shape[0]} rows; sum(num_draft + 1) = {n + batch} needed"
        )
    # One allocation for the three outputs.
    width = max_draft + 1
    buf = np.empty(batch * (2 * width), np.int32)
    out_tokens = buf[: batch * width].reshape(batch, width)
    out_acc = buf[batch * width: batch * width + batch]
    out_nodes = buf[batch * width + batch:].reshape(batch, max_draft)
    base = _ptr("int32_t *", buf)
    out = ffi.new(_T_OUT, (base, base + batch * width, base + batch * width + batch, max_draft))
    f = _take_frame()
    try:
        params = _params(f, batch, temperature, top_k, top_p, min_p, seed, position, keep)
        status = lib().sf_verify(_c_logits(a, code, stride, keep), d, params, m, out, f.err)
        index = f.err.index
    finally:
        f.busy = False
    if status:
        _raise(status, "specfast.verify", index,
               dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p),
               (tokens, nd, par if parents is not None else None, q, vocab))
    if torch_out:
        torch = _torch()
        return VerifyResult(torch.from_numpy(out_tokens), torch.from_numpy(out_acc),
                            torch.from_numpy(out_nodes))
    return VerifyResult(out_tokens, out_acc, out_nodes)


def sample(logits, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, position=0,
           method="rejection"):
    """Samples one token per row from :func:`probs` of that row.

    Parameters
    ----------
    logits : array, shape ``(rows, V)``, float32, float16 or bfloat16
    temperature, top_k, top_p, min_p, seed, position : scalar or ``(rows,)``
        ``position`` is the absolute index of the token being sampled. The
        draw is keyed by (seed, position) alone: rows given the same pair draw
        the same uniforms (identical rows give the same token), so independent
        rows need their own seed or position.
    method : {"rejection", "coupled"}
        "rejection" draws by inverse CDF; "coupled" draws the Gumbel-max token
        that coupled verification uses at the same (seed, position), so a
        drafter sampling this way agrees with the target as often as possible.

    Returns
    -------
    tokens : ``(rows,)`` int32 (a torch tensor for torch input). On a CUDA
    tensor, errors in device data give -1 rather than raise (see :func:`verify`).

    Examples
    --------
    >>> specfast.sample(np.zeros((2, 10), np.float32), seed=3, position=[5, 6]).shape
    (2,)
    """
    torch_out = _is_torch(logits)
    if torch_out and logits.is_cuda:
        from . import _cuda

        return _cuda.sample(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                            min_p=min_p, seed=seed, position=position, method=method)
    m = _method(method)
    a, code, stride = _logits(logits, "logits")
    keep = [a]
    out = np.empty(a.shape[0], np.int32)
    f = _take_frame()
    try:
        params = _params(f, a.shape[0], temperature, top_k, top_p, min_p, seed, position, keep,
                         "row")
        status = lib().sf_sample(_c_logits(a, code, stride, keep), params, m,
                                 _ptr("int32_t *", out), f.err)
        index = f.err.index
    finally:
        f.busy = False
    if status:
        _raise(status, "specfast.sample", index,
               dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p))
    return _torch().from_numpy(out) if torch_out else out


def probs(logits, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The target distribution of each row, as verification and sampling use it.

    softmax(logits / temperature); keep the ``top_k`` most probable (0 keeps
    all); keep the shortest most-probable prefix whose mass reaches ``top_p``;
    drop tokens below ``min_p`` times the largest probability; renormalise
    after each step. Ties rank the lower token id first; temperature 0 is
    greedy (one-hot at the first largest logit); a logit of -inf is a banned
    token. Tokens below 2^-40 of the largest probability get 0.

    Parameters
    ----------
    logits : array, shape ``(rows, V)``, float32, float16 or bfloat16
    temperature, top_k, top_p, min_p : scalar or ``(rows,)``

    Returns
    -------
    ``(rows, V)`` float32 (a torch tensor for torch input). On a CUDA tensor,
    a row whose device data is bad reads NaN rather than raise (see :func:`verify`).

    Examples
    --------
    >>> specfast.probs(np.array([[0.0, 0.0, -np.inf]], np.float32))
    array([[0.5, 0.5, 0. ]], dtype=float32)
    """
    torch_out = _is_torch(logits)
    if torch_out and logits.is_cuda:
        from . import _cuda

        return _cuda.probs(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                           min_p=min_p)
    a, code, stride = _logits(logits, "logits")
    keep = [a]
    out = np.empty(a.shape, np.float32)
    f = _take_frame()
    try:
        params = _params(f, a.shape[0], temperature, top_k, top_p, min_p, 0, 0, keep, "row")
        status = lib().sf_probs(_c_logits(a, code, stride, keep), params, _ptr("float *", out),
                                f.err)
        index = f.err.index
    finally:
        f.busy = False
    if status:
        _raise(status, "specfast.probs", index,
               dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p))
    return _torch().from_numpy(out) if torch_out else out


def set_num_threads(n: int) -> None:
    """Sets the threads of the pool: n >= 1 (at most 256 are started), or 0 for one
    per core of the process. RuntimeError where they cannot start (the setting
    before stays)."""
    n = operator.index(n)
    if not 0 <= n < 1 << 31:
        raise ValueError(f"set_num_threads: n must be in [0, 2^31), got {n}")
    check(lib().sf_set_num_threads(n), "specfast.set_num_threads", -1)


def get_num_threads() -> int:
    """The threads the calls run on, the caller's included: the pool's size, or 1
    where its workers could not start. Does not wait for another thread's call."""
    return lib().sf_get_num_threads()


def simd_level() -> str:
    """The SIMD level in use: "scalar", "avx2" or "avx512"."""
    return ffi.string(lib().sf_simd_level()).decode()
