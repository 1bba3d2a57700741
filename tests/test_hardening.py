"""Hardening: concurrency, fork, size limits, memory and numerical edge cases.

- Concurrency: 16 Python threads x 1000 calls of verify / sample / probs, on
  inputs shared by every thread and on each thread's own copies, give results
  identical to serial calls (the C calls release the GIL and share one pool).
- Fork: the pool survives fork (multiprocessing "fork" workers, and forks
  taken while another thread is inside a call).
- Races on inputs: an array written by another thread during a call never
  crashes it.
- Limits: vocab 262144 and SF_MAX_VOCAB = 2^24 - 2^15, batch 4096, trees of 256
  nodes, chains of 64, SF_MAX_DRAFT = 1024 nodes per request; past a limit a
  ValueError, never a MemoryError; scratch memory stops growing once warm.
- Numerical edge cases, as the docstrings define them: ties go to the lowest
  id; tiny temperatures behave greedily; top-p keeping one token; -inf bans a
  token and an all -inf row is an error; a drafted token of draft probability
  0 is rejected.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import specfast as sf
from specfast._api import _MAX_VOCAB
from reference import (TOLERANCES, check_structure, ref_probs_row, request_slices,
                       simulate_coupled)

# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def random_tree(rng, n):
    """Parents of a random tree of n nodes (each node's parent precedes it)."""
    return np.array([rng.integers(-1, i) if i else -1 for i in range(n)], np.int32)


def greedy_reference(logits, draft_tokens, num_draft, parents):
    """verify(temperature=0) by hand: accept the first child equal to the row's argmax."""
    rows, nodes = request_slices(num_draft)
    out = []
    for b, nd in enumerate(np.asarray(num_draft)):
        r0, n0 = int(rows[b]), int(nodes[b])
        row_tokens = np.argmax(logits[r0:r0 + nd + 1], axis=1)
        par = (np.arange(nd) - 1) if parents is None else parents[n0:n0 + nd]
        out.append(simulate_coupled(row_tokens, par, draft_tokens[n0:n0 + nd]))
    return out


def assert_matches_greedy(result, logits, draft_tokens, num_draft, parents=None):
    for b, (emitted, path) in enumerate(greedy_reference(logits, draft_tokens, num_draft,
                                                         parents)):
        na = int(result.num_accepted[b])
        assert na == len(path), (b, na, path)
        assert list(result.tokens[b, :na + 1]) == emitted, b
        assert list(result.accepted_nodes[b, :na]) == path, b


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# --------------------------------------------------------------------------------------
# concurrency
# --------------------------------------------------------------------------------------


def _cases(rng):
    """Small calls of every kind: (name, function, positional args, keyword args)."""
    cases = []
    V = 97
    nd = np.array([3, 0, 5, 2], np.int32)
    n = int(nd.sum())
    logits = rng.standard_normal((n + nd.size, V)).astype(np.float32) * 2
    toks = rng.integers(0, V, n).astype(np.int32)
    # make some drafts acceptable
    rows, nodes = request_slices(nd)
    for b in range(nd.size):
        for i in range(nd[b]):
            if rng.random() < 0.6:
                toks[nodes[b] + i] = np.argmax(logits[rows[b] + i])
    parents = np.concatenate([random_tree(rng, k) for k in nd]).astype(np.int32)
    q = rng.random((n, V)).astype(np.float32)
    q /= q.sum(axis=1, keepdims=True)
    ids = np.stack([np.concatenate([[t], (t + 1 + np.arange(3)) % V]) for t in toks])
    vals = np.tile(np.array([0.4, 0.3, 0.2, 0.1], np.float32), (n, 1))
    seeds = np.arange(nd.size, dtype=np.uint64) + 11
    common = dict(seed=seeds, position=np.array([5, 0, 9, 2**40]))
    cases += [
        ("verify chain", sf.verify, (logits, toks, nd), dict(common)),
        ("verify tree dense", sf.verify, (logits, toks, nd),
         dict(common, parents=parents, draft_probs=q, top_k=20, top_p=0.9)),
        ("verify tree sparse", sf.verify, (logits, toks, nd),
         dict(common, parents=parents, draft_probs=sf.SparseProbs(ids, vals), min_p=0.05)),
        ("verify coupled", sf.verify, (logits, toks, nd),
         dict(common, parents=parents, method="coupled", temperature=0.8)),
        ("verify greedy", sf.verify, (logits, toks, nd), dict(common, temperature=0.0)),
    ]
    big = rng.standard_normal((6, 4096)).astype(np.float16)
    cases += [
        ("sample", sf.sample, (logits,), dict(seed=3, position=np.arange(logits.shape[0]))),
        ("sample coupled f16", sf.sample, (big,), dict(seed=4, method="coupled", top_p=0.9)),
        ("sample top_k", sf.sample, (big,), dict(seed=5, top_k=7, temperature=1.3)),
        ("probs", sf.probs, (logits,), dict(top_k=10, top_p=0.8)),
        ("probs f16", sf.probs, (big,), dict(min_p=0.1)),
    ]
    return cases


def _copy_args(args, kw):
    def c(x):
        if isinstance(x, np.ndarray):
            return x.copy()
        if isinstance(x, sf.SparseProbs):
            return sf.SparseProbs(x.indices.copy(), x.values.copy())
        return x
    return tuple(c(a) for a in args), {k: c(v) for k, v in kw.items()}


def _as_tuple(r):
    return tuple(np.asarray(x) for x in r) if isinstance(r, tuple) else (np.asarray(r),)


def _stress(n_threads, n_calls, rng, toggle_threads=False):
    cases = _cases(rng)
    serial = [_as_tuple(f(*a, **k)) for _, f, a, k in cases]
    # separate inputs: every thread gets its own copies of every case
    own = [[_copy_args(a, k) for _, _, a, k in cases] for _ in range(n_threads)]
    errors = []
    barrier = threading.Barrier(n_threads + (1 if toggle_threads else 0))
    stop = threading.Event()

    def worker(t):
        try:
            barrier.wait()
            for i in range(n_calls):
                c = (t * 7 + i * 3) % len(cases)
                name, f, a, k = cases[c]
                if (i + t) % 2:
                    a, k = own[t][c]
                got = _as_tuple(f(*a, **k))
                for g, s in zip(got, serial[c]):
                    if not np.array_equal(g, s):
                        errors.append(f"thread {t} call {i} ({name}) differs from serial")
                        return
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"thread {t}: {exc!r}")

    def toggler():
        barrier.wait()
        k = 0
        while not stop.is_set():
            sf.set_num_threads(1 + k % 4)
            k += 1
            time.sleep(0.001)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    tog = threading.Thread(target=toggler) if toggle_threads else None
    for th in threads + ([tog] if tog else []):
        th.start()
    for th in threads:
        th.join(timeout=300)
    stop.set()
    if tog:
        tog.join()
    assert not any(th.is_alive() for th in threads), "a thread hung"
    assert not errors, errors[:5]


def test_stress_16_threads_x_1000_calls_match_serial(rng, restore_threads):
    """The bar: 16 threads x 1000 mixed calls, shared and own inputs, all equal to serial."""
    sf.set_num_threads(2)
    t0 = time.perf_counter()
    _stress(16, 1000, rng)
    assert time.perf_counter() - t0 < 120


def test_threads_while_pool_resizes(rng, restore_threads):
    """Results do not depend on the pool size, even when it changes between calls."""
    _stress(8, 150, rng, toggle_threads=True)


# --------------------------------------------------------------------------------------
# fork
# --------------------------------------------------------------------------------------


def _fork_job(seed):
    r = np.random.default_rng(seed)
    cases = _cases(r)
    return [[x.tolist() for x in _as_tuple(f(*a, **k))] for _, f, a, k in cases]


def test_pool_survives_multiprocessing_fork(restore_threads):
    sf.set_num_threads(4)
    want = {s: _fork_job(s) for s in (1, 2, 3)}  # the pool runs in the parent first
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(2) as pool:
        got = pool.map_async(_fork_job, [1, 2, 3, 1]).get(timeout=120)
    assert got == [want[1], want[2], want[3], want[1]]
    assert _fork_job(2) == want[2]  # and the parent's pool still works


def _wait_child(pid, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "hung"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_fork_while_another_thread_is_calling(rng, restore_threads):
    """fork() taken while a thread is inside the library: the child can still call."""
    sf.set_num_threads(3)
    lg = rng.standard_normal((64, 4096)).astype(np.float32)
    want = sf.sample(lg, seed=9, top_p=0.9)
    stop = threading.Event()

    def busy():
        while not stop.is_set():
            sf.sample(lg, seed=1, top_p=0.5)

    th = threading.Thread(target=busy)
    th.start()
    try:
        for _ in range(5):
            time.sleep(0.01)
            pid = os.fork()
            if pid == 0:  # child: one thread, a fresh pool
                code = 1
                try:
                    code = 0 if np.array_equal(sf.sample(lg, seed=9, top_p=0.9), want) else 3
                finally:
                    os._exit(code)
            assert _wait_child(pid, 60) == 0
    finally:
        stop.set()
        th.join()
    assert np.array_equal(sf.sample(lg, seed=9, top_p=0.9), want)


_RACE = """
import sys, threading, time
import numpy as np
import specfast as sf

L = np.zeros((4, 1000), np.float32)
toks, nd = np.array([1, 2, 3], np.int32), np.array([3], np.int32)
par = np.array([-1, 0, 1], np.int32)
arr, at, good, bad = {  # an int32 array passed as it is, a valid value, an invalid one
    "tokens": (toks, 0, 1, 2**31 - 1), "parents": (par, 2, 1, 2**30),
    "num_draft": (nd, 0, 3, 1000), "tree_mask": (par, 2, 1, 2**30)}[sys.argv[1]]
call = ((lambda: sf.tree_mask(par, nd)) if sys.argv[1] == "tree_mask"
        else (lambda: sf.verify(L, toks, nd, parents=par, seed=1)))
def writer():
    while True:
        arr[at] = bad
        arr[at] = good
threading.Thread(target=writer, daemon=True).start()
sys.setswitchinterval(1e-6)
t0, calls = time.time(), 0
while time.time() - t0 < 1.5:
    try:
        call()
    except ValueError:
        pass
    calls += 1
print(calls)
"""


@pytest.mark.parametrize("case", ["tokens", "parents", "num_draft", "tree_mask"])
def test_inputs_written_during_a_call_never_crash(case):
    """Another thread writes an input array while a call reads it (the call releases
    the GIL and takes int32 arrays as they are): each call checks and reads one copy,
    so it returns or raises ValueError. Before, a value changed after its check
    indexed past the row (verify) or the mask (tree_mask): exit 139 within 1 s."""
    r = subprocess.run([sys.executable, "-c", _RACE, case], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert int(r.stdout) > 100


# --------------------------------------------------------------------------------------
# limits
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_vocab_262144(rng, dtype):
    V = 262144
    x = (rng.standard_normal((3, V)) * 3).astype(dtype)
    x[1, rng.random(V) < 0.3] = -np.inf
    tol = TOLERANCES[dtype]
    for kw in (dict(), dict(top_k=50), dict(temperature=0.5, min_p=0.01)):
        p = sf.probs(x, **kw)
        for r in range(3):
            np.testing.assert_allclose(p[r], ref_probs_row(x[r], **kw), **tol)
    assert np.array_equal(sf.sample(x, temperature=0.0), np.argmax(x, axis=1))
    toks = sf.sample(x, seed=2, top_k=100)
    assert all(p_ > 0 for p_ in sf.probs(x, top_k=100)[np.arange(3), toks])
    # one request, two drafts: the argmax of its rows, so greedy accepts both
    d = np.argmax(x[:2], axis=1).astype(np.int32)
    r = sf.verify(x, d, np.array([2]), temperature=0.0)
    assert r.num_accepted[0] == 2 and list(r.tokens[0]) == [d[0], d[1], np.argmax(x[2])]


def test_vocab_max(rng):
    """SF_MAX_VOCAB = 2^24 - 2^15 tokens (a 32 MiB float16 row) works; one more is a
    ValueError."""
    V = _MAX_VOCAB
    x = np.zeros((1, V), np.float16)
    x[0, :: 1 << 12] = -np.inf
    hot = [5, V - 1, 1 << 23]
    x[0, hot] = [4.0, 6.0, 6.0]  # tie at the top: the lower id wins greedy
    assert sf.sample(x, temperature=0.0)[0] == 1 << 23
    p = sf.probs(x)
    assert abs(float(p.sum(dtype=np.float64)) - 1.0) < 1e-4
    z = (V - (V // 4096 - 1) - 3) + np.exp(4.0) + 2 * np.exp(6.0)  # 1 << 23 was banned
    np.testing.assert_allclose(p[0, hot], np.exp([4.0, 6.0, 6.0]) / z, rtol=1e-5)
    assert p[0, 0] == 0.0 and p[0, 4096] == 0.0
    assert p[0, sf.sample(x, seed=1)[0]] > 0
    assert sf.sample(x, seed=1, top_k=2, method="coupled")[0] in (V - 1, 1 << 23)
    r = sf.verify(np.concatenate([x, x]), np.array([1 << 23]), np.array([1]), temperature=0.0)
    assert r.num_accepted[0] == 1 and r.tokens[0, 1] == 1 << 23
    del p
    # Every token tied: the row's mass is V * 2^40, which must not wrap (at 2^24
    # tokens it was 2^64: probs were inf and sample drew token 0).
    x[:] = 0.0
    p = sf.probs(x)
    assert np.all(p == p[0, 0]) and abs(float(p.sum(dtype=np.float64)) - 1.0) < 1e-4
    assert len({int(sf.sample(x, seed=s)[0]) for s in range(8)}) == 8
    del p
    # A dense q of ones sums to V, not 1 (the CPU sees it from its float sums; the
    # limit keeps CUDA's exact fixed-point sum of it, V * 2^40, below 2^64).
    with pytest.raises(ValueError, match="draft prob"):
        sf.verify(np.zeros((2, V), np.float16), np.array([1]), np.array([1]),
                  draft_probs=np.ones((1, V), np.float32), top_p=1.0, seed=2)
    too_big = np.zeros((2, V + 1), np.float16)
    for call in (lambda: sf.probs(too_big), lambda: sf.sample(too_big),
                 lambda: sf.verify(too_big, np.array([0]), np.array([1]))):
        with pytest.raises(ValueError, match="vocab"):
            call()


def test_batch_4096(rng):
    V, B = 300, 4096
    nd = rng.integers(0, 5, B).astype(np.int32)
    n = int(nd.sum())
    x = (rng.standard_normal((n + B, V)) * 2).astype(np.float32)
    rows, nodes = request_slices(nd)
    toks = rng.integers(0, V, n).astype(np.int32)
    agree = rng.random(n) < 0.7
    for b in range(B):
        for i in range(nd[b]):
            if agree[nodes[b] + i]:
                toks[nodes[b] + i] = np.argmax(x[rows[b] + i])
    r = sf.verify(x, toks, nd, temperature=0.0)
    assert_matches_greedy(r, x, toks, nd)
    seeds = rng.integers(0, 2**63, B).astype(np.uint64)
    pos = rng.integers(0, 2**40, B)
    r = sf.verify(x, toks, nd, seed=seeds, position=pos, top_p=0.95)
    check_structure(r, toks, nd, None, V)
    for b in rng.choice(B, 20, replace=False):  # each request alone: the same result
        s = slice(rows[b], rows[b] + nd[b] + 1)
        one = sf.verify(x[s], toks[nodes[b]:nodes[b] + nd[b]], nd[b:b + 1], seed=seeds[b],
                        position=pos[b], top_p=0.95)
        assert one.num_accepted[0] == r.num_accepted[b]
        assert np.array_equal(one.tokens[0], r.tokens[b, :nd[b] + 1])
    y = x[:B]
    t = sf.sample(y, seed=seeds, position=pos, top_k=40)
    assert np.array_equal(t[:64], [sf.sample(y[i:i + 1], seed=seeds[i], position=pos[i],
                                             top_k=40)[0] for i in range(64)])
    p = sf.probs(y, top_k=40)
    assert np.all(p[np.arange(B), t] > 0)


@pytest.mark.parametrize("method", ["greedy", "coupled", "rejection"])
def test_trees_of_256_nodes(rng, method):
    V, B, N = 500, 3, 256
    nd = np.full(B, N, np.int32)
    parents = np.concatenate([random_tree(rng, N) for _ in range(B)])
    x = (rng.standard_normal((B * (N + 1), V)) * 6).astype(np.float32)
    rows, nodes = request_slices(nd)
    T = 0.0 if method == "greedy" else 0.7
    m = "coupled" if method == "coupled" else "rejection"
    pos = np.array([0, 100, 2**33])
    if method == "coupled":  # the target's own tokens, row by row, at its positions
        depth = np.zeros(B * (N + 1), np.int64)
        for b in range(B):
            for i in range(N):
                par = parents[nodes[b] + i]
                depth[rows[b] + i + 1] = depth[rows[b] + par + 1] + 1
        row_tok = np.array([sf.sample(x[j:j + 1], temperature=T, method=m, seed=7,
                                      position=pos[np.searchsorted(rows, j, "right") - 1]
                                      + depth[j])[0] for j in range(B * (N + 1))])
    else:
        row_tok = np.argmax(x, axis=1)
    toks = rng.integers(0, V, B * N).astype(np.int32)
    for b in range(B):
        for i in range(N):
            if rng.random() < 0.5:
                toks[nodes[b] + i] = row_tok[rows[b] + parents[nodes[b] + i] + 1]
    r = sf.verify(x, toks, nd, parents=parents, temperature=T, method=m, seed=7, position=pos)
    check_structure(r, toks, nd, parents, V)
    if method != "rejection":
        for b in range(B):
            emitted, path = simulate_coupled(row_tok[rows[b]:rows[b] + N + 1],
                                             parents[nodes[b]:nodes[b] + N],
                                             toks[nodes[b]:nodes[b] + N])
            assert r.num_accepted[b] == len(path)
            assert list(r.tokens[b, :len(emitted)]) == emitted
    else:  # every emitted token has positive probability under its row
        for b in range(B):
            cur = -1
            for d in range(r.num_accepted[b] + 1):
                p = sf.probs(x[rows[b] + cur + 1][None], temperature=T)[0]
                assert p[r.tokens[b, d]] > 0
                cur = r.accepted_nodes[b, d] if d < r.num_accepted[b] else cur
    assert r.num_accepted.max() > 1  # the walks did go deep


def test_chains_of_64(rng):
    V, B, N = 1000, 4, 64
    nd = np.full(B, N, np.int32)
    x = (rng.standard_normal((B * (N + 1), V)) * 2).astype(np.float32)
    rows, nodes = request_slices(nd)
    toks = np.concatenate([np.argmax(x[rows[b]:rows[b] + N], axis=1) for b in range(B)])
    toks = toks.astype(np.int32)
    r = sf.verify(x, toks, nd, temperature=0.0)
    assert np.all(r.num_accepted == N)
    assert np.array_equal(r.tokens[:, :N], toks.reshape(B, N))
    assert np.array_equal(r.tokens[:, N], np.argmax(x[rows + N], axis=1))
    assert np.array_equal(r.accepted_nodes, np.tile(np.arange(N), (B, 1)))
    # coupled: draft what the target itself samples at each position: all accepted
    row_tok = np.array([sf.sample(x[j:j + 1], method="coupled", seed=3,
                                  position=10 + j % (N + 1))[0] for j in range(B * (N + 1))])
    toks = np.concatenate([row_tok[rows[b]:rows[b] + N] for b in range(B)]).astype(np.int32)
    r = sf.verify(x, toks, nd, method="coupled", seed=3, position=10)
    assert np.all(r.num_accepted == N)
    # rejection, one-hot q: each draft is accepted with probability p(x) = 1 where the
    # logits make it the argmax by a wide margin (the greedy drafts of above)
    argmax = np.concatenate([np.argmax(x[rows[b]:rows[b] + N], axis=1)
                             for b in range(B)]).astype(np.int32)
    r = sf.verify(x * 1e4, argmax, nd, seed=3)
    check_structure(r, argmax, nd, None, V)
    assert np.all(r.num_accepted == N)


def test_draft_limit_per_request(rng):
    V = 50
    n = 1024  # SF_MAX_DRAFT
    x = rng.standard_normal((n + 1, V)).astype(np.float32)
    toks = np.argmax(x[:n], axis=1).astype(np.int32)
    r = sf.verify(x, toks, np.array([n]), temperature=0.0)
    assert r.num_accepted[0] == n
    x2 = rng.standard_normal((n + 2, V)).astype(np.float32)
    with pytest.raises(ValueError):
        sf.verify(x2, np.zeros(n + 1, np.int32), np.array([n + 1]))


def test_batch_limit_is_a_value_error():
    B = (1 << 20) + 1  # SF_MAX_BATCH + 1 requests of no drafts
    x = np.zeros((B, 1), np.float32)
    with pytest.raises(ValueError):
        sf.verify(x, np.zeros(0, np.int32), np.zeros(B, np.int32))


@pytest.mark.parametrize("bad", [
    dict(top_k=2**31), dict(top_k=-1), dict(temperature=-1.0), dict(temperature=np.inf),
    dict(temperature=np.nan), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=1.5),
    dict(min_p=-0.1), dict(seed=-1), dict(seed=2**64), dict(position=2**63)],
    ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_parameters_out_of_range_are_value_errors(bad):
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError):
        sf.sample(x, **bad)
    with pytest.raises(ValueError):
        sf.verify(x, np.array([1]), np.array([1]), **bad)


def test_huge_top_k_is_fine(rng):
    x = rng.standard_normal((2, 1000)).astype(np.float32)
    for k in (1000, 1001, 2**31 - 1):
        np.testing.assert_allclose(sf.probs(x, top_k=k), sf.probs(x), rtol=1e-6, atol=0)


@pytest.mark.skipif("asan" in os.environ.get("LD_PRELOAD", ""),
                    reason="ASan holds freed memory in quarantine: RSS says nothing there")
def test_scratch_memory_is_bounded(rng, restore_threads):
    """Scratch grows to its high-water mark once, then calls allocate nothing more.

    Measured: worst case (top_k near V) about 44 bytes per vocabulary entry per pool
    thread that ran a row (10.9 MiB at V = 262144), a dense-draft tree 8 bytes more.
    """
    sf.set_num_threads(2)
    V = 65536
    x = rng.standard_normal((4, V)).astype(np.float32)
    q = np.full((2, V), 1.0 / V, np.float32)

    def heavy():
        sf.sample(x, top_k=V - 1, top_p=0.9, seed=1)
        sf.probs(x, top_p=0.5)
        sf.verify(x[:3], np.array([1, 2], np.int32), np.array([2]), draft_probs=q,
                  parents=np.array([-1, -1]))

    heavy()
    before = rss_mib()
    for _ in range(8):
        heavy()
    growth = rss_mib() - before
    assert growth < 4, f"RSS grew {growth:.1f} MiB over 8 warm rounds"


# --------------------------------------------------------------------------------------
# numerical edge cases
# --------------------------------------------------------------------------------------


def test_ties_go_to_the_lowest_id():
    x = np.array([[1.0, 3.0, 3.0, 3.0, -np.inf, 3.0]], np.float32)
    assert sf.sample(x, temperature=0.0)[0] == 1
    assert sf.sample(x, temperature=0.0, method="coupled")[0] == 1
    np.testing.assert_array_equal(sf.probs(x, temperature=0.0)[0], [0, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(sf.probs(x, top_k=1)[0], [0, 1, 0, 0, 0, 0])
    p = sf.probs(x, top_k=2)[0]
    assert p[1] == p[2] == 0.5 and p[3] == p[5] == 0.0
    flat = np.zeros((1, 10), np.float32)
    np.testing.assert_array_equal(sf.probs(flat, top_k=3)[0] > 0, np.arange(10) < 3)
    np.testing.assert_array_equal(sf.probs(flat, top_p=0.35)[0] > 0, np.arange(10) < 4)
    # greedy verify: of two siblings drafting the same argmax, the first is accepted
    y = np.array([[0.0, 5.0, 5.0], [0.0, 0.0, 9.0], [9.0, 0.0, 0.0]], np.float32)
    r = sf.verify(y, np.array([1, 1]), np.array([2]), parents=np.array([-1, -1]),
                  temperature=0.0)
    assert r.num_accepted[0] == 1 and r.accepted_nodes[0, 0] == 0 and r.tokens[0, 1] == 2


@pytest.mark.parametrize("T", [1e-3, 1e-6, 1e-20, 1e-30, 1e-37, 1e-38, 4.5e-39, 1e-40,
                               1e-45])
def test_tiny_temperature_is_greedy_on_a_unique_max(T):
    x = np.array([[0.0, 1.0, 0.999, -np.inf, 0.5], [2.0, -3.0, 2.0 - 2**-10, 1.0, 2.0]],
                 np.float32)
    # row 1 has a tie at the top (ids 0 and 4): greedy keeps id 0, T > 0 splits them
    p = sf.probs(x, temperature=T)
    assert np.isfinite(p).all() and np.allclose(p.sum(axis=1), 1.0, atol=1e-6)
    if T >= 1e-3:
        return
    assert p[0, 1] == 1.0
    assert set(np.flatnonzero(p[1])) <= {0, 4} and p[1, 0] > 0
    assert sf.sample(x[:1], temperature=T, seed=5)[0] == 1
    assert sf.sample(x[:1], temperature=T, seed=5, method="coupled")[0] == 1
    assert sf.sample(x[1:], temperature=T, seed=5)[0] in (0, 4)


def test_top_p_can_keep_a_single_token():
    x = np.array([[0.0, 2.0, 1.0, 2.0]], np.float32)
    for top_p in (1e-6, 1e-30, np.float32(1e-45).item(), 0.1):
        np.testing.assert_array_equal(sf.probs(x, top_p=top_p)[0], [0, 1, 0, 0])
        assert sf.sample(x, top_p=top_p, seed=9)[0] == 1
        assert sf.sample(x, top_p=top_p, seed=9, method="coupled")[0] == 1
    r = sf.verify(np.concatenate([x, x]), np.array([3]), np.array([1]), top_p=1e-6)
    assert r.num_accepted[0] == 0 and r.tokens[0, 0] == 1  # 3 ties with 1 but loses


def test_banned_tokens_and_all_banned_rows(rng):
    V = 64
    x = rng.standard_normal((3, V)).astype(np.float32)
    x[:, ::2] = -np.inf
    p = sf.probs(x)
    assert np.all(p[:, ::2] == 0) and np.allclose(p.sum(axis=1), 1, atol=1e-6)
    for s in range(50):
        assert np.all(sf.sample(x, seed=s) % 2 == 1)
        assert np.all(sf.sample(x, seed=s, method="coupled") % 2 == 1)
    # a banned draft token is never accepted
    r = sf.verify(x[:2], np.array([0]), np.array([1]), seed=3)
    assert r.num_accepted[0] == 0
    dead = x.copy()
    dead[1] = -np.inf
    for call in (lambda: sf.probs(dead), lambda: sf.sample(dead),
                 lambda: sf.sample(dead, temperature=0.0),
                 lambda: sf.verify(dead[[1, 0]], np.array([1]), np.array([1]),
                                   temperature=0.0)):
        with pytest.raises(ValueError, match="-inf"):
            call()
    for bad in (np.nan, np.inf):
        y = x.copy()
        y[0, 1] = bad
        with pytest.raises(ValueError, match="NaN"):
            sf.probs(y)


@pytest.mark.parametrize("kind", ["dense", "sparse-zero", "sparse-missing"])
def test_zero_draft_probability_is_a_rejection(rng, kind):
    V = 16
    x = np.zeros((2, V), np.float32)
    x[0, 3] = 5.0  # p(3) ~ 0.9: a drafted 3 would nearly always be accepted
    if kind == "dense":
        q = np.full((1, V), 1.0 / (V - 1), np.float32)
        q[0, 3] = 0.0
    elif kind == "sparse-zero":
        q = sf.SparseProbs(np.array([[3, 4]]), np.array([[0.0, 1.0]], np.float32))
    else:
        q = sf.SparseProbs(np.array([[4, 5]]), np.array([[0.5, 0.5]], np.float32))
    accepted = [sf.verify(x, np.array([3]), np.array([1]), draft_probs=q,
                          seed=s).num_accepted[0] for s in range(200)]
    assert sum(accepted) == 0
