"""``specfast bench``: verify against its memory floor (``numpy.max``) and plain torch.

Each case (batch B, draft length K, vocab V, dtype, method, draft-prob kind, filters) is
timed side by side in one run, interleaving the implementations, and reported as medians:

- ``specfast``: :func:`specfast.verify`, Python call included;
- ``numpy.max``: ``np.max(logits, axis=1)`` over the same target logits: one read of every
  byte, the floor that verification should approach (for 16-bit logits, the max of their
  int16 view: the same bytes, read by numpy's vectorised loop; numpy's bfloat16 max is a
  scalar loop and would flatter specfast);
- ``torch``: :mod:`specfast._torch_reference`, the torch code serving stacks use (softmax
  of every row, sort for top-k/top-p, gathers, multinomial), with glibc's malloc told to
  keep freed memory (:func:`keep_freed_memory`), as a tuned torch deployment's allocator does.

The inputs are synthetic but shaped like a model's (see :func:`make_inputs`): draft tokens
are sampled from the drafter's distribution, so the accepted length is realistic and
reported beside the times. ``bench/`` runs the same cases under pytest-benchmark.

Examples::

    specfast bench                                   # a quick default grid
    specfast bench --bars                            # the five bars of the README
    specfast bench --batch 1 16 64 256 --vocab 151936 --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from ._api import _MAX_DRAFT, _MAX_VOCAB
from .cli import count, number

# ---------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------

BATCHES = (1, 4, 16, 64, 256)
DRAFT_LENS = (1, 4, 8)
VOCABS = (32000, 49152, 128256, 151936, 262144)
DTYPES = ("float32", "bfloat16")
# (method, draft-prob kind); coupled verification ignores q, so it has one kind.
METHOD_KINDS = (("rejection", "none"), ("rejection", "dense"), ("rejection", "sparse"),
                ("coupled", "none"))
FILTERS = {"none": {}, "topk50-topp0.9": {"top_k": 50, "top_p": 0.9}, "topp0.9": {"top_p": 0.9}}
IMPLS = ("specfast", "numpy.max", "torch")
SPARSE_K = 8  # ids per sparse draft distribution
MAX_GB = 3.0  # skip cases whose inputs (target logits + dense q) exceed this


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    draft_len: int
    vocab: int
    dtype: str = "float32"
    method: str = "rejection"
    draft: str = "dense"  # "none" (one-hot drafts), "dense" or "sparse" q
    filters: str = "none"  # a key of FILTERS
    source: str = "correlated"  # the drafter: "correlated" with the target or "independent"

    @property
    def id(self) -> str:
        kind = "coupled" if self.method == "coupled" else f"rejection-{self.draft}"
        tail = "" if self.source == "correlated" else f"-{self.source}"
        return (f"B{self.batch}-K{self.draft_len}-V{self.vocab}-{self.dtype}-{kind}-"
                f"{self.filters}{tail}")

    @property
    def rows(self) -> int:
        return self.batch * (self.draft_len + 1)

    @property
    def nodes(self) -> int:
        return self.batch * self.draft_len

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def input_bytes(self) -> int:
        dense = self.draft == "dense" and self.method == "rejection"
        q = self.nodes * self.vocab * 4 if dense else 0
        return self.rows * self.vocab * self.itemsize + q

    @property
    def params(self) -> dict:
        return dict(FILTERS[self.filters])


def grid(batches=BATCHES, draft_lens=DRAFT_LENS, vocabs=VOCABS, dtypes=DTYPES,
         method_kinds=METHOD_KINDS, filters=tuple(FILTERS), sources=("correlated",)):
    """Every combination, in an order that keeps the batch innermost (for the plot)."""
    return [Case(b, k, v, dt, m, kind, f, s)
            for v in vocabs for dt in dtypes for m, kind in method_kinds for f in filters
            for s in sources for k in draft_lens for b in batches]


# The bars of issue 3 / the README: (name, case, [(metric, op, bound)]).
BARS = (
    ("B64 K4 V151936 f32 dense, no filters",
     Case(64, 4, 151936, "float32", "rejection", "dense", "none"),
     [("x_floor", "<=", 1.0), ("speedup_torch", ">=", 30.0)]),
    ("B64 K4 V151936 f32 dense, top_k=50 top_p=0.9",
     Case(64, 4, 151936, "float32", "rejection", "dense", "topk50-topp0.9"),
     [("x_floor", "<=", 2.0)]),
    ("B64 K4 V151936 f32 coupled, no filters",
     Case(64, 4, 151936, "float32", "coupled", "none", "none"),
     [("x_floor", "<=", 2.0)]),
    ("B1 K5 V49152 f32 no draft probs (Python call included)",
     Case(1, 5, 49152, "float32", "rejection", "none", "none"),
     [("x_floor", "<=", 3.0)]),
    ("B256 K8 V32000 f32 dense, no filters",
     Case(256, 8, 32000, "float32", "rejection", "dense", "none"),
     [("x_floor", "<=", 1.0)]),
)


# ---------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------

LOGIT_SCALE = 2.0  # spread of the flat tail of a row
DRAFT_NOISE = 0.6  # the drafter's logits = target + DRAFT_NOISE * randn (acceptance ~0.6-0.7)
CHUNK = 64  # rows generated at a time (bounds the temporary memory)


@dataclasses.dataclass
class Inputs:
    case: Case
    logits: np.ndarray  # (rows, V) float32, or bfloat16 / float16
    tokens: np.ndarray  # (N,) int32, sampled from q (or its argmax for one-hot drafts)
    num_draft: np.ndarray  # (B,) int32
    q_dense: np.ndarray | None  # (N, V) float32
    q_ids: np.ndarray | None  # (N, min(SPARSE_K, V)) int32
    q_vals: np.ndarray | None  # (N, min(SPARSE_K, V)) float32
    seed: np.ndarray  # (B,) uint64
    position: np.ndarray  # (B,) int64

    @property
    def draft_probs(self):
        import specfast

        if self.q_dense is not None:
            return self.q_dense
        if self.q_ids is not None:
            return specfast.SparseProbs(self.q_ids, self.q_vals)
        return None

    @property
    def floor_array(self) -> np.ndarray:
        """What numpy.max reads: the logits, or their int16 view for 16-bit floats."""
        return self.logits if self.logits.dtype == np.float32 else self.logits.view(np.int16)


def _row_logits(rng, n, vocab):
    """Rows like a language model's: a flat tail, a head of a few likely tokens, and one
    row in four sharply peaked (one token near probability 1)."""
    x = rng.standard_normal((n, vocab), dtype=np.float32)
    x *= LOGIT_SCALE
    heads = rng.integers(0, vocab, (n, 4))
    boost = np.sort(rng.uniform(4.0, 13.0, (n, 4)), axis=1)[:, ::-1].astype(np.float32)
    boost[:, 0] += np.where(rng.random(n) < 0.25, 10.0, 0.0).astype(np.float32)
    np.add.at(x, (np.arange(n)[:, None], heads), boost)
    return x


def _softmax(x):
    x = x - x.max(axis=1, keepdims=True)
    np.exp(x, out=x)
    x /= x.sum(axis=1, keepdims=True)
    return x


def _sample_rows(rng, q):
    """One token per row of probabilities q (inverse CDF)."""
    c = np.cumsum(q, axis=1, dtype=np.float64)
    u = rng.random(q.shape[0]) * c[:, -1]
    return np.minimum((c < u[:, None]).sum(axis=1), q.shape[1] - 1).astype(np.int32)


def _np_dtype(name):
    if name == "bfloat16":
        import ml_dtypes  # numpy's bfloat16

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def make_inputs(case: Case, seed: int = 0) -> Inputs:
    """Synthetic target logits and drafts for ``case``.

    Target rows come from :func:`_row_logits`. The drafter's logits at draft node (b, d)
    are the target's row (b, d) plus noise (``source="correlated"``, acceptance ~0.6-0.7)
    or an independent row (``"independent"``, acceptance near 0); q is their softmax. The
    drafted token is sampled from q ("dense"), from q's top-8 renormalised ("sparse"), is
    q's argmax (one-hot drafts, "none"), or, for coupled verification, is the drafter's
    own Gumbel-max token with the verifier's noise (:func:`specfast.sample` with
    ``method="coupled"`` at the same seed and position). With filters, the drafter uses
    the same top_k / top_p as the target.
    """
    import specfast

    rng = np.random.default_rng(seed)
    B, K, V = case.batch, case.draft_len, case.vocab
    logits = np.empty((case.rows, V), _np_dtype(case.dtype))
    tokens = np.empty(case.nodes, np.int32)
    dense = case.draft == "dense" and case.method == "rejection"
    q_dense = np.empty((case.nodes, V), np.float32) if dense else None
    sparse = case.draft == "sparse" and case.method == "rejection"
    sk = min(SPARSE_K, V)  # ids per sparse row
    q_ids = np.empty((case.nodes, sk), np.int32) if sparse else None
    q_vals = np.empty((case.nodes, sk), np.float32) if sparse else None
    seeds = rng.integers(0, 2**63, B, dtype=np.uint64)
    positions = rng.integers(0, 2**40, B).astype(np.int64)
    per = max(1, CHUNK // (K + 1))  # requests per chunk
    for b0 in range(0, B, per):
        b1 = min(B, b0 + per)
        rows = _row_logits(rng, (b1 - b0) * (K + 1), V)
        logits[b0 * (K + 1):b1 * (K + 1)] = rows  # rounded to the dtype
        if K == 0:
            continue
        # Target rows that the drafts are verified at: row (b, d) for d < K.
        at = rows.reshape(b1 - b0, K + 1, V)[:, :K].reshape(-1, V)
        if case.source == "correlated":
            dl = at + DRAFT_NOISE * rng.standard_normal(at.shape, dtype=np.float32)
        else:
            dl = _row_logits(rng, at.shape[0], V)
        n0, n1 = b0 * K, b1 * K
        if case.method == "coupled":
            seed_rows = np.repeat(seeds[b0:b1], K)
            pos_rows = (np.repeat(positions[b0:b1], K)
                        + np.tile(np.arange(K, dtype=np.int64), b1 - b0))
            tokens[n0:n1] = specfast.sample(dl, seed=seed_rows, position=pos_rows,
                                            method="coupled", **case.params)
            continue
        # The drafter samples with the same filters as the target.
        q = specfast.probs(dl, **case.params) if case.params else _softmax(dl)
        if case.draft == "none":
            tokens[n0:n1] = q.argmax(axis=1)
        elif case.draft == "dense":
            q_dense[n0:n1] = q
            tokens[n0:n1] = _sample_rows(rng, q)
        else:
            top = np.argpartition(q, -sk, axis=1)[:, -sk:]
            vals = np.take_along_axis(q, top, axis=1)
            vals /= vals.sum(axis=1, keepdims=True)
            q_ids[n0:n1], q_vals[n0:n1] = top, vals
            pick = _sample_rows(rng, vals)
            tokens[n0:n1] = top[np.arange(top.shape[0]), pick]
    return Inputs(case, logits, tokens, np.full(B, K, np.int32), q_dense, q_ids, q_vals,
                  seeds, positions)


# ---------------------------------------------------------------------------------------
# The three implementations
# ---------------------------------------------------------------------------------------


def specfast_call(inp: Inputs) -> Callable:
    import specfast

    c = inp.case
    q = inp.draft_probs
    kw = dict(draft_probs=q, seed=inp.seed, position=inp.position, method=c.method, **c.params)
    return lambda: specfast.verify(inp.logits, inp.tokens, inp.num_draft, **kw)


def floor_call(inp: Inputs) -> Callable:
    a = inp.floor_array
    return lambda: np.max(a, axis=1)


def floor_all_call(inp: Inputs, pool: ThreadPoolExecutor, threads: int) -> Callable:
    """numpy.max over the same logits, their rows split across ``threads`` threads
    (numpy releases the GIL): the floor of a verify that runs on as many."""
    parts = np.array_split(inp.floor_array, threads)
    return lambda: list(pool.map(lambda a: np.max(a, axis=1), parts))


def torch_tensors(inp: Inputs) -> dict:
    """The inputs as torch tensors (zero-copy views of the numpy arrays)."""
    import torch

    if inp.logits.dtype == np.float32 or inp.logits.dtype == np.float16:
        logits = torch.from_numpy(inp.logits)
    else:
        logits = torch.from_numpy(inp.logits.view(np.int16)).view(torch.bfloat16)
    q = None
    if inp.q_dense is not None:
        q = torch.from_numpy(inp.q_dense)
    elif inp.q_ids is not None:
        q = (torch.from_numpy(inp.q_ids), torch.from_numpy(inp.q_vals))
    return dict(target_logits=logits, draft_tokens=torch.from_numpy(inp.tokens),
                num_draft=torch.from_numpy(inp.num_draft), draft_probs=q)


def torch_call(inp: Inputs, seed: int = 0) -> Callable:
    import torch

    from ._torch_reference import torch_verify

    t = torch_tensors(inp)
    g = torch.Generator().manual_seed(seed)
    kw = dict(method=inp.case.method, generator=g, **inp.case.params)
    return lambda: torch_verify(**t, **kw)


def make_call(impl: str, inp: Inputs) -> Callable:
    return {"specfast": specfast_call, "numpy.max": floor_call, "torch": torch_call}[impl](inp)


def check_result(inp: Inputs, tokens, num_accepted) -> bool:
    """A verify result is well formed: accepted tokens are the drafts, then one token."""
    tokens, n = np.asarray(tokens), np.asarray(num_accepted)
    K, V = inp.case.draft_len, inp.case.vocab
    if tokens.shape != (inp.case.batch, K + 1) or n.min() < 0 or n.max() > K:
        return False
    drafts = inp.tokens.reshape(inp.case.batch, K)
    col = np.arange(K + 1)[None, :]
    acc = col[:, :K] < n[:, None]
    final = tokens[np.arange(len(n)), n]
    return bool(np.all(np.where(acc, tokens[:, :K] == drafts, True))
                and np.all((final >= 0) & (final < V))
                and np.all(np.where(col > n[:, None], tokens == -1, True)))


def bytes_read(impl: str, inp: Inputs, num_accepted) -> int:
    """Bytes an implementation must read from memory (a model, not a counter).

    numpy.max and torch read every target row (torch also, of a dense q, the row of each
    rejection, for its residual); specfast reads only the rows each request reaches
    (num_accepted + 1). The cases are chains, so specfast draws a rejection's residual by
    tries that read q at a few tokens; the whole q row is read only where 16 tries keep
    no token, which is not counted. q read at the drafted tokens is not counted either.
    """
    c = inp.case
    row = c.vocab * c.itemsize
    if impl == "numpy.max":
        return c.rows * row
    if impl == "torch":
        rejected = int((np.asarray(num_accepted) < c.draft_len).sum())
        return c.rows * row + (rejected * c.vocab * 4 if inp.q_dense is not None else 0)
    return int((np.asarray(num_accepted, np.int64) + 1).sum()) * row


# ---------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------


def keep_freed_memory() -> bool:
    """Tells glibc's malloc to serve large blocks from its heap and keep what is freed
    (no mmap per block, no trim), as the allocators that torch's CPU tuning guides
    recommend (jemalloc, tcmalloc) do. Otherwise each torch temporary over 32 MiB is
    mapped afresh and page-faulted on every call: the allocator's cost, not the
    algorithm's (it made the torch peer 2.0x-2.9x slower on the bar cases). specfast and
    numpy.max allocate nothing large per call. False where malloc is not glibc's."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


def measure(calls: dict, repeats: int = 7, min_time: float = 0.05) -> dict:
    """Median seconds per call of each callable, interleaved: round r times every
    implementation once (each sample a loop of n calls lasting >= min_time)."""
    loops = {}
    for name, fn in calls.items():
        fn()  # warm up (first-touch, thread pool start, caches)
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        loops[name] = max(1, min(10000, math.ceil(min_time / max(dt, 1e-7))))
    samples = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            n = loops[name]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append((time.perf_counter() - t0) / n)
    return {name: statistics.median(s) for name, s in samples.items()}


def run_case(case: Case, impls=IMPLS, repeats=7, min_time=0.05, seed=0) -> dict:
    """Times ``case``; returns one row of the table (times in seconds)."""
    inp = make_inputs(case, seed)
    calls = {}
    for impl in impls:
        try:
            calls[impl] = make_call(impl, inp)
        except ImportError:  # torch not installed
            continue
    row = dict(dataclasses.asdict(case), id=case.id, repeats=repeats)
    first = {}
    if "specfast" in calls:
        r = calls["specfast"]()
        first["specfast"] = r
        row["mean_accepted"] = float(np.mean(r.num_accepted))
        row["correct_specfast"] = check_result(inp, r.tokens, r.num_accepted)
    if "torch" in calls:
        r = first["torch"] = calls["torch"]()
        row["mean_accepted_torch"] = float(r.num_accepted.float().mean())
        row["correct_torch"] = check_result(inp, r.tokens.numpy(), r.num_accepted.numpy())
    threads = specfast_threads()
    pool = None
    if "specfast" in calls and "numpy.max" in calls and threads > 1:
        pool = ThreadPoolExecutor(threads)
        calls["numpy.max-all"] = floor_all_call(inp, pool, threads)
    times = measure(calls, repeats, min_time)
    if pool is not None:
        pool.shutdown()
        row["time_numpy.max-all"] = times.pop("numpy.max-all")
        row["x_floor_all"] = times["specfast"] / row["time_numpy.max-all"]
    for impl, t in times.items():
        row[f"time_{impl}"] = t
        nb = bytes_read(impl, inp, first[impl].num_accepted if impl in first else None)
        row[f"bytes_{impl}"] = nb
        row[f"gbps_{impl}"] = nb / t / 1e9
    if "specfast" in times and "numpy.max" in times:
        row["x_floor"] = times["specfast"] / times["numpy.max"]
    if "specfast" in times and "torch" in times:
        row["speedup_torch"] = times["torch"] / times["specfast"]
    return row


# ---------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------


def _ms(t):
    if t is None:
        return "-"
    return f"{t * 1e3:.3f}" if t < 0.01 else f"{t * 1e3:.1f}"


def specfast_threads() -> int:
    import specfast

    return specfast.get_num_threads()


def format_table(rows) -> str:
    head = ("case", "specfast ms", "numpy.max ms", "torch ms", "x floor", "x all-core",
            "vs torch", "accepted", "GB/s", "floor GB/s")
    lines = []
    for r in rows:
        lines.append((
            r["id"], _ms(r.get("time_specfast")), _ms(r.get("time_numpy.max")),
            _ms(r.get("time_torch")),
            f"{r['x_floor']:.2f}x" if "x_floor" in r else "-",
            f"{r['x_floor_all']:.2f}x" if "x_floor_all" in r else "-",
            f"{r['speedup_torch']:.1f}x" if "speedup_torch" in r else "-",
            f"{r['mean_accepted']:.2f}" if "mean_accepted" in r else "-",
            f"{r['gbps_specfast']:.1f}" if "gbps_specfast" in r else "-",
            f"{r['gbps_numpy.max']:.1f}" if "gbps_numpy.max" in r else "-",
        ))
    widths = [max(len(h), *(len(l[i]) for l in lines)) if lines else len(h)
              for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(  # noqa: E731
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    out = [fmt(head), fmt(["-" * w for w in widths])]
    out += [fmt(l) for l in lines]
    return "\n".join(out)


def machine() -> dict:
    import specfast

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = dict(cpu=model, cores=os.cpu_count(), python=platform.python_version(),
                numpy=np.__version__, specfast=specfast.__version__,
                simd=specfast.simd_level(), specfast_threads=specfast.get_num_threads())
    if hasattr(os, "getloadavg"):  # other jobs on the machine make the times noisy
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    try:
        import torch

        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
    except ImportError:
        pass
    return info


def save_plot(rows, path: str) -> None:
    """Time against batch size, one panel per (K, V, dtype, method, q, filters)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict = {}
    for r in rows:
        key = r["id"].split("-", 1)[1]  # the id without "B<batch>"
        groups.setdefault(key, []).append(r)
    n = len(groups)
    cols = min(3, n)
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.8 * nrows), squeeze=False)
    for ax, (key, rs) in zip(axes.flat, groups.items()):
        rs = sorted(rs, key=lambda r: r["batch"])
        for impl, style in (("specfast", "o-"), ("numpy.max", "s--"), ("torch", "^-")):
            pts = [(r["batch"], r[f"time_{impl}"] * 1e3) for r in rs if f"time_{impl}" in r]
            if pts:
                ax.plot(*zip(*pts), style, label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel("time per call (ms)")
        ax.set_title(key, fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.suptitle("specfast.verify vs numpy.max (memory floor) vs torch, medians", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def check_bars(rows) -> list:
    """[(name, passed, text)] for each bar of BARS, from the row of its case (passed
    None: no such row, the case was skipped)."""
    by_id = {r["id"]: r for r in rows}
    out = []
    for name, case, checks in BARS:
        r = by_id.get(case.id)
        if r is None:
            out.append((name, None, "not run"))
            continue
        parts, ok = [], True
        for metric, op, bound in checks:
            v = r.get(metric)
            good = v is not None and (v <= bound if op == "<=" else v >= bound)
            ok &= good
            shown = "n/a" if v is None else f"{v:.2f}x"
            parts.append(f"{metric} {shown} (bar {op} {bound:g}x)")
        out.append((name, ok, "; ".join(parts)))
    return out


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------


CASE_DEFAULTS = dict(batch=[1, 16, 64], draft_len=[4], vocab=[32000, 151936], dtype=["float32"],
                     method=["rejection"], draft_probs=["dense"], filters=["none"],
                     source=["correlated"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Time specfast.verify against numpy.max and torch (medians)."
    a = parser.add_argument
    a("--bars", action="store_true",
      help="run the five speed targets' cases (README, Benchmarks) and print pass/fail "
           "against each (exit status stays 0); takes no case options")
    a("--full", action="store_true",
      help="the whole grid of cases (long); takes no case options")
    # The options of the cases (a grid: every combination). None where not
    # given, so that --bars and --full can refuse them (_case_options).
    def case(flag, text, **kw):
        shown = " ".join(map(str, CASE_DEFAULTS[flag[2:].replace("-", "_")]))
        a(flag, nargs="+", default=None, help=f"{text} (default: {shown})", **kw)

    case("--batch", "requests", type=count(1), metavar="B")
    case("--draft-len", "draft tokens per request", type=count(0, _MAX_DRAFT), metavar="K")
    case("--vocab", "vocabulary", type=count(1, _MAX_VOCAB), metavar="V")
    case("--dtype", "of the target logits", choices=["float32", "bfloat16", "float16"])
    case("--method", "verification method", choices=["rejection", "coupled"])
    case("--draft-probs", "the kind of q for rejection (coupled always runs without q)",
         choices=["none", "dense", "sparse"])
    case("--filters", "none, top_k=50 and top_p=0.9, or top_p=0.9 alone", choices=list(FILTERS))
    case("--source", "the drafter: correlated with the target, or independent of it",
         choices=["correlated", "independent"])
    a("--impl", nargs="+", default=None, choices=list(IMPLS),
      help="what to time (default: all; torch where it is installed)")
    a("--repeats", type=count(1), default=7, help="samples per implementation (median)")
    a("--min-time", type=number(0), default=0.05,
      help="seconds per sample; short calls are looped")
    a("--threads", type=count(0), default=None,
      help="specfast threads (default and 0: one per core)")
    a("--torch-threads", type=count(1), default=None, help="torch threads (default: torch's)")
    a("--max-gb", type=number(0, strict=True), default=MAX_GB,
      help="skip cases with larger inputs")
    a("--seed", type=count(0), default=0, help="of the synthetic inputs")
    a("--system-malloc", action="store_true",
      help="leave glibc's malloc as it is: torch's large temporaries are then mapped and "
           "page-faulted on every call")
    a("--json", metavar="PATH", help="save the table (and the machine) as JSON")
    a("--plot", metavar="PATH", help="save a PNG of time against batch size")
    a("--no-progress", action="store_true", help="no progress bar")


def _cases(args) -> list:
    if args.bars:
        return [c for _n, c, _ in BARS]
    if args.full:
        return grid()
    mk = []
    for m in args.method:
        if m == "coupled":
            mk.append(("coupled", "none"))
        else:
            mk += [("rejection", k) for k in args.draft_probs]
    return grid(args.batch, args.draft_len, args.vocab, args.dtype, mk, args.filters,
                args.source)


def _case_options(args) -> None:
    """Fills the case options not given; --bars and --full take none."""
    given = [name for name in CASE_DEFAULTS if getattr(args, name) is not None]
    fixed = "--bars" if args.bars else "--full" if args.full else None
    if args.bars and args.full:
        raise SystemExit("specfast bench: give --bars or --full, not both")
    if fixed and given:
        raise SystemExit(f"specfast bench: {fixed} runs fixed cases; drop "
                         + ", ".join("--" + name.replace("_", "-") for name in given))
    for name in CASE_DEFAULTS:
        if getattr(args, name) is None:
            setattr(args, name, CASE_DEFAULTS[name])


def _missing_packages(args) -> None:
    """Packages the options need, said before the timings (not after them)."""
    need = {"matplotlib": args.plot, "ml_dtypes": "bfloat16" in args.dtype,
            "torch": args.torch_threads is not None or "torch" in (args.impl or ())}
    why = {"matplotlib": "--plot", "ml_dtypes": "--dtype bfloat16",
           "torch": "--impl torch / --torch-threads"}
    for name, needed in need.items():
        if needed and importlib.util.find_spec(name) is None:
            raise SystemExit(f"{why[name]} needs {name}: pip install {name}")


def run(args) -> int:
    import specfast

    _case_options(args)
    _missing_packages(args)
    if args.threads is not None:
        specfast.set_num_threads(args.threads)
    if args.torch_threads is not None:
        import torch

        torch.set_num_threads(args.torch_threads)
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.access(folder, os.W_OK):  # said before the timings, not after
            raise SystemExit(f"{option} {path}: cannot write in {folder}")
    cases = _cases(args)
    skipped = [c for c in cases if c.input_bytes > args.max_gb * 1e9]
    cases = [c for c in cases if c.input_bytes <= args.max_gb * 1e9]
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    bar = None
    if tqdm is not None and not args.no_progress:
        bar = tqdm(total=len(cases), unit="case", file=sys.stderr, dynamic_ncols=True)
    kept = not args.system_malloc and keep_freed_memory()  # said wrong options first
    rows = []
    for case in cases:
        if bar is not None:
            bar.set_postfix_str(case.id)
        rows.append(run_case(case, args.impl or IMPLS, args.repeats, args.min_time, args.seed))
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    info = dict(machine(), malloc_keeps_freed_memory=kept)
    print(f"# {info['cpu']}, {info['cores']} cores; specfast {info['specfast']} "
          f"({info['simd']}, {info['specfast_threads']} threads), numpy {info['numpy']}"
          + (f", torch {info['torch']} ({info['torch_threads']} threads)" if "torch" in info
             else "")
          + (f"; load average {info['load_average'][0]}" if "load_average" in info else "")
          + ("; malloc keeps freed memory" if kept else "; malloc as the system has it"))
    print(f"# medians of {args.repeats}, interleaved; x floor = specfast / numpy.max (1 thread), "
          f"x all-core = specfast / numpy.max split over {info['specfast_threads']} threads, "
          "vs torch = torch / specfast; accepted = mean accepted drafts (specfast); "
          "GB/s = bytes the call must read / time")
    print(format_table(rows))
    for c in skipped:
        print(f"skipped {c.id}: inputs {c.input_bytes / 1e9:.1f} GB > --max-gb {args.max_gb}")
    if args.bars:
        print()
        for name, ok, text in check_bars(rows):
            print(f"{'SKIPPED' if ok is None else 'PASS' if ok else 'FAIL'}  {name}: {text}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "rows": rows}, f, indent=1)
    if args.plot:
        save_plot(rows, args.plot)
    return 0
