"""The CUDA kernels built for the CPU: csrc/cuda/kernels.cu compiled as C++ against
tests/cuda_emu's emulated CUDA runtime (its header says what it models).

``load()`` compiles the library once per source version (about 3 s, cached in the
temporary directory) and opens it with ``specfast._cuda``'s cffi; tests/test_cuda.py
then runs its CPU-against-CUDA cases on it, with CPU tensors standing for device
memory, where no GPU is present. $SPECFAST_CUDA_EMU_FLAGS adds compiler flags (the
hardening stage adds AddressSanitizer and UBSan: the kernels' memory checked as
compute-sanitizer's memcheck checks them).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import platform
import shlex
import shutil
import subprocess
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
EMU = ROOT / "tests" / "cuda_emu"
# What the library is built from; a change in any of them rebuilds it.
SOURCES = sorted([*(ROOT / "csrc" / "cuda").iterdir(), *(ROOT / "csrc" / "common").iterdir(),
                  ROOT / "csrc" / "include" / "specfast.h", *EMU.iterdir()])
# As cmake/cuda.cmake builds the real one: no contraction into fused multiply-adds.
FLAGS = ["-x", "c++", "-std=c++17", "-O2", "-pthread", "-ffp-contract=off",
         "-fvisibility=hidden", "-Wall", "-Wno-unknown-pragmas", "-Wno-unused-function"]


class Unavailable(Exception):
    """The emulated library cannot be built here (the reason is the message)."""


def build(source: pathlib.Path = ROOT / "csrc" / "cuda" / "kernels.cu",
          extra: tuple = ("-fPIC", "-shared")) -> pathlib.Path:
    """The path of `source` built (a shared library, or what `extra` makes of it),
    compiled when its sources changed."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise Unavailable(f"the emulator's fibers need x86-64, not {platform.machine()}")
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise Unavailable(f"no C++ compiler {cxx!r}")
    sanitizers = [] if "-fsanitize=thread" in extra else shlex.split(
        os.environ.get("SPECFAST_CUDA_EMU_FLAGS", ""))  # one sanitizer at a time
    flags = [*FLAGS, *extra, *sanitizers]
    h = hashlib.sha256(" ".join([cxx, *flags, source.name]).encode())
    for f in SOURCES:
        h.update(f.name.encode() + f.read_bytes())
    out = pathlib.Path(tempfile.gettempdir()) / f"specfast-cuda-emu-{h.hexdigest()[:16]}"
    lib = out / (f"lib{source.stem}.so" if "-shared" in extra else source.stem)
    if lib.exists():
        return lib
    out.mkdir(exist_ok=True)
    tmp = out / f"build-{os.getpid()}"
    cmd = [cxx, *flags, f"-I{EMU}", f"-I{ROOT / 'csrc' / 'include'}",
           f"-I{ROOT / 'csrc' / 'cuda'}", str(source), "-o", str(tmp)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"building {source.name} for the CUDA emulator failed:\n{r.stderr}")
    os.replace(tmp, lib)  # atomic: a concurrent build leaves one whole library
    return lib


def load():
    """The emulated CUDA backend, opened as ``specfast._cuda.lib()`` opens the real one."""
    from specfast import _cuda
    from specfast._lib import open_library

    def missing(path, exc):
        return RuntimeError(f"cannot open the emulated CUDA library {path}: {exc}")

    return open_library(_cuda.ffi, str(build()), "sf_cuda_version", missing)


SELFTEST_CDEF = """
int sf_emu_selftest(const char *name, unsigned blocks, unsigned threads, unsigned cluster,
                    size_t shm, int *out, char *message, size_t message_size);
uint64_t sf_emu_fixed_mismatches(void);
int sf_emu_max_bound(int dtype, const void *logits, int64_t rows, int64_t n, unsigned cluster,
                     float c, float *mx, int *bad, double *bound);
int sf_emu_exp2_up_range(double *lo, double *hi);
"""


def selftest():
    """``run(name, blocks, threads=256, cluster=1, shm=0)``: runs a kernel of
    tests/cuda_emu/selftest.cu, returning its (cudaError_t, message, out[]);
    ``run.fixed_mismatches()`` counts the floats where the kernels' fixed point
    differs from the CPU's; ``run.max_bound(rows, dtype, cluster, c)`` gives each
    row's (max, bad, bound of its mass) as sf_verify finds them, `rows` 2-D of
    float32 / float16, or of uint16 holding bfloat16 (dtype "bfloat16");
    ``run.exp2_up_range()`` the (least, largest) ratio of the kernels' bound of
    2^y to 2^y over every float y in [-126, 0], and whether -inf and NaN count
    as -126."""
    import cffi
    import numpy as np

    ffi = cffi.FFI()
    ffi.cdef(SELFTEST_CDEF)
    lib = ffi.dlopen(str(build(EMU / "selftest.cu")))

    def run(name, blocks, threads=256, cluster=1, shm=0):
        out = np.full(2 * blocks * threads, -1, np.int32)
        msg = ffi.new("char[]", 4096)
        e = lib.sf_emu_selftest(name.encode(), blocks, threads, cluster, shm,
                                ffi.cast("int *", out.ctypes.data), msg, 4096)
        return e, ffi.string(msg).decode(), out

    def max_bound(rows, dtype, cluster, c):
        rows = np.ascontiguousarray(rows)
        code = {"float32": 0, "float16": 1, "bfloat16": 2}[dtype]
        mx = np.zeros(len(rows), np.float32)
        bad = np.zeros(len(rows), np.int32)
        bound = np.zeros(len(rows), np.float64)
        e = lib.sf_emu_max_bound(code, ffi.cast("void *", rows.ctypes.data), len(rows),
                                 rows.shape[1], cluster, c,
                                 ffi.cast("float *", mx.ctypes.data),
                                 ffi.cast("int *", bad.ctypes.data),
                                 ffi.cast("double *", bound.ctypes.data))
        assert e == 0, f"launch failed: cudaError_t {e}"
        return mx, bad, bound

    def exp2_up_range():
        lo, hi = ffi.new("double *"), ffi.new("double *")
        specials = lib.sf_emu_exp2_up_range(lo, hi)
        return lo[0], hi[0], bool(specials)

    run.fixed_mismatches = lib.sf_emu_fixed_mismatches
    run.max_bound = max_bound
    run.exp2_up_range = exp2_up_range
    return run


def race_check() -> pathlib.Path:
    """tests/cuda_emu/race_check.cc (the kernels on random batches) built with
    ThreadSanitizer: an executable; raises Unavailable where TSan is missing."""
    try:
        return build(EMU / "race_check.cc", ("-O1", "-g", "-fsanitize=thread"))
    except RuntimeError as exc:
        if "tsan" in str(exc).lower():
            raise Unavailable(f"no ThreadSanitizer: {exc}") from None
        raise
