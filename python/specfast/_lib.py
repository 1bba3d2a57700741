"""Finds, loads and checks the compiled library (cffi, ABI mode)."""

from __future__ import annotations

import functools
import importlib.resources
import os
import sys

import cffi

from ._cdef import CDEF

#: The library version this Python package was written against
#: (SF_VERSION_NUMBER = major * 10000 + minor * 100 + patch).
VERSION_NUMBER = 100

ffi = cffi.FFI()
ffi.cdef(CDEF)

_NAMES = {"linux": "libspecfast.so", "darwin": "libspecfast.dylib", "win32": "specfast.dll"}


def _library_path() -> str:
    override = os.environ.get("SPECFAST_LIBRARY")
    if override:
        return override
    name = _NAMES.get(sys.platform, "libspecfast.so")
    return str(importlib.resources.files("specfast") / name)


@functools.cache
def lib():
    """The loaded library; raises ImportError when it is missing or stale."""
    path = _library_path()
    try:
        handle = ffi.dlopen(path)
    except OSError as exc:
        raise ImportError(
            f"specfast: cannot load its compiled library {path!r} ({exc}); "
            "reinstall the package with `pip install .`"
        ) from None
    found = handle.sf_version()
    if found != VERSION_NUMBER:
        raise ImportError(
            f"specfast: the library at {path!r} is version {found}, "
            f"the Python package expects {VERSION_NUMBER}; reinstall specfast"
        )
    return handle



def check(status: int, what: str, index: int, detail=None) -> None:
    """Raises the exception that a non-zero status stands for."""
    if status == 0:
        return
    text = ffi.string(lib().sf_status_string(status)).decode()
    where = f" (at index {index})" if index >= 0 else ""
    extra = f": {detail}" if detail else ""
    message = f"{what}: {text}{where}{extra}"
    if status == lib().SF_ERR_NO_MEMORY:
        raise MemoryError(message)
    if status == lib().SF_ERR_THREADS:
        raise RuntimeError(message)
    if status == lib().SF_ERR_UNSUPPORTED:
        raise NotImplementedError(message)
    raise ValueError(message)
