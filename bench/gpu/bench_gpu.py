"""GPU benchmark of specfast's CUDA backend (run by bench/gpu/run.sh).

Peers on the same inputs, in the same run:
- ``torch.amax`` over the target logits: one read of every row, the HBM floor;
- specfast CUDA ``verify`` (this backend);
- the torch implementation of the same algorithm (specfast._torch_reference).
Cases: the issue's bar (B=256, K=4, V=151936, bfloat16, rejection, dense draft
probabilities) with a drafter close to the target (high acceptance) and one far from
it (low acceptance), plus coupled and one-hot drafts. Each case also checks that the
CUDA tokens equal the CPU backend's on the same inputs. Writes JSON and a text table.
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

import specfast as sf
from specfast import _cuda
from specfast._torch_reference import torch_verify


def timeit(fn, iters=20, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)  # microseconds
    return float(np.median(times)), float(np.min(times))


def make_case(B, K, V, dtype, closeness, gen):
    rows = B * (K + 1)
    logits = (torch.randn(rows, V, device="cuda", generator=gen) * 2.5).to(dtype)
    idx = torch.arange(B, device="cuda")[:, None] * (K + 1) + torch.arange(K, device="cuda")
    target_rows = logits[idx.reshape(-1)].float()
    noise = torch.randn(target_rows.shape, device="cuda", generator=gen) * 2.5
    q = torch.softmax(closeness * target_rows + (1 - closeness) * noise, dim=-1)
    tokens = torch.multinomial(q, 1, generator=gen)[:, 0].to(torch.int32)
    num_draft = torch.full((B,), K, dtype=torch.int32, device="cuda")
    return logits, tokens, num_draft, q.contiguous()


def cpu_tokens(logits, tokens, num_draft, q, method, kind, seed):
    x = logits.float().cpu().numpy() if logits.dtype != torch.bfloat16 else logits.cpu()
    r = sf.verify(x, tokens.cpu().numpy(), num_draft.cpu().numpy(),
                  draft_probs=None if kind == "none" else q.cpu().numpy(),
                  method=method, seed=seed, position=100)
    return np.asarray(r.tokens), np.asarray(r.num_accepted)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench/gpu/results")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="the bar case per cluster size / staging")
    ap.add_argument("--only", type=int, default=0, help="run only the first N cases")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    K, V = 4, 151936
    results = []
    cases = [
        ("bar: rejection dense, close drafter", 256, "rejection", "dense", 0.9),
        ("rejection dense, far drafter", 256, "rejection", "dense", 0.0),
        ("rejection one-hot drafts", 256, "rejection", "none", 0.9),
        ("coupled", 256, "coupled", "none", 0.9),
        ("B=16 rejection dense, close", 16, "rejection", "dense", 0.9),
        ("B=1 rejection dense, close", 1, "rejection", "dense", 0.9),
    ]
    for name, B, method, kind, closeness in cases[:args.only or None]:
        logits, tokens, nd, q = make_case(B, K, V, torch.bfloat16, closeness, gen)
        dp = None if kind == "none" else q
        out = {"tokens": torch.empty((B, K + 1), dtype=torch.int32, device="cuda"),
               "num_accepted": torch.empty(B, dtype=torch.int32, device="cuda"),
               "accepted_nodes": torch.empty((B, K), dtype=torch.int32, device="cuda"),
               "status": torch.empty(B, dtype=torch.int32, device="cuda")}

        def run_sf():
            return _cuda.verify(logits, tokens, nd, draft_probs=dp, method=method, seed=7,
                                position=100, max_draft=K, out=out, check=False)

        def run_amax():
            return torch.amax(logits, dim=-1)

        def run_torch():
            return torch_verify(logits, tokens, nd, draft_probs=dp, method=method)

        t0 = time.time()
        r = _cuda.verify(logits, tokens, nd, draft_probs=dp, method=method, seed=7,
                         position=100, max_draft=K, check=True)
        ct, ca = cpu_tokens(logits, tokens, nd, q, method, kind, 7)
        correct = bool(np.array_equal(ct, r.tokens.cpu().numpy()) and
                       np.array_equal(ca, r.num_accepted.cpu().numpy()))
        t_amax = timeit(run_amax, args.iters)
        t_sf = timeit(run_sf, args.iters)
        t_torch = timeit(run_torch, max(3, args.iters // 4), warmup=1)
        mean_acc = float(r.num_accepted.float().mean())
        row = dict(case=name, method=method, kind=kind, B=B, K=K, V=V, dtype="bfloat16",
                   amax_us=t_amax[0], specfast_us=t_sf[0], torch_us=t_torch[0],
                   specfast_min_us=t_sf[1], ratio_vs_amax=t_sf[0] / t_amax[0],
                   speedup_vs_torch=t_torch[0] / t_sf[0], mean_accepted=mean_acc,
                   logits_bytes=logits.numel() * 2, correct_vs_cpu=correct,
                   check_s=time.time() - t0)
        results.append(row)
        print(json.dumps(row), flush=True)
    sweep = []
    if args.sweep:
        # The bar case under other cluster sizes, without staging and without
        # the bf16 e table (tuning).
        logits, tokens, nd, q = make_case(256, K, V, torch.bfloat16, 0.9, gen)
        amax = timeit(lambda: torch.amax(logits, dim=-1), args.iters)[0]
        knobs = ("SPECFAST_CUDA_CLUSTER", "SPECFAST_CUDA_STAGE", "SPECFAST_CUDA_ETAB")
        for cluster in ("1", "2", "4", "8"):
            for stage in ("1", "0"):
                for etab in ("1", "0"):
                    for k, v in zip(knobs, (cluster, stage, etab)):
                        os.environ[k] = v
                    t = timeit(lambda: _cuda.verify(logits, tokens, nd, draft_probs=q, seed=7,
                                                    position=100, max_draft=K, check=False),
                               args.iters)[0]
                    row = dict(cluster=int(cluster), stage=int(stage), etab=int(etab), us=t,
                               x_amax=t / amax)
                    sweep.append(row)
                    print(json.dumps(row), flush=True)
        for k in knobs:
            os.environ.pop(k)
    with open(os.path.join(args.out, "bench_gpu.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), results=results, sweep=sweep), f,
                  indent=1)
    lines = [f"{'case':38s} {'amax us':>9s} {'specfast':>9s} {'torch':>9s} "
             f"{'x amax':>7s} {'vs torch':>8s} {'acc':>5s} ok"]
    for r in results:
        lines.append(f"{r['case']:38s} {r['amax_us']:9.1f} {r['specfast_us']:9.1f} "
                     f"{r['torch_us']:9.1f} {r['ratio_vs_amax']:7.2f} "
                     f"{r['speedup_vs_torch']:8.1f} {r['mean_accepted']:5.2f} "
                     f"{r['correct_vs_cpu']}")
    bar = results[0]
    lines.append(f"BAR (<= 1.2x amax, >= 10x torch): ratio {bar['ratio_vs_amax']:.2f}, "
                 f"speedup {bar['speedup_vs_torch']:.1f} -> "
                 f"{'PASS' if bar['ratio_vs_amax'] <= 1.2 and bar['speedup_vs_torch'] >= 10 else 'FAIL'}")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "bench_gpu.txt"), "w") as f:
        f.write(text + "\n")
    # A case whose tokens differ from the CPU's fails the run, whatever its speed.
    return 0 if all(r["correct_vs_cpu"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
