"""The CUDA kernels built for the CPU: csrc/cuda/kernels.cu compiled as C++ against
tests/cuda_emu's emulated CUDA runtime (its header says what it models).

``load()`` compiles the library once per source version (about 3 s, cached in the
temporary directory) and opens it with ``specfast._cuda``'s cffi; tests/test_cuda.py
then runs its CPU-against-CUDA cases on it, with CPU tensors standing for device
memory, where no GPU is present.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
EMU = ROOT / "tests" / "cuda_emu"
# What the library is built from; a change in any of them rebuilds it.
SOURCES = sorted([*(ROOT / "csrc" / "cuda").iterdir(), *(ROOT / "csrc" / "common").iterdir(),
                  ROOT / "csrc" / "include" / "specfast.h", *EMU.iterdir()])
# As cmake/cuda.cmake builds the real one: no contraction into fused multiply-adds.
FLAGS = ["-x", "c++", "-std=c++17", "-O2", "-fPIC", "-shared", "-pthread", "-ffp-contract=off",
         "-fvisibility=hidden", "-Wall", "-Wno-unknown-pragmas", "-Wno-unused-function"]


class Unavailable(Exception):
    """The emulated library cannot be built here (the reason is the message)."""


def build() -> pathlib.Path:
    """The path of the built library, compiling it when its sources changed."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise Unavailable(f"the emulator's fibers need x86-64, not {platform.machine()}")
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise Unavailable(f"no C++ compiler {cxx!r}")
    h = hashlib.sha256(" ".join([cxx, *FLAGS]).encode())
    for f in SOURCES:
        h.update(f.name.encode() + f.read_bytes())
    out = pathlib.Path(tempfile.gettempdir()) / f"specfast-cuda-emu-{h.hexdigest()[:16]}"
    lib = out / "libspecfast_cuda.so"
    if lib.exists():
        return lib
    out.mkdir(exist_ok=True)
    tmp = out / f"build-{os.getpid()}.so"
    cmd = [cxx, *FLAGS, f"-I{EMU}", f"-I{ROOT / 'csrc' / 'include'}",
           f"-I{ROOT / 'csrc' / 'cuda'}", str(ROOT / "csrc" / "cuda" / "kernels.cu"), "-o", str(tmp)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"building the emulated CUDA library failed:\n{r.stderr}")
    os.replace(tmp, lib)  # atomic: a concurrent build leaves one whole library
    return lib


def load():
    """The emulated library, opened as ``specfast._cuda.lib()`` opens the real one."""
    from specfast import _cuda
    from specfast._lib import open_library

    def missing(path, exc):
        return RuntimeError(f"cannot open the emulated CUDA library {path}: {exc}")

    return open_library(_cuda.ffi, str(build()), "sf_cuda_version", missing)
