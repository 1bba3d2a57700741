"""Shared fixtures. The references live in reference.py, the statistics in stats.py."""

import zlib

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    """A numpy generator seeded from the test's id: reproducible, different per test."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def restore_threads():
    """Put the thread count back after a test that changes it."""
    import specfast

    before = specfast.get_num_threads()
    yield
    specfast.set_num_threads(before)
