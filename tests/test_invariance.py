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
    from reference import call_verify, pack, random_request, to_dtype

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
            try:
                xl = to_dtype(x, dtype)
            except BaseException:  # numpy bfloat16 needs ml_dtypes
                continue
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


def test_default_simd_level_is_the_best_available():
    import specfast as sf

    assert sf.simd_level() in LEVELS


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
def test_set_num_threads_arguments():
    import specfast as sf

    sf.set_num_threads(0)  # one per core
    assert sf.get_num_threads() >= 1
    with pytest.raises((ValueError, TypeError)):
        sf.set_num_threads(-1)


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


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    import specfast

    np.savez(sys.argv[1], **workload())
    print(specfast.simd_level())
