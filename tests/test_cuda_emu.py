"""The CUDA emulator (tests/cuda_emu) that test_cuda.py runs the kernels on without
a GPU: what it models must hold as on a GPU, and what would be undefined there
(barriers and shuffles in divergent code, another block's shared memory read after
it exited) must fail the launch with a message, not hang or pass."""

import os
import re
import subprocess

import numpy as np
import pytest

import cuda_emu

try:
    run = cuda_emu.selftest()
except cuda_emu.Unavailable as exc:  # pragma: no cover
    pytest.skip(f"no emulator here: {exc}", allow_module_level=True)

ORDERS = ["forward", "reverse", "12345"]


@pytest.fixture(params=ORDERS, autouse=True)
def order(request, monkeypatch):
    monkeypatch.setenv("SPECFAST_CUDA_EMU_ORDER", request.param)


def test_shuffles():
    e, msg, out = run("shuffle", 3, 96)
    assert e == 0, msg
    t = np.arange(3 * 96)
    np.testing.assert_array_equal(out[0::2], (t & ~31) | ((t & 31) ^ 5))
    lane = t & 31
    np.testing.assert_array_equal(out[1::2], lane * (t - lane) + lane * (lane + 1) // 2 + (t - lane))


def test_shared_memory_is_per_block():
    e, msg, out = run("shared", 5)
    assert e == 0, msg
    np.testing.assert_array_equal(out[: 5 * 256], np.repeat(np.arange(5), 256))


def test_syncthreads_or():
    e, msg, out = run("or", 3)
    assert e == 0, msg
    np.testing.assert_array_equal(out[0::2], np.repeat([0, 1, 0], 256))
    np.testing.assert_array_equal(out[1::2], np.repeat([0, 0, 1], 256))


def test_shared_memory_starts_unset_in_every_block():
    for _ in range(2):  # a second launch sees nothing of the first either
        e, msg, out = run("stale", 6)
        assert e == 0, msg
        assert (out[: 6 * 256] == -1).all()


@pytest.mark.parametrize("cluster", [1, 2, 8])
def test_cluster_reads_each_blocks_shared_memory(cluster):
    blocks = 2 * cluster
    e, msg, out = run("cluster", blocks, 64, cluster)
    assert e == 0, msg
    b = np.arange(blocks)
    first = b - b % cluster  # blockIdx of rank 0
    ranks = np.arange(cluster)
    want = 1000 * ranks.sum() + cluster * first + ranks.sum()
    np.testing.assert_array_equal(out[: blocks * 64], np.repeat(want, 64))


def test_dynamic_shared_memory_starts_unset():
    e, msg, out = run("dynamic", 2, 64, shm=1024)
    assert e == 0, msg
    assert (out[: 2 * 64] == 0xFF).all()


def test_fixed_point_matches_the_cpu_on_every_float():
    if os.environ["SPECFAST_CUDA_EMU_ORDER"] != "forward":
        pytest.skip("arithmetic: one thread order is enough")
    assert run.fixed_mismatches() == 0


def test_the_kernels_bound_of_exp2_is_above_it_within_the_chord_on_every_float():
    if os.environ["SPECFAST_CUDA_EMU_ORDER"] != "forward":
        pytest.skip("arithmetic: one thread order is enough")
    lo, hi, specials = run.exp2_up_range()
    assert 1.0 <= lo and hi <= 1.0615 * (1 + 2**-14)  # the chord's worst, 2^-15 in y more
    assert specials


def test_launch_limits():
    e, msg, _ = run("shared", 3, cluster=2)
    assert e != 0 and "does not divide the grid" in msg
    e, msg, _ = run("dynamic", 1, shm=64 * 1024)
    assert e != 0 and "granted" in msg


@pytest.mark.parametrize("kernel, message", [
    ("barrier_in_branch", r"threads 0-99 at __syncthreads \(selftest.cu:\d+\), "
                          r"threads 100-255 at __syncthreads \(selftest.cu:\d+\)"),
    ("shuffle_in_branch", r"different barriers: .*at a shuffle.*returned"),
    ("read_exited_block", r"map_shared_rank to block rank 1, which is not running"),
])
def test_undefined_behaviour_fails_the_launch(kernel, message):
    e, msg, _ = run(kernel, 2, cluster=2 if kernel == "read_exited_block" else 1)
    assert e != 0
    assert re.search(message, msg), msg


@pytest.fixture(scope="module")
def race_check():
    if os.environ.get("SPECFAST_CUDA_EMU_FLAGS"):
        pytest.skip("the race check runs once, in the suite without sanitizers")
    try:
        return cuda_emu.race_check()
    except cuda_emu.Unavailable as exc:  # pragma: no cover
        pytest.skip(str(exc))


def _tsan(exe, *args):
    env = {**os.environ, "TSAN_OPTIONS": "halt_on_error=0"}
    env.pop("LD_PRELOAD", None)  # the sanitized stage's ASan is not for this program
    return subprocess.run([str(exe), *args], capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.parametrize("order", ["forward"], indirect=True)
def test_thread_sanitizer_sees_a_race(race_check):
    r = _tsan(race_check, "control")
    assert "WARNING: ThreadSanitizer: data race" in r.stderr, r.stderr[-2000:]
    assert "race_check.cc" in r.stderr


@pytest.mark.parametrize("order", ["forward"], indirect=True)
def test_kernels_have_no_race(race_check):
    """Every method, dtype and draft kind, chains and trees, clusters of 1, 3 and 8
    blocks, under ThreadSanitizer, which the emulator tells that barriers alone
    order a launch's threads (compute-sanitizer's racecheck, for all memory)."""
    r = _tsan(race_check, "7", "1000", "4099", "17000")
    races = r.stderr.count("WARNING: ThreadSanitizer")
    assert r.returncode == 0 and races == 0, r.stderr[-4000:] + r.stdout
    assert "0 launches failed" in r.stdout


def _rows_of(dtype, x):
    """x (float32) in `dtype` for the kernel, and the exact values it holds."""
    if dtype == "float32":
        return x, x.astype(np.float64)
    if dtype == "float16":
        with np.errstate(over="ignore"):  # beyond float16: +-inf, as such a row holds
            h = x.astype(np.float16)
        return h, h.astype(np.float64)
    b = x.view(np.uint32)
    u = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)  # to nearest, even
    u = np.where(np.isnan(x), np.uint16(0x7FC0), u)
    return u, (u.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("n, cluster", [(1, 1), (37, 1), (6151, 3), (20000, 8), (151936, 8)])
def test_the_bound_verify_accepts_on_is_a_tight_upper_bound_of_the_mass(dtype, n, cluster):
    """sf_verify accepts a draft token without summing the row's mass where a
    bound of that mass already decides it: the bound must never be below the
    mass (that would accept what the CPU rejects), and near it (within the
    chord's 6.2%) for the shortcut to pay."""
    if os.environ["SPECFAST_CUDA_EMU_ORDER"] != "12345":
        pytest.skip("arithmetic: one thread order is enough")
    rng = np.random.default_rng(n * 7 + cluster)
    big = 60000.0 if dtype == "float16" else 3e5
    rows = [rng.normal(0, 3, n), rng.normal(0, 3, n) + big, rng.normal(0, 3, n) - big,
            np.full(n, 1.5), rng.normal(0, 0.01, n), rng.uniform(-200, 0, n)]
    peaked = rng.normal(0, 1, n)
    peaked[rng.integers(n)] = 40.0
    rows.append(peaked)
    masked = np.where(rng.random(n) < 0.9, -np.inf, rng.normal(0, 3, n))
    masked[rng.integers(n)] = 2.0
    rows.append(masked)
    far = rng.normal(0, 3, n) - 3e7  # threads whose own max * c is below -2^24 (f16: -inf)
    far[rng.integers(n)] = 1.0
    rows.append(far)
    x = np.stack(rows).astype(np.float32)
    data, exact = _rows_of(dtype, x)
    for t in [1.0, 0.7, 0.05, 4.0, 5000.0]:
        c = np.float32(np.float32(1 / t) * np.float32(np.log2(np.e)))
        mx, bad, bound = run.max_bound(data, dtype, cluster, float(c))
        np.testing.assert_array_equal(mx, exact.max(axis=1).astype(np.float32))
        assert not bad.any()
        m = mx.astype(np.float64)[:, None]
        mass = np.exp2((exact - m) * float(c)).sum(axis=1)
        assert (bound >= mass * (1 - 1e-5)).all(), (t, bound / mass)
        assert (bound <= mass * 1.07).all(), (t, bound / mass)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_bound_where_none_is_worth_giving_or_the_row_is_bad(dtype):
    if os.environ["SPECFAST_CUDA_EMU_ORDER"] != "12345":
        pytest.skip("arithmetic: one thread order is enough")
    n = 5000
    rng = np.random.default_rng(3)
    nan, inf, huge, masked, low = (rng.normal(0, 3, n) for _ in range(5))
    nan[4321] = np.nan
    inf[17] = np.inf
    huge[99] = 1e30  # max * c far past 2^24: no bound, so the mass is summed
    masked[:] = -np.inf
    low -= 2e7  # max * c far below -2^24: none either
    data, exact = _rows_of(dtype, np.stack([nan, inf, huge, masked, low]).astype(np.float32))
    mx, bad, bound = run.max_bound(data, dtype, 3, 1.4426950)
    assert bad.tolist() == [1, 1, 0, 0, 0]
    assert mx[2] == exact[2].max() and bound[2] == np.inf
    assert mx[3] == -np.inf and bound[3] == np.inf
    assert mx[4] == exact[4].max() and bound[4] == np.inf
