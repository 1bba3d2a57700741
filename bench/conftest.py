"""pytest-benchmark microbenchmarks of specfast.verify (see test_bench_verify.py).

Run from the repository root (``bench/`` is not in the default test paths)::

    pytest bench -m quick                  # ~1 minute: a few cases, all three implementations
    pytest bench -m bars                   # the five bar cases of the README
    pytest bench -k "V151936 and float32"  # any slice of the grid by its ids
    pytest bench                           # the whole grid (hours; not run in CI)

Cases whose inputs exceed SPECFAST_BENCH_MAX_GB (default 3) are skipped, and torch is
skipped where its working set would exceed SPECFAST_BENCH_TORCH_MAX_GB (default 8).
"""

import pytest

from specfast import _bench_cli as bench


def pytest_configure(config):
    bench.keep_freed_memory()  # as specfast bench does for the torch peer
    config.addinivalue_line("markers", "quick: the one-minute subset of the benchmark grid")
    config.addinivalue_line("markers", "bars: the five cases that the README's bars are on")


@pytest.fixture(scope="session")
def bench_inputs():
    """make_inputs(case), keeping only the latest case: the three implementations of one
    case run one after the other and share its inputs; memory stays one case's worth."""
    cache = {}

    def get(case):
        if case not in cache:
            cache.clear()
            cache[case] = bench.make_inputs(case)
        return cache[case]

    yield get
    cache.clear()
