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
