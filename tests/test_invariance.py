"""Results do not depend on the number of threads nor on the SIMD level: bit for bit.

The SIMD level is chosen from SPECFAST_SIMD before the library loads, so each level runs in
its own subprocess (this file's __main__ writes the outputs of a fixed workload to .npz).
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
LEVELS = ["scalar", "avx2", "avx512"]


def workload():
    """A fixed workload touching every kernel: odd vocabularies (vector tails), every
    dtype, filters, tiny temperature, chains and trees, dense / sparse / no q, both methods.
    Returns {name: array}."""
    import specfast as sf
    from reference import BF16, call_verify, pack, random_request, to_dtype

    rng = np.random.default_rng(20240607)
    out = {}
    for vocab in [7, 111, 32000]:
        rows = 64 if vocab < 32000 else 8
        x = (rng.standard_normal((rows, vocab)) * 2.5 + 3).astype(np.float32)
        x[1, ::5] = -np.inf
        x[2, : vocab // 2] = x[2, vocab // 2 : 2 * (vocab // 2)]  # ties
        temps = np.resize([1.0, 0.7, 1e-3, 0.0, 2.0], rows).astype(np.float32)
        top_k = np.resize([0, 5, 0, 40], rows).astype(np.int32)
        top_p = np.resize([1.0, 0.9, 0.6], rows).astype(np.float32)
        min_p = np.resize([0.0, 0.0, 0.05], rows).astype(np.float32)
        for dtype in ["float32", "float16", "bfloat16"]:
            if dtype == "bfloat16" and BF16 is None:  # numpy bfloat16 needs ml_dtypes
                continue
            xl = to_dtype(x, dtype)
            tag = f"V{vocab}-{dtype}"
            f = dict(temperature=temps, top_k=top_k, top_p=top_p, min_p=min_p)
            out[f"probs-{tag}"] = sf.probs(xl, **f)
            out[f"probs-plain-{tag}"] = sf.probs(xl)
            pos = np.arange(rows) * 3
            for method in ["rejection", "coupled"]:
                out[f"sample-{method}-{tag}"] = sf.sample(
                    xl, **f, seed=5, position=pos, method=method
                )
    reqs = [random_request(rng, 203, 6, tree=bool(i % 2)) for i in range(600)]
    for kind in ["none", "dense", "sparse"]:
        args, kw = pack(reqs, kind)
        for method in ["rejection", "coupled"]:
            r = call_verify(args, kw, method=method)
            out[f"verify-{kind}-{method}-tokens"] = np.asarray(r.tokens)
            out[f"verify-{kind}-{method}-nodes"] = np.asarray(r.accepted_nodes)
    return out


def run_level(level, tmp_path):
    path = tmp_path / f"{level}.npz"
    env = dict(os.environ, SPECFAST_SIMD=level)
    proc = subprocess.run(
        [sys.executable, __file__, str(path)], env=env, capture_output=True, text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"SPECFAST_SIMD={level} failed:\n{proc.stdout}\n{proc.stderr}"
    got = proc.stdout.strip().splitlines()[-1]
    return got, dict(np.load(path))


@pytest.fixture(scope="module")
def scalar_outputs(tmp_path_factory):
    got, data = run_level("scalar", tmp_path_factory.mktemp("simd"))
    assert got == "scalar"
    return data


@pytest.mark.parametrize("level", LEVELS[1:])
def test_simd_level_agrees_with_scalar_bit_for_bit(level, scalar_outputs, tmp_path):
    """Each vector level against the portable path; a level this CPU lacks is a skip
    that says so (its kernels are then untested here)."""
    got, data = run_level(level, tmp_path)
    assert got in LEVELS, f"simd_level() = {got!r}"
    # the variable may only lower the level
    assert LEVELS.index(got) <= LEVELS.index(level), f"asked {level}, got {got}"
    if got != level:
        pytest.skip(f"this CPU lacks {level} (it runs {got}): {level} kernels untested")
    assert data.keys() == scalar_outputs.keys()
    for k in data:
        np.testing.assert_array_equal(data[k], scalar_outputs[k],
                                      err_msg=f"{k}: {level} differs from scalar")


def test_unknown_simd_level_is_said():
    env = dict(os.environ, SPECFAST_SIMD="AVX2")
    proc = subprocess.run([sys.executable, "-c", "import specfast"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "SPECFAST_SIMD='AVX2' is not" in proc.stderr


def best_simd_level(flags, machine, env):
    """The level csrc/cpu/dispatch.c picks: avx512 needs avx512f, bw, dq and vl;
    avx2 needs avx2 and f16c; SPECFAST_SIMD (scalar, avx2) may only lower it; a
    build for another architecture has the scalar kernels only."""
    if machine not in ("x86_64", "AMD64", "amd64"):
        return "scalar"
    level = 0
    if {"avx2", "f16c"} <= flags:
        level = 1
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        level = 2
    want = env.get("SPECFAST_SIMD")
    if want == "scalar":
        level = 0
    if want == "avx2" and level > 1:
        level = 1
    return LEVELS[level]


def test_best_simd_level_mirrors_dispatch():
    x86 = "x86_64"
    avx512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl"}
    assert best_simd_level(set(), x86, {}) == "scalar"
    assert best_simd_level({"avx2"}, x86, {}) == "scalar"  # no F16C
    assert best_simd_level({"avx2", "f16c"}, x86, {}) == "avx2"
    assert best_simd_level(avx512 - {"avx512vl"} | {"avx2", "f16c"}, x86, {}) == "avx2"
    assert best_simd_level(avx512, x86, {}) == "avx512"  # dispatch.c asks no more
    assert best_simd_level(avx512, x86, {"SPECFAST_SIMD": "avx2"}) == "avx2"
    assert best_simd_level({"avx2", "f16c"}, x86, {"SPECFAST_SIMD": "avx512"}) == "avx2"
    assert best_simd_level(avx512, x86, {"SPECFAST_SIMD": "scalar"}) == "scalar"
    assert best_simd_level(avx512, "aarch64", {}) == "scalar"


def test_default_simd_level_is_the_best_available():
    """The level in use is the one the CPU's flags (/proc/cpuinfo) allow, lowered
    only by SPECFAST_SIMD as this process has it."""
    import platform

    import specfast as sf

    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo to read the CPU's flags from")
    flags = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags = set(value.split())
            break
    assert sf.simd_level() == best_simd_level(flags, platform.machine(), os.environ), flags


@pytest.mark.usefixtures("restore_threads")
def test_thread_count_invariance():
    import specfast as sf

    outs = []
    for n in [1, 2, 4, 3]:
        sf.set_num_threads(n)
        assert sf.get_num_threads() == n
        outs.append(workload())
    for n, o in zip([2, 4, 3], outs[1:]):
        for k in outs[0]:
            np.testing.assert_array_equal(o[k], outs[0][k], err_msg=f"{k}: {n} threads vs 1")


@pytest.mark.usefixtures("restore_threads")
@pytest.mark.parametrize("vocab", [16384, 40003, 151936])
def test_a_lone_row_split_across_threads_keeps_its_result(vocab):
    """Coupled sampling of a lone row (sample of one row, verify of one request) runs
    its race in parts on every thread from this vocabulary on, and probs scales its
    row in parts; the token must be the one a single thread finds, the probabilities
    the same bits. Rows are flat enough that most of the race is drawn (Gaussian at
    scale 0.5 and temperature 2: tokens far from the top win), peaked ones, filtered
    ones, integer rows full of ties; 40 seeds each, one or three tokens each of 1 to 3
    accepted drafts deep."""
    import specfast as sf

    rng = np.random.default_rng(vocab)
    rows = [rng.standard_normal(vocab) * s for s in (0.5, 3.0)] + [
        np.round(rng.standard_normal(vocab) * 2)]
    cases = [(x.astype(np.float32), f) for x in rows for f in (
        dict(temperature=2.0), dict(temperature=1.0),
        dict(temperature=1.5, top_k=vocab // 3), dict(top_p=0.95), dict(min_p=0.01))]

    def run():
        out = [sf.probs(x[None], **f).tobytes() for x, f in cases]
        for x, f in cases:
            for seed in range(40):
                t = sf.sample(x[None], seed=seed, position=5, method="coupled", **f)
                logits = np.stack([x, x[::-1], x, x[::7].repeat(7)[:vocab]])
                chain = sf.sample(logits, seed=seed, position=np.arange(9, 13),
                                  method="coupled", **f)[:3]
                r = sf.verify(logits, chain, [3], seed=seed, position=9, method="coupled", **f)
                out.append((int(t[0]), r.num_accepted.tolist(), r.tokens.tolist()))
        return out

    sf.set_num_threads(1)
    alone = run()
    for n in (2, 3):
        sf.set_num_threads(n)
        assert run() == alone, f"{n} threads"
    assert len({t[0] for t in alone[len(cases):]}) > 20  # the noise, not the max, chose


@pytest.mark.usefixtures("restore_threads")
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_lone_greedy_row_split_across_threads_takes_the_first_max(threads):
    """Greedy over a lone wide row reads it in parts on every thread: the token is the
    first largest logit wherever the parts fall (the max at either end, tied across
    parts, -inf everywhere but one token), and a NaN in any part is an error."""
    import specfast as sf

    sf.set_num_threads(threads)
    rng = np.random.default_rng(threads)
    for vocab in (40003, 151936):
        x = rng.standard_normal(vocab).astype(np.float32)
        rows = []
        for at in (0, vocab - 1, vocab // 2, *rng.integers(0, vocab, 4)):
            r = x.copy()
            r[at] = 9.0
            rows.append(r)
        tied = x.copy()
        tied[[vocab - 5, vocab // 3, 2 * vocab // 3]] = 9.0
        lone = np.full(vocab, -np.inf, np.float32)
        lone[vocab - 2] = 0.0
        for r in rows + [tied, lone]:
            want = int(np.argmax(r))
            assert int(sf.sample(r[None], temperature=0.0)[0]) == want
            res = sf.verify(np.stack([r, r]), [want], [1], temperature=0.0)
            assert res.num_accepted.tolist() == [1] and res.tokens[0].tolist() == [want, want]
        bad = x.copy()
        bad[vocab - 3] = np.nan
        with pytest.raises(ValueError, match="NaN"):
            sf.sample(bad[None], temperature=0.0)


@pytest.mark.usefixtures("restore_threads")
def test_set_num_threads_arguments():
    import specfast as sf

    sf.set_num_threads(0)  # one per core
    assert sf.get_num_threads() >= 1
    with pytest.raises((ValueError, TypeError)):
        sf.set_num_threads(-1)


@pytest.mark.usefixtures("restore_threads")
def test_get_num_threads_does_not_wait_for_a_call():
    """The thread count is read without waiting for another thread's call (it took
    the lock those calls hold, so a status line waited on a long call)."""
    import threading
    import time

    import specfast as sf

    sf.set_num_threads(2)
    x = np.random.default_rng(0).standard_normal((256, 151936)).astype(np.float32)
    t0 = time.perf_counter()
    sf.sample(x, seed=1, top_p=0.9)
    alone = time.perf_counter() - t0
    other = threading.Thread(target=lambda: [sf.sample(x, seed=1, top_p=0.9) for _ in range(3)])
    other.start()
    time.sleep(alone / 2)
    t0 = time.perf_counter()
    n = sf.get_num_threads()
    waited = time.perf_counter() - t0
    other.join()
    assert n == 2 and waited < alone / 2, (waited, alone)


def test_a_pool_that_cannot_start_says_one_thread():
    """Where the workers cannot start (no memory for their stacks), calls run on the
    caller alone with the same tokens, and get_num_threads says 1 (it said the size
    that failed)."""
    import subprocess
    import sys

    code = """if True:
        import os, resource, numpy as np, specfast
        x = np.random.default_rng(0).standard_normal((4, 1000)).astype(np.float32)
        tokens, nd = np.array([1, 2], np.int32), np.array([1, 1], np.int32)
        # the pool (one thread per core) starts at the first call, after the limit
        vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + 4 * 2**20, resource.RLIM_INFINITY))
        got = [specfast.verify(x, tokens, nd, seed=3).tokens for _ in range(20)]
        n = specfast.get_num_threads()
        specfast.set_num_threads(1)
        want = specfast.verify(x, tokens, nd, seed=3).tokens
        print(n, all((g == want).all() for g in got), len(os.listdir("/proc/self/task")))
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    n, same, _ = r.stdout.split()
    assert n == "1" and same == "True"


@pytest.mark.usefixtures("restore_threads")
def test_concurrent_calls_from_python_threads():
    """Calls from several Python threads at once (they share one pool) give the results a
    lone call gives."""
    from concurrent.futures import ThreadPoolExecutor

    import specfast as sf
    from reference import call_verify, pack, random_request

    sf.set_num_threads(2)
    rng = np.random.default_rng(3)
    batches = [pack([random_request(rng, 50, 5) for _ in range(300)], "dense") for _ in range(6)]
    alone = [np.asarray(call_verify(a, k).tokens) for a, k in batches]
    with ThreadPoolExecutor(6) as ex:
        together = list(ex.map(lambda ak: np.asarray(call_verify(*ak).tokens), batches * 3))
    for i, t in enumerate(together):
        np.testing.assert_array_equal(t, alone[i % 6])


def test_a_call_inside_another_on_the_same_thread(monkeypatch):
    """A signal handler or __del__ may call specfast between another call's packing of
    its parameters and its C call: each keeps its own (the inner call overwrote the
    outer's reused C structs, and verify ran greedy with the inner's seed)."""
    import specfast as sf
    from specfast import _api

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 2000)).astype(np.float32)
    toks = np.argsort(-logits[0])[:4].astype(np.int32)
    nd = np.array([4], np.int32)
    kw = dict(temperature=1.0, seed=123, position=7)
    refs = {s: sf.verify(logits, toks, nd, **dict(kw, seed=s)).tokens for s in range(123, 143)}
    small = np.zeros((1, 10), np.float32)
    inner = []
    real = _api._c_logits

    def interrupted(*args):
        monkeypatch.setattr(_api, "_c_logits", real)  # the inner call runs through
        inner.append(sf.sample(small, temperature=0.0, seed=999, position=0)[0])
        monkeypatch.setattr(_api, "_c_logits", interrupted)
        return real(*args)

    probs_ref = sf.probs(logits[:1], temperature=0.5)
    monkeypatch.setattr(_api, "_c_logits", interrupted)
    for s in range(123, 143):
        np.testing.assert_array_equal(sf.verify(logits, toks, nd, **dict(kw, seed=s)).tokens,
                                      refs[s])
        np.testing.assert_array_equal(sf.probs(logits[:1], temperature=0.5), probs_ref)
    assert inner and all(t == 0 for t in inner)


def run_python(code, timeout=60):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout)


def test_exit_with_a_large_pool_running():
    """cffi unloads the library at interpreter exit while the workers still spin or
    wake: they faulted in unmapped code (exit status 139 in most runs at 256 threads)."""
    code = ("import numpy as np, specfast\n"
            "specfast.set_num_threads(256)\n"
            "x = np.zeros((1, 151936), np.float32)\n"
            "for s in range(3): specfast.sample(x, seed=s)\n")
    for _ in range(4):
        proc = run_python(code)
        assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])


def test_a_pool_that_cannot_start_keeps_the_setting_in_force():
    """Threads that cannot start (no address space for their stacks): set_num_threads
    raises, and the setting before it stays in force (it stayed at the failed count,
    and every later call raised)."""
    code = """if True:
        import resource, numpy as np, specfast
        x = np.random.default_rng(0).standard_normal((4, 1000)).astype(np.float32)
        specfast.set_num_threads(2)
        ref = specfast.sample(x, seed=1)
        vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + 64 * 2**20, resource.RLIM_INFINITY))
        try:
            specfast.set_num_threads(256)
        except RuntimeError as e:
            print("refused:", e)
        assert specfast.get_num_threads() == 2, specfast.get_num_threads()
        assert (specfast.sample(x, seed=1) == ref).all()
        r = specfast.verify(x, np.array([1, 2, 3], np.int32), np.array([3], np.int32), seed=1)
        print("ok", r.num_accepted[0])
        """
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "refused: specfast.set_num_threads" in proc.stdout and "ok" in proc.stdout


def _cpu_cgroup():
    """A new cgroup v1 cpu folder to run a process in, or None where none can be made."""
    base = Path("/sys/fs/cgroup/cpu")
    if not (base / "cpu.cfs_quota_us").exists():
        return None
    path = base / f"specfast-test-{os.getpid()}"
    try:
        path.mkdir()
    except OSError:
        return None
    return path


def test_default_threads_follow_a_cpu_quota():
    """A container's CPU limit (docker --cpus 0.5: a cgroup quota) leaves every host
    core in the affinity; the pool started a thread per core, spinning against the
    quota. The default now takes the quota, rounded up; an explicit count stays."""
    group = _cpu_cgroup()
    if group is None:
        pytest.skip("no cgroup v1 cpu folder can be made here (needs root)")
    code = ("import specfast; n = specfast.get_num_threads(); specfast.set_num_threads(3); "
            "print(n, specfast.get_num_threads())")
    try:
        def run_in(quota):
            (group / "cpu.cfs_quota_us").write_text(str(quota))
            proc = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())))
            assert proc.returncode == 0, proc.stderr
            return [int(v) for v in proc.stdout.split()]

        cores = len(os.sched_getaffinity(0))
        try:
            unlimited = run_in(-1)
        except (OSError, subprocess.SubprocessError) as exc:  # cannot move a process there
            pytest.skip(f"cannot run a process in a new cgroup: {exc}")
        assert unlimited == [min(cores, 256), 3]
        assert run_in(50000) == [1, 3]  # half a core of the 100 ms period
        if cores > 2:
            assert run_in(150000) == [2, 3]
    finally:
        group.rmdir()


def _pool_tasks():
    return set(os.listdir("/proc/self/task"))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
@pytest.mark.usefixtures("restore_threads")
def test_workers_take_the_process_cores_and_block_signals():
    """The default count is the process's cores whichever thread asks (a caller pinned
    to one core made it 1, and two differently pinned callers restarted the pool in
    turn); workers started by a pinned thread run on the process's cores, and keep
    signals blocked for the application's threads (a SIGUSR1 meant for sigwait killed
    the process)."""
    import threading

    import specfast as sf

    def field(task, name):
        return open(f"/proc/self/task/{task}/status").read().split(name + ":")[1].split()[0]

    cores = os.sched_getaffinity(0)
    x = np.zeros((64, 1000), np.float32)
    seen = {}

    def pinned():
        os.sched_setaffinity(0, {min(cores)})
        seen["default"] = sf.get_num_threads()
        before = _pool_tasks()
        sf.set_num_threads(3)
        seen["workers"] = {w: (field(w, "Cpus_allowed_list"), int(field(w, "SigBlk"), 16))
                           for w in _pool_tasks() - before}

    sf.set_num_threads(0)
    sf.sample(x)
    t = threading.Thread(target=pinned)
    t.start()
    t.join()
    assert seen["default"] == len(cores)
    assert len(seen["workers"]) == 2
    for allowed, blocked in seen["workers"].values():
        assert allowed == field(os.getpid(), "Cpus_allowed_list")
        assert blocked >> 9 & 1 and blocked >> 1 & 1, hex(blocked)  # SIGUSR1, SIGINT
    sf.set_num_threads(0)
    sf.sample(x)
    before = _pool_tasks()
    t = threading.Thread(target=lambda: (os.sched_setaffinity(0, {min(cores)}), sf.sample(x)))
    t.start()
    t.join()
    # The pool did not restart for the pinned caller. (The caller's own task can
    # outlive join() for a moment, slower under the sanitizers: left out.)
    assert _pool_tasks() - {str(t.native_id)} == before


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    import specfast

    np.savez(sys.argv[1], **workload())
    print(specfast.simd_level())
