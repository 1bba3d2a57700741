"""Every crash or wrong answer that fuzzing found, as a test.

Each test below names the bug, the input that showed it and what the library
must do instead. The last test replays the fuzz corpora (fuzz/corpus/api and
fuzz/corpus/tree, whose regress-* files are inputs that once failed) through
the harnesses' invariant checks, built with the system C compiler against the library that
specfast loads, so the corpus keeps guarding the plain build too (fuzz/run.sh
runs it under libFuzzer with ASan and UBSan).
"""

from __future__ import annotations

import importlib
import os
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

import specfast as sf
from reference import ref_probs_row
from stats import assert_rate

ROOT = pathlib.Path(__file__).resolve().parent.parent
INT64_MAX = 2**63 - 1


def _wrap(position):
    """A position as int64 after wrapping modulo 2^64."""
    return (position + 2**63) % 2**64 - 2**63


@pytest.mark.parametrize("method", ["rejection", "coupled"])
@pytest.mark.parametrize("position", [INT64_MAX, INT64_MAX - 1, INT64_MAX - 63])
def test_position_near_int64_max(method, position):
    """Found by fuzz_api.c (UBSan): verify computed position + depth in int64, a signed
    overflow (undefined behaviour) once a request accepted drafts near 2^63 - 1.
    Every position the API accepts must work; the positions of deeper rows wrap modulo
    2^64 like the Philox counter they key, so each emitted token equals what sample()
    gives at the wrapped position."""
    V, N = 16, 64
    x = np.zeros((N + 1, V), np.float32)
    x[:, 3] = 30.0  # p(3) = 1 - 1e-12: every draft of 3 is accepted
    toks = np.full(N, 3, np.int32)
    r = sf.verify(x, toks, np.array([N]), position=position, method=method, seed=5)
    assert r.num_accepted[0] == N
    assert np.all(r.tokens[0] == 3)
    if method == "coupled":
        y = x.copy()
        y[:, 3] = 1.0  # a flatter row: the coupled token depends on the position
        want = [sf.sample(y[d:d + 1], method="coupled", seed=5, position=_wrap(position + d))[0]
                for d in range(N + 1)]
        r = sf.verify(y, np.array(want[:N], np.int32), np.array([N]), position=position,
                      method="coupled", seed=5)
        assert r.num_accepted[0] == N and list(r.tokens[0]) == want


@pytest.mark.parametrize("T", [2.95e-39, 3.0e-39, 3.5e-39, 4.0e-39, 4.2e-39])
def test_temperature_whose_scale_overflows(T):
    """Found by fuzz_api.c: a temperature in about (2.9e-39, 4.3e-39) has a finite 1/T but
    an infinite 1/T * log2(e), so the top token's exponent was 0 * inf = NaN: probs()
    returned rows summing to 2, sample() returned token -1 (out of range), and the
    fixed-point conversion of NaN was undefined behaviour. Such a temperature must act
    like any tiny one: greedy on a unique maximum."""
    x = np.array([[0.0, 1.0, 1.0 - 2**-10, -np.inf], [5.0, -1.0, 4.0, 4.5]], np.float32)
    p = sf.probs(x, temperature=T)
    assert np.all(np.isfinite(p))
    np.testing.assert_array_equal(p, [[0, 1, 0, 0], [1, 0, 0, 0]])
    for kw in (dict(), dict(top_p=0.5), dict(top_k=2), dict(min_p=0.5)):
        assert list(sf.sample(x, temperature=T, seed=1, **kw)) == [1, 0]
        assert list(sf.sample(x, temperature=T, seed=1, method="coupled", **kw)) == [1, 0]
    r = sf.verify(np.concatenate([x[:1], x[:1]]), np.array([1]), np.array([1]),
                  temperature=T)
    assert r.num_accepted[0] == 1 and list(r.tokens[0]) == [1, 1]


def test_subnormal_temperature_keeps_one_scale():
    """Found by review: below T ~ 4e-39, 1 / T and log2(e) / T were capped at FLT_MAX
    each, so the weights 2^((l - max) c) and the coupled keys (l - max) / T used
    temperatures a factor log2(e) apart (coupled drew token 1 below 0.033 of the time,
    rejection 0.086); and the large top-k / top-p cut took tokens below max - 88 T to
    weigh 0, which at the cap kept every token (top_k = 4500 kept 6000). Both follow the
    capped 1 / T now, the temperature a tiny T acts as."""
    T, t_eff = 1e-40, 1.0 / np.float64(np.float32(2.3586574e38))  # 1 / SF_INV_T_MAX
    x = np.full((1, 6000), -1e-38, np.float32)
    x[0, 0] = 0.0
    p = sf.probs(x, temperature=T)[0]
    np.testing.assert_allclose(p, ref_probs_row(x[0], t_eff), rtol=1e-4)
    assert np.count_nonzero(sf.probs(x, temperature=T, top_k=4500)) == 4500
    np.testing.assert_allclose(sf.probs(x, temperature=T, top_p=0.5)[0],
                               ref_probs_row(x[0], t_eff, top_p=0.5), rtol=1e-4)
    n = 40_000
    two = np.tile(np.array([[0.0, -1e-38]], np.float32), (n, 1))
    want = ref_probs_row(two[0], t_eff)
    seeds = np.arange(n, dtype=np.uint64)
    for method in ("rejection", "coupled"):
        t = sf.sample(two, temperature=T, seed=seeds, position=7, method=method)
        assert_rate(int(np.sum(t == 1)), n, want[1], f"{method} at T = {T}")


def test_temperature_above_the_cap():
    """Found by fuzz_api.c: at temperature 3.4e38 a row holding logits near +-3e38 lost
    tokens whose logit - max overflowed float to -inf although exp((logit - max) / T) was
    about 0.2 (probs() was 0.14% off float64 softmax). Up to SF_MAX_TEMPERATURE (1e30)
    such a token weighs exactly 0, as in float64; above it the call is refused."""
    x = np.array([[3e38, -3e38, 2e38, 0.0]], np.float32)
    for T in (1e31, 3.4e38):
        with pytest.raises(ValueError, match="temperature"):
            sf.probs(x, temperature=T)
    T = 1e30
    z = (x[0].astype(np.float64) - 3e38) / np.float64(np.float32(T))
    want = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    np.testing.assert_allclose(sf.probs(x, temperature=T)[0], want, rtol=1e-6, atol=1e-30)
    assert list(sf.sample(x, temperature=T, seed=3)) == [0]


# --------------------------------------------------------------------------------------
# the corpus, replayed through the harness's checks
# --------------------------------------------------------------------------------------


def _compiler():
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


@pytest.mark.parametrize("harness", ["api", "tree"])
def test_replay_fuzz_corpus(tmp_path, harness):
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler to build the corpus replayer")
    lib_path = pathlib.Path(importlib.import_module("specfast._lib")._library_path())
    if not lib_path.exists():
        pytest.skip(f"no library file at {lib_path}")
    exe = tmp_path / "replay"
    cmd = [cc, "-O1", "-std=c11", "-I", str(ROOT / "csrc" / "include"),
           str(ROOT / "fuzz" / f"fuzz_{harness}.c"), str(ROOT / "fuzz" / "replay_main.c"),
           str(lib_path), f"-Wl,-rpath,{lib_path.parent}", "-lm", "-o", str(exe)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    corpus = ROOT / "fuzz" / "corpus" / harness
    files = sorted(p for p in corpus.iterdir() if p.is_file())
    assert files, "the fuzz corpus is empty"
    proc = subprocess.run([str(exe), str(corpus)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:] + proc.stderr[-3000:])
    assert f"replayed {len(files)} inputs" in proc.stdout


def test_negative_q_outside_the_cut_never_revives_a_banned_token():
    """Found by fuzz_api.c (fuzz/corpus/api/regress-negative-q-outside-cut): under a
    filter (here min_p) the residual reads q only where the filters keep a token, and a
    negative q at a banned token made max(0, p - q) positive there, so the corrected
    token could be one of probability 0. The residual of a token of probability 0 is 0."""
    x = np.array([[-np.inf, 0.0, 0.0], [0.0, 0.0, 0.0]], np.float32)
    q = np.array([[-0.25, 0.61, 0.24]], np.float32)  # q(1) = 0.61 > p(1) = 0.5
    n = 400
    r = sf.verify(np.tile(x, (n, 1)), np.ones(n, np.int32), np.ones(n, np.int32),
                  draft_probs=np.tile(q, (n, 1)), min_p=1e-30, seed=3,
                  position=np.arange(n))
    rejected = r.num_accepted == 0
    assert 20 < rejected.sum() < n  # about 18% of the drafts are rejected
    assert np.all(r.tokens[rejected, 0] == 2)  # the residual max(0, p - q) is all on 2
