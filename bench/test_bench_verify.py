"""specfast.verify beside its memory floor (numpy.max) and plain torch, case by case.

Every case of the grid (batch, draft length, vocab, dtype, method and draft-prob kind,
filters) is run by three tests in a row, one per implementation, in one benchmark group:
pytest-benchmark's table then shows them side by side, with ratios. ``extra_info`` holds
the shape, dtype, backend, implementation, bytes read (a model: see
specfast._bench_cli.bytes_read), GB/s at the median, the mean accepted tokens and a
correctness flag. ``specfast bench`` runs the same cases with interleaved timing.
"""

import os

import numpy as np
import pytest

import specfast
from specfast import _bench_cli as bench

MAX_BYTES = float(os.environ.get("SPECFAST_BENCH_MAX_GB", bench.MAX_GB)) * 1e9
TORCH_MAX_BYTES = float(os.environ.get("SPECFAST_BENCH_TORCH_MAX_GB", "8")) * 1e9

QUICK = {
    bench.Case(1, 4, 32000, "float32", "rejection", "dense", "none"),
    bench.Case(64, 4, 32000, "float32", "rejection", "dense", "none"),
    bench.Case(64, 4, 32000, "float32", "rejection", "dense", "topk50-topp0.9"),
    bench.Case(64, 4, 32000, "float32", "coupled", "none", "none"),
    bench.Case(16, 4, 32000, "bfloat16", "rejection", "none", "none"),
    bench.Case(16, 4, 32000, "float32", "rejection", "sparse", "none"),
}
BARS = [case for _name, case, _checks in bench.BARS]


def _param(case):
    marks = []
    if case in QUICK:
        marks.append(pytest.mark.quick)
    if case in BARS:
        marks.append(pytest.mark.bars)
    if case.input_bytes > MAX_BYTES:
        marks.append(pytest.mark.skip(reason=f"inputs {case.input_bytes / 1e9:.1f} GB"))
    return pytest.param(case, id=case.id, marks=marks)


_GRID = bench.grid()
CASES = [_param(c) for c in _GRID + [c for c in BARS if c not in _GRID]]


def torch_working_bytes(case):
    """Roughly what the torch reference holds at once: inputs, p and two temporaries."""
    return case.input_bytes + 3 * case.rows * case.vocab * 4


@pytest.mark.parametrize("impl", bench.IMPLS)
@pytest.mark.parametrize("case", CASES)
def test_verify(benchmark, bench_inputs, case, impl):
    if impl == "torch":
        pytest.importorskip("torch")
        if torch_working_bytes(case) > TORCH_MAX_BYTES:
            pytest.skip(f"torch would hold ~{torch_working_bytes(case) / 1e9:.1f} GB")
    inp = bench_inputs(case)
    fn = bench.make_call(impl, inp)
    benchmark.group = case.id
    benchmark.extra_info.update(
        case=case.id, impl=impl, batch=case.batch, draft_len=case.draft_len,
        vocab=case.vocab, shape=[case.rows, case.vocab], dtype=case.dtype,
        method=case.method, draft_probs=case.draft,
        filters=case.filters, backend="cpu",
        threads=(specfast.get_num_threads() if impl == "specfast" else
                 1 if impl == "numpy.max" else __import__("torch").get_num_threads()),
    )
    result = benchmark(fn)
    if impl == "numpy.max":
        correct = result.shape == (case.rows,)
        nbytes = bench.bytes_read(impl, inp, None)
    elif impl == "specfast":
        correct = bench.check_result(inp, result.tokens, result.num_accepted)
        nbytes = bench.bytes_read(impl, inp, result.num_accepted)
        benchmark.extra_info["mean_accepted"] = float(np.mean(result.num_accepted))
    else:
        tokens, n = result.tokens.numpy(), result.num_accepted.numpy()
        correct = bench.check_result(inp, tokens, n)
        nbytes = bench.bytes_read(impl, inp, n)
        benchmark.extra_info["mean_accepted"] = float(np.mean(n))
    benchmark.extra_info["correct"] = bool(correct)
    benchmark.extra_info["bytes_read"] = int(nbytes)
    stats = getattr(benchmark, "stats", None)
    if stats is not None:  # None under --benchmark-disable
        benchmark.extra_info["gbps"] = nbytes / stats.stats.median / 1e9
    assert correct
