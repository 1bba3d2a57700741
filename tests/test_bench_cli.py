"""``specfast bench`` and its torch peer (specfast._torch_reference).

- a smoke run of the command on a tiny grid (table, JSON, plot) and the five bar cases;
- the torch reference implements the same algorithm: its probabilities equal
  specfast.probs, its emitted outcomes follow the exact distribution that specfast's
  follow (tests/reference.py:tree_outcomes), and greedy chains agree token for token.
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import specfast as sf
from reference import (
    chain_parents,
    one_hot,
    outcome_keys,
    ref_probs,
    safe_params,
    sparse_to_dense,
    tree_outcomes,
)
from stats import assert_outcomes, scaled
from specfast import _bench_cli as bench
from specfast.cli import main

try:
    import torch

    from specfast._torch_reference import torch_probs, torch_verify
except ImportError:  # the command still runs, without its torch column
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
IMPLS = bench.IMPLS if torch is not None else ("specfast", "numpy.max")

B_COPIES = scaled(40_000)  # copies of one request per statistical test


# ---------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------


def test_bench_command_tiny_grid(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    rc = main([
        "bench", "--batch", "1", "3", "--draft-len", "2", "--vocab", "1000",
        "--dtype", "float32", "bfloat16", "--method", "rejection", "coupled",
        "--draft-probs", "none", "dense", "sparse", "--filters", "none", "topk50-topp0.9",
        "--repeats", "1", "--min-time", "0", "--no-progress", "--impl", *IMPLS,
        "--json", str(out_json), "--system-malloc",  # this process's malloc stays as it is
    ])
    assert rc == 0
    text = capsys.readouterr().out
    assert "x floor" in text and "B3-K2-V1000-bfloat16-coupled-topk50-topp0.9" in text
    assert "malloc as the system has it" in text
    data = json.loads(out_json.read_text())
    rows = data["rows"]
    assert len(rows) == 2 * 2 * 4 * 2  # batches x dtypes x (3 kinds + coupled) x filters
    for r in rows:
        assert r["correct_specfast"] and r.get("correct_torch", True), r["id"]
        for impl in IMPLS:
            assert r[f"time_{impl}"] > 0 and r[f"bytes_{impl}"] > 0
        assert 0 <= r["mean_accepted"] <= 2
    assert data["machine"]["cores"] >= 1
    assert data["machine"]["malloc_keeps_freed_memory"] is False


@pytest.mark.skipif("asan" in os.environ.get("LD_PRELOAD", ""),
                    reason="under ASan, malloc is ASan's: glibc's settings do not apply")
def test_the_torch_peer_keeps_freed_memory():
    """keep_freed_memory (the bench's default) serves a freed large block again without
    new page faults; with the system's malloc each one is mapped and faulted afresh,
    which made the torch peer 2x to 2.9x slower on the bar cases."""
    code = (
        "import resource, sys, numpy as np\n"
        "from specfast._bench_cli import keep_freed_memory\n"
        "if sys.argv[1] == 'keep': assert keep_freed_memory()\n"
        "np.ones(1 << 24)\n"  # 128 MB, freed at once
        "f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "for _ in range(3): np.ones(1 << 24)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)\n")
    faults = {how: int(subprocess.run([sys.executable, "-c", code, how], capture_output=True,
                                      text=True, check=True).stdout)
              for how in ("keep", "system")}
    assert faults["keep"] < min(1000, faults["system"]), faults


@pytest.mark.parametrize("option, said", [
    (["--seed", "-5"], "--seed: -5 is below 0"),
    (["--min-time", "inf"], "--min-time: 'inf' is not a finite number"),
    (["--vocab", "20000000"], "--vocab: 20000000 is outside"),
    (["--max-gb", "nan"], "--max-gb: 'nan' is not a finite number"),
    (["--max-gb", "0"], "--max-gb: 0.0 is not above 0"),
])
def test_bench_options_out_of_range_are_usage_errors(option, said, capsys):
    """Said by argparse before any timing (they were tracebacks after the case
    list, or an empty table for --max-gb nan)."""
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--batch", "1", "--vocab", "100", "--no-progress", *option])
    assert exc.value.code == 2
    assert said in capsys.readouterr().err


def test_bench_command_plot_and_progress(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    pytest.importorskip("tqdm")
    out_png = tmp_path / "bench.png"
    rc = main(["bench", "--batch", "1", "2", "4", "--draft-len", "1", "3", "--vocab", "500",
               "--repeats", "1", "--min-time", "0", "--impl", *IMPLS, "--plot", str(out_png),
               "--system-malloc"])
    assert rc == 0
    assert "B4-K3-V500" in capsys.readouterr().out
    assert out_png.read_bytes()[:4] == b"\x89PNG"


def test_bars_are_the_five_cases_of_the_issue():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    cases = bench._cases(parser.parse_args(["--bars"]))
    assert [c.id for c in cases] == [
        "B64-K4-V151936-float32-rejection-dense-none",
        "B64-K4-V151936-float32-rejection-dense-topk50-topp0.9",
        "B64-K4-V151936-float32-coupled-none",
        "B1-K5-V49152-float32-rejection-none-none",
        "B256-K8-V32000-float32-rejection-dense-none",
    ]
    rows = [dict(id=c.id, x_floor=0.5, speedup_torch=40.0) for c in cases[:4]]
    rows.append(dict(id=cases[4].id, x_floor=1.5))
    verdicts = bench.check_bars(rows)
    assert [ok for _n, ok, _t in verdicts] == [True, True, True, True, False]
    # each bar reads the row of its own case: a skipped case's bar is not run
    verdicts = bench.check_bars(rows[3:])
    assert [ok for _n, ok, _t in verdicts] == [None, None, None, True, False]


@pytest.mark.parametrize("case", [
    bench.Case(2, 0, 1000), bench.Case(2, 0, 1000, method="coupled"),
    bench.Case(3, 2, 5, draft="sparse"),
], ids=["no-drafts", "no-drafts-coupled", "sparse-vocab-5"])
def test_bench_edge_cases_run(case, monkeypatch):
    """Every implementation runs (no drafts at all; a sparse q wider than the
    vocabulary); with threads, the all-core floor is measured beside the one-thread one."""
    monkeypatch.setattr(bench, "specfast_threads", lambda: 2)
    row = bench.run_case(case, impls=IMPLS, repeats=1, min_time=0)
    assert row["correct_specfast"] and row.get("correct_torch", True)
    assert row["x_floor_all"] > 0 and row["time_numpy.max-all"] > 0


def test_inputs_are_realistic():
    """Drafts are sampled from q, acceptance of a correlated drafter is ~0.5-0.9 per token
    and an independent one is almost always rejected."""
    case = bench.Case(32, 4, 32000, "float32", "rejection", "dense", "none")
    inp = bench.make_inputs(case)
    assert np.allclose(inp.q_dense.sum(axis=1), 1, atol=1e-4)
    assert (inp.q_dense[np.arange(case.nodes), inp.tokens] > 0).all()
    row = bench.run_case(case, impls=("specfast",), repeats=1, min_time=0)
    assert 1.0 < row["mean_accepted"] < 3.8 and row["correct_specfast"]
    indep = bench.run_case(bench.Case(32, 4, 32000, source="independent"),
                           impls=("specfast",), repeats=1, min_time=0)
    assert indep["mean_accepted"] < 0.5


# ---------------------------------------------------------------------------------------
# The torch reference is the same algorithm
# ---------------------------------------------------------------------------------------

FILTER_CASES = {
    "plain": dict(temperature=1.0),
    "temp0.7": dict(temperature=0.7),
    "topk3": dict(temperature=1.0, top_k=3),
    "topp0.8": dict(temperature=1.0, top_p=0.8),
    "topk5-topp0.7-minp0.1": dict(temperature=0.9, top_k=5, top_p=0.7, min_p=0.1),
}


@needs_torch
@pytest.mark.parametrize("vocab", [7, 111, 32000])
@pytest.mark.parametrize("name", list(FILTER_CASES))
def test_torch_probs_equal_specfast_probs(name, vocab, rng):
    params = {**dict(top_k=0, top_p=1.0, min_p=0.0), **FILTER_CASES[name]}
    rows = (rng.standard_normal((9, vocab)) * 2).astype(np.float32)
    params["top_p"], params["min_p"] = safe_params(
        rows, params["temperature"], params["top_k"], params["top_p"], params["min_p"])
    want = sf.probs(rows, **params)
    got = torch_probs(torch.from_numpy(rows), **params).numpy()
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-4)
    np.testing.assert_array_equal(got > 0, want > 0)


@needs_torch
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("temperature", [0.7, [0.5, 0.0, 2.0]], ids=["scalar", "per-row"])
def test_torch_probs_leave_the_logits_as_they_were(dtype, temperature, rng):
    """The temperature scales a widened copy in place, never the caller's logits."""
    x = torch.from_numpy((rng.standard_normal((3, 50)) * 2).astype(np.float32))
    x = x.to(getattr(torch, dtype))
    before = x.clone()
    want = sf.probs(x.float().numpy(), temperature=np.array(temperature, np.float32))
    got = torch_probs(x, temperature=temperature).numpy()
    assert torch.equal(x, before)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-4)


def _fixed_request(kind, rng, vocab=6, k=2):
    """One request: K + 1 logits rows, K fixed drafts, their q as dense float64 rows (for
    the exact outcomes) and as verify takes it (None, dense, or (ids, values))."""
    rows = (rng.standard_normal((k + 1, vocab)) * 1.2).astype(np.float32)
    tokens = np.array([1, 3], np.int32)[:k]
    if kind == "dense":
        q = rng.dirichlet(np.ones(vocab), k).astype(np.float32)
        q /= q.sum(axis=1, keepdims=True)
        return rows, tokens, q.astype(np.float64), q
    if kind == "sparse":
        ids = np.array([[1, 4, 0], [3, 2, 5]], np.int32)[:k]
        vals = np.array([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]], np.float32)[:k]
        return rows, tokens, sparse_to_dense(ids, vals, vocab), (ids, vals)
    return rows, tokens, one_hot(tokens, vocab), None


def _tile_q(q, batch, sparse):
    if q is None:
        return None
    if sparse:
        return tuple(np.tile(a, (batch, 1)) for a in q)
    return np.tile(q, (batch, 1))


@needs_torch
@pytest.mark.parametrize("filters", ["plain", "topk5-topp0.7-minp0.1"])
@pytest.mark.parametrize("kind", ["none", "dense", "sparse", "coupled"])
def test_torch_and_specfast_emit_the_exact_distribution(kind, filters, rng):
    """Both implementations, run on B copies of one fixed request, give outcome
    frequencies (accepted path, emitted token) consistent with the exact distribution.
    Coupled verification with fixed drafts has the outcomes of one-hot q."""
    params = {**dict(top_k=0, top_p=1.0, min_p=0.0), **FILTER_CASES[filters]}
    rows, tokens, q64, q_np = _fixed_request("none" if kind == "coupled" else kind, rng)
    params["top_p"], params["min_p"] = safe_params(
        rows, params["temperature"], params["top_k"], params["top_p"], params["min_p"])
    k = len(tokens)
    expected = tree_outcomes(ref_probs(rows.astype(np.float64), **params), chain_parents(k),
                             tokens, q64)
    method = "coupled" if kind == "coupled" else "rejection"
    b = B_COPIES
    logits = np.tile(rows, (b, 1))
    drafts, nd = np.tile(tokens, b), np.full(b, k, np.int32)

    q_rep = _tile_q(q_np, b, kind == "sparse")
    sf_q = sf.SparseProbs(*q_rep) if kind == "sparse" else q_rep
    res = sf.verify(logits, drafts, nd, draft_probs=sf_q, method=method,
                    seed=np.arange(b, dtype=np.uint64), position=rng.integers(0, 2**40, b),
                    **params)
    # B_COPIES draws see 2% of the outcome distribution: what a benchmark's peer
    # must match (test_verify holds specfast to 1%)
    assert_outcomes(outcome_keys(res), expected, f"specfast {kind} {filters}", resolution=0.02)

    t_q = None if q_np is None else (
        tuple(torch.from_numpy(a) for a in q_rep) if kind == "sparse" else torch.from_numpy(q_rep))
    g = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    tr = torch_verify(torch.from_numpy(logits), torch.from_numpy(drafts), torch.from_numpy(nd),
                      draft_probs=t_q, method=method, generator=g, **params)
    n = tr.num_accepted.numpy()
    toks = tr.tokens.numpy()
    keys = [(tuple(range(a)), int(toks[i, a])) for i, a in enumerate(n)]
    assert_outcomes(keys, expected, f"torch {kind} {filters}", resolution=0.02)
    # Mean accepted tokens agree too (a summary the bench table reports): within 8 sigma.
    spread = np.sqrt((n.var() + res.num_accepted.var()) / b)
    assert abs(n.mean() - res.num_accepted.mean()) <= 8 * spread + 1e-9


@needs_torch
@pytest.mark.parametrize("sampler", ["cdf", "multinomial"])
def test_torch_residual_samplers_agree(sampler, rng):
    rows, tokens, q64, q_np = _fixed_request("dense", rng)
    expected = tree_outcomes(ref_probs(rows.astype(np.float64)), chain_parents(2), tokens, q64)
    b = scaled(20_000)
    g = torch.Generator().manual_seed(5)
    tr = torch_verify(torch.from_numpy(np.tile(rows, (b, 1))), torch.from_numpy(np.tile(tokens, b)),
                      torch.full((b,), 2), draft_probs=torch.from_numpy(np.tile(q_np, (b, 1))),
                      generator=g, sampler=sampler)
    keys = [(tuple(range(a)), int(tr.tokens[i, a])) for i, a in enumerate(tr.num_accepted.tolist())]
    assert_outcomes(keys, expected, f"torch residual by {sampler}", resolution=0.03)


@needs_torch
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_greedy_ragged_batch_equals_specfast(dtype, rng):
    """Temperature 0 is deterministic: on a ragged batch (0 to 4 drafts, some drafts the
    argmax, some not) both give the same tokens and counts."""
    nd = np.array([3, 0, 4, 1, 2], np.int32)
    vocab = 50
    logits = rng.standard_normal((int((nd + 1).sum()), vocab)).astype(np.float32)
    starts = np.concatenate([[0], np.cumsum(nd + 1)])[:-1]
    drafts = []
    for b, n in enumerate(nd):  # draft the argmax for the first few rows, then a miss
        for d in range(n):
            best = int(logits[starts[b] + d].argmax())
            drafts.append(best if d < n - 1 or b % 2 else (best + 1) % vocab)
    drafts = np.array(drafts, np.int32)
    t_logits = torch.from_numpy(logits)
    if dtype == "bfloat16":
        t_logits = t_logits.to(torch.bfloat16)
    want = sf.verify(t_logits, torch.from_numpy(drafts), torch.from_numpy(nd), temperature=0.0)
    got = torch_verify(t_logits, torch.from_numpy(drafts), torch.from_numpy(nd),
                       temperature=0.0)
    np.testing.assert_array_equal(got.num_accepted.numpy(), want.num_accepted.numpy())
    np.testing.assert_array_equal(got.tokens.numpy(), want.tokens.numpy())
