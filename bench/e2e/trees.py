"""Trees against chains with the same drafter and the same drafted tokens per step.

For each built-in workload and each budget k, greedy decoding of the target
with the n-gram drafter proposing k tokens every step as one chain
(``sf_chain_k``), and as a tree of k nodes merging several earlier occurrences
(``sf_tree_k``, :meth:`specfast.drafters.NgramDrafter.tree`); the target
verifies either in one forward of k + 1 tokens (a tree attention mask for the
tree). Reported: tokens per target step (deterministic under greedy decoding),
tokens/s (median of the rounds, interleaved), and whether the output equals
plain decoding's. Writes ``trees.json`` and ``trees.md`` under ``--out``.

    python bench/e2e/trees.py --threads 2 --budgets 4 8 16 --rounds 1
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys

from results_io import save


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="model folder or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--max-new", type=int, default=256, help="cap on each workload's max_new_tokens")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--kinds", nargs="*", default=None, help="workload kinds (default: all)")
    ap.add_argument("--budgets", type=int, nargs="*", default=[4, 8, 16],
                    help="drafted tokens per step")
    ap.add_argument("--branches", type=int, default=4, help="continuations a tree merges")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results"))
    args = ap.parse_args(argv)

    import torch

    from specfast import workloads
    from specfast.adapters.hf import HFModel, smollm2_path
    from specfast.decoder import SpeculativeDecoder
    from specfast.drafters import NgramDrafter

    if args.threads:
        torch.set_num_threads(args.threads)
    target = HFModel.from_pretrained(args.target or smollm2_path())
    decoders = {"sf_plain": SpeculativeDecoder(target, None)}
    for k in args.budgets:
        decoders[f"sf_chain_{k}"] = SpeculativeDecoder(target, NgramDrafter(), k=k)
        decoders[f"sf_tree_{k}"] = SpeculativeDecoder(
            target, NgramDrafter(branches=args.branches), k=k)
    decoders["sf_plain"].generate([1, 2, 3], 4)  # warm up torch

    rows = workloads.load(kinds=args.kinds)
    cells = {w["name"]: {name: [] for name in decoders} for w in rows}
    for rnd in range(args.rounds):
        for w in rows:
            ids = target.encode(w["messages"])
            n = min(w["max_new_tokens"], args.max_new)
            for name, dec in decoders.items():
                g = dec.generate(ids, n)
                m = g.metrics
                cells[w["name"]][name].append(
                    {"tokens": g.tokens, "seconds": m.t_total, "steps": m.target_steps,
                     "tokens_per_step": m.mean_accepted_length, "draft_n": m.draft_n})
            print(f"round {rnd + 1} {w['name']}: " + " ".join(
                f"{k}={v[-1]['tokens_per_step']:.2f}" for k, v in cells[w["name"]].items()),
                flush=True)

    results = {"machine": {"python": platform.python_version(), "torch": torch.__version__,
                           "threads": torch.get_num_threads(), "cpus": os.cpu_count()},
               "target": target.name, "branches": args.branches, "budgets": args.budgets,
               "rounds": args.rounds, "max_new_cap": args.max_new, "workloads": []}
    for w in rows:
        runs = cells[w["name"]]
        ref = runs["sf_plain"][0]["tokens"]
        out = {"name": w["name"], "kind": w["kind"], "runs": {}}
        for name, rs in runs.items():
            secs = statistics.median(r["seconds"] for r in rs)
            out["runs"][name] = {
                "n_tokens": len(rs[0]["tokens"]), "target_steps": rs[0]["steps"],
                "tokens_per_step": rs[0]["tokens_per_step"],
                "drafted_per_step": rs[0]["draft_n"] / max(1, rs[0]["steps"]),
                "tokens_per_s": len(rs[0]["tokens"]) / secs,
                "identical_to_plain": all(r["tokens"] == ref for r in rs)}
        results["workloads"].append(out)
    text = table(results)
    save(args.out, "trees", results, text)
    print(text)
    return 0


def table(results) -> str:
    head = "| workload | kind |"
    rule = "|---|---|"
    for k in results["budgets"]:
        head += f" chain {k}: tok/step | tree {k}: tok/step | tree / chain, tok/s |"
        rule += "---|---|---|"
    lines = [head + " all identical to plain |", rule + "---|"]
    for w in results["workloads"]:
        runs = w["runs"]
        line = f"| {w['name']} | {w['kind']} |"
        for k in results["budgets"]:
            c, t = runs[f"sf_chain_{k}"], runs[f"sf_tree_{k}"]
            line += (f" {c['tokens_per_step']:.2f} | {t['tokens_per_step']:.2f} |"
                     f" {t['tokens_per_s'] / c['tokens_per_s']:.2f}x |")
        same = all(r["identical_to_plain"] for r in runs.values())
        lines.append(line + f" {'yes' if same else 'NO'} |")
    m = results["machine"]
    lines += ["", f"Greedy, {results['target']}, n-gram drafter, every step drafts the budget "
              f"(fixed k) as a chain or as a tree merging up to {results['branches']} "
              f"continuations; max_new_tokens capped at {results['max_new_cap']}; tokens/s "
              f"median of {results['rounds']} round(s); torch threads {m['threads']} of "
              f"{m['cpus']} CPUs."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
