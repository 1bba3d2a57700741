"""Finds, loads and checks the compiled library (cffi, ABI mode)."""

from __future__ import annotations

import functools
import importlib.resources
import os
import sys
import warnings

import cffi

from ._cdef import CDEF

#: The library version this Python package was written against
#: (SF_VERSION_NUMBER = major * 10000 + minor * 100 + patch).
VERSION_NUMBER = 100

ffi = cffi.FFI()
ffi.cdef(CDEF)

_NAMES = {"linux": "libspecfast.so", "darwin": "libspecfast.dylib", "win32": "specfast.dll"}


def library_path(env: str, filename: str) -> str:
    """Where a library of the package is: $`env`, or `filename` in the package."""
    return os.environ.get(env) or str(importlib.resources.files("specfast") / filename)


def _library_path() -> str:
    return library_path("SPECFAST_LIBRARY", _NAMES.get(sys.platform, "libspecfast.so"))


def open_library(ffi_, path: str, version: str, missing, fix: str = "reinstall specfast"):
    """dlopen `path` and check that its `version` function returns this
    package's version. `missing(path, exc)` builds the exception raised when it
    cannot be loaded or is another library (no `version` function); `fix` ends
    the message of a library of another version."""
    try:
        handle = ffi_.dlopen(path)
        found = getattr(handle, version)()
    except (OSError, AttributeError) as exc:
        raise missing(path, exc) from None
    if found != VERSION_NUMBER:
        raise ImportError(
            f"specfast: the library at {path!r} is version {found}, "
            f"the Python package expects {VERSION_NUMBER}; {fix}"
        )
    return handle


def fix_for(env: str, default: str) -> str:
    """What to do about a library that would not do: about $`env` when it chose it."""
    if os.environ.get(env):
        return f"{env} names it: unset {env}, or point it at the right library"
    return default


@functools.cache
def lib():
    """The loaded library; raises ImportError when it is missing or stale."""
    simd = os.environ.get("SPECFAST_SIMD", "")
    if simd not in ("", "scalar", "avx2", "avx512"):  # the core ignores other values
        warnings.warn(f"SPECFAST_SIMD={simd!r} is not scalar, avx2 or avx512: ignored",
                      RuntimeWarning, stacklevel=2)
    fix = fix_for("SPECFAST_LIBRARY", "reinstall the package with `pip install .`")
    return open_library(
        ffi, _library_path(), "sf_version",
        lambda path, exc: ImportError(
            f"specfast: cannot load its compiled library {path!r} ({exc}); {fix}"), fix)


# The calls whose error index counts rows of logits; the others count requests.
_ROW_CALLS = ("specfast.sample", "specfast.probs")


class RequestError(ValueError):
    """A ValueError about one request of the batch (one row of ``sample`` and
    ``probs``): ``index`` says which, so that a server can drop that request and
    call again with the rest instead of reading the message."""

    def __init__(self, message: str, index: int):
        super().__init__(message)
        self.index = index


def check(status: int, what: str, index: int, detail=None) -> None:
    """Raises the exception that a non-zero status stands for; index is the
    request (the row for sample and probs) it concerns, -1 for the whole call."""
    if status == 0:
        return
    text = ffi.string(lib().sf_status_string(status)).decode()
    unit = "row" if what in _ROW_CALLS else "request"
    where = f" ({unit} {index})" if index >= 0 else ""
    extra = f": {detail}" if detail else ""
    message = f"{what}: {text}{where}{extra}"
    if status == lib().SF_ERR_NO_MEMORY:
        raise MemoryError(message)
    if status == lib().SF_ERR_THREADS:
        raise RuntimeError(message)
    if status == lib().SF_ERR_UNSUPPORTED:
        raise NotImplementedError(message)
    raise RequestError(message, index) if index >= 0 else ValueError(message)
