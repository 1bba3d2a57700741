"""End-to-end speculative decoding benchmark: one model, one machine, one run.

Peers side by side over the built-in workloads (a copy of ``shared/workloads``):

- ``hf_plain``: transformers ``generate`` (greedy);
- ``hf_lookup_{k}`` / ``hf_lookup_{k}_n{n}``: transformers' own prompt lookup
  (``prompt_lookup_num_tokens`` k, ``max_matching_ngram_size`` n, 2 by default),
  over k up to 32 (specfast's n-gram drafts go that far) and n 2 and 4, and
  ``hf_lookup_best`` the best of them;
- ``hf_assisted``: transformers assisted generation with ``--assistant`` (optional);
- ``llama_cpp`` plain and with its prompt-lookup draft model, when
  llama-cpp-python is installed;
- ``sf_plain``: specfast's loop with k = 0 (the baseline speculation must beat);
- ``sf_ngram``: specfast with the n-gram drafter, adaptive k;
- ``sf_model``: specfast with a draft model (``--draft-model``, optional).

Plus the exactness bars (greedy identical to sf_plain and to hf_plain; coupled
sampling identical to plain coupled sampling for two drafters) and the batch
bar (8 prompts in one batch vs 8 single runs). Writes ``results.json``,
``results.md`` and ``speedup.png`` under ``--out``.

Every method runs once per round on every workload, interleaved, for
``--rounds`` rounds; a cell is the median of its rounds (all times are kept in
``results.json``), so load on the machine cannot favour one side, and a ratio
is the median of the rounds' own ratios (each from one round, side by side).
One decoder per method serves every round and workload, as in a server: the
draft length controller's measured costs carry over.

    python bench/e2e/run.py --threads 2 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

from results_io import save


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def hf_generate(target, ids, max_new, **kw):
    import torch

    model = target.model
    x = torch.tensor([ids])
    with torch.inference_mode():
        out, dt = _timed(lambda: model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
            pad_token_id=target.eos_token_ids[0], **kw))
    gen = out[0, len(ids):].tolist()
    while gen and gen[-1] in target.eos_token_ids:
        gen.pop()
    return {"tokens": gen, "seconds": dt}


def llama_generate(llm, ids, max_new, eos):
    """llama-cpp-python's own greedy loop (plain, or with the prompt-lookup draft
    model the Llama object was built with), ending at any end-of-generation token
    in ``eos`` as specfast's loop does."""
    def run():
        llm.reset()
        out = []
        for t in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if t in eos:
                break
            out.append(t)
            if len(out) == max_new:  # before the generator's next forward
                break
        return out
    gen, dt = _timed(run)
    return {"tokens": gen, "seconds": dt}


def sf_generate(dec, ids, max_new, **kw):
    g, dt = _timed(lambda: dec.generate(ids, max_new, **kw))
    m = g.metrics
    return {"tokens": g.tokens, "seconds": dt, "acceptance": m.acceptance_rate,
            "tokens_per_step": m.mean_accepted_length, "target_steps": m.target_steps,
            "time_split": {"prefill": m.t_prefill, "draft": m.t_draft, "target": m.t_target,
                           "verify": m.t_verify, "other": m.t_other},
            "k_chosen": m.k_chosen}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="model folder or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--max-new", type=int, default=None,
                    help="cap on each workload's max_new_tokens (default: none)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--kinds", nargs="*", default=None, help="workload kinds (default: all)")
    ap.add_argument("--lookup", type=int, nargs="*", default=[3, 10, 20, 32],
                    help="transformers' prompt_lookup_num_tokens values to try")
    ap.add_argument("--lookup-ngram", type=int, nargs="*", default=[2, 4],
                    help="and its max_matching_ngram_size values (2 is its default)")
    ap.add_argument("--assistant", default=None, help="assistant model for HF assisted generation")
    ap.add_argument("--draft-model", default=None, help="draft model for sf_model")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-llama", action="store_true",
                    help="skip llama.cpp even where llama-cpp-python is installed")
    ap.add_argument("--batch-new", type=int, default=48, help="max_new_tokens of the batch bar")
    ap.add_argument("--coupled-new", type=int, default=48, help="max_new_tokens of the coupled bar")
    ap.add_argument("--skip-bars", action="store_true")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved rounds; each cell is the median")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results"))
    args = ap.parse_args(argv)

    import torch

    import specfast
    from specfast import workloads
    from specfast.adapters.hf import HFModel, smollm2_path
    from specfast.decoder import SpeculativeDecoder
    from specfast.drafters import ModelDrafter, NgramDrafter

    if args.threads:
        torch.set_num_threads(args.threads)
    target_path = args.target or smollm2_path()
    target, load_s = _timed(lambda: HFModel.from_pretrained(target_path))
    print(f"loaded {target.name} in {load_s:.1f} s; torch threads {torch.get_num_threads()}",
          flush=True)
    rows = workloads.load(kinds=args.kinds)
    plain = SpeculativeDecoder(target, None)
    ngram = SpeculativeDecoder(target, NgramDrafter())
    model_dec = None
    if args.draft_model:
        model_dec = SpeculativeDecoder(target, ModelDrafter(HFModel.from_pretrained(args.draft_model)))
    assistant = HFModel.from_pretrained(args.assistant).model if args.assistant else None
    llama = None
    from specfast.adapters import llama_cpp as lcpp

    if not args.skip_llama and lcpp.available() and str(target_path).endswith(".gguf"):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        threads = args.threads or None
        lt = lcpp.LlamaCppModel(str(target_path), n_threads=threads)
        llama = {
            "target": lt,
            # n_threads_batch too: llama-cpp-python gives batches every core by default
            "plain": Llama(model_path=str(target_path), n_ctx=4096, n_threads=threads,
                           n_threads_batch=threads, verbose=False),
            "lookup": Llama(model_path=str(target_path), n_ctx=4096, n_threads=threads,
                            n_threads_batch=threads,
                            verbose=False, logits_all=True,  # its draft model needs them
                            draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10)),
            "sf_plain": SpeculativeDecoder(lt, None),
            "sf_ngram": SpeculativeDecoder(lt, NgramDrafter()),
        }
        llama["sf_plain"].generate([1, 2, 3], 4)

    results = {"machine": {"python": platform.python_version(), "torch": torch.__version__,
                           "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                           "load_avg_start": os.getloadavg()},
               "target": target.name, "max_new_cap": args.max_new, "workloads": []}
    plain.generate([1, 2, 3], 4)  # warm up torch
    ngram.generate([1, 2, 3, 1, 2], 4)
    # rounds interleave every method on every workload, so a burst of load on
    # the machine hits all of them alike; each cell is the median of the rounds
    prepared = []
    for w in rows:
        ids = target.encode(w["messages"])
        n = min(w["max_new_tokens"], args.max_new or w["max_new_tokens"])
        methods = [("sf_plain", lambda ids=ids, n=n: sf_generate(plain, ids, n)),
                   ("sf_ngram", lambda ids=ids, n=n: sf_generate(ngram, ids, n))]
        if model_dec is not None:
            methods.append(("sf_model", lambda ids=ids, n=n: sf_generate(model_dec, ids, n)))
        if not args.skip_hf:
            methods.append(("hf_plain", lambda ids=ids, n=n: hf_generate(target, ids, n)))
            if w["kind"] == "code":  # prose bars compare against sf_plain only
                for k in args.lookup:
                    for g in args.lookup_ngram:
                        name = f"hf_lookup_{k}" + ("" if g == 2 else f"_n{g}")
                        methods.append((name, lambda ids=ids, n=n, k=k, g=g: hf_generate(
                            target, ids, n, prompt_lookup_num_tokens=k,
                            max_matching_ngram_size=g)))
            if assistant is not None:
                methods.append(("hf_assisted", lambda ids=ids, n=n: hf_generate(
                    target, ids, n, assistant_model=assistant)))
        if llama is not None:
            lids = llama["target"].encode(w["messages"])
            eos = set(llama["target"].eos_token_ids)
            methods += [
                ("llama_plain", lambda i=lids, n=n, e=eos: llama_generate(llama["plain"], i, n, e)),
                ("llama_lookup_10", lambda i=lids, n=n, e=eos: llama_generate(
                    llama["lookup"], i, n, e)),
                ("sf_llama_plain", lambda i=lids, n=n: sf_generate(llama["sf_plain"], i, n)),
                ("sf_llama_ngram", lambda i=lids, n=n: sf_generate(llama["sf_ngram"], i, n)),
            ]
        prepared.append((w, ids, n, methods, {name: [] for name, _ in methods}))
    for rnd in range(args.rounds):
        for w, ids, n, methods, all_runs in prepared:
            for name, fn in methods:
                all_runs[name].append(fn())
            print(f"round {rnd + 1}/{args.rounds} {w['name']}",
                  {k: f"{len(v[-1]['tokens']) / v[-1]['seconds']:.2f}" for k, v in all_runs.items()},
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    for w, ids, n, methods, all_runs in prepared:
        r = {"name": w["name"], "kind": w["kind"], "prompt_tokens": len(ids), "max_new": n,
             "runs": {}}
        runs = r["runs"]
        ref = all_runs["sf_plain"][0]["tokens"]
        # llama.cpp runs the GGUF's own quantized weights, HF a float32 copy:
        # each family is compared with its own plain decoding
        lref = all_runs["sf_llama_plain"][0]["tokens"] if "sf_llama_plain" in all_runs else None
        for name, rs in all_runs.items():
            secs = sorted(x["seconds"] for x in rs)
            run = dict(rs[0])
            run["seconds"] = statistics.median(secs)
            run["seconds_all"] = [x["seconds"] for x in rs]
            for key in ("acceptance", "tokens_per_step"):  # the table shows round 1's
                if key in run:
                    run[key + "_all"] = [x[key] for x in rs]
            run["n_tokens"] = len(run["tokens"])
            run["tokens_per_s"] = len(run["tokens"]) / run["seconds"]
            run["tokens_per_s_best"] = len(run["tokens"]) / secs[0]
            base = lref if name.startswith(("llama", "sf_llama")) else ref
            run["identical_to_sf_plain"] = all(x["tokens"] == base for x in rs)
            run["first_diff"] = next((i for i, (a, b) in enumerate(zip(run["tokens"], base))
                                      if a != b), None)
            if "k_chosen" in run:
                run["k_chosen"] = {int(k): v for k, v in sorted(run["k_chosen"].items())}
            run.pop("tokens")
            runs[name] = run
        lookups = [k for k in runs if k.startswith("hf_lookup_")]
        if lookups:
            best = max(lookups, key=lambda k: runs[k]["tokens_per_s"])
            r["hf_lookup_best"] = best

        def paired(a, b):
            """Median over rounds of a's tokens/s over b's in the same round."""
            ra, rb = runs[a], runs[b]
            return statistics.median([(ra["n_tokens"] / sa) / (rb["n_tokens"] / sb)
                                      for sa, sb in zip(ra["seconds_all"], rb["seconds_all"])])

        r["speedup_vs_sf_plain"] = {k: paired(k, "sf_plain") for k in runs}
        if "sf_llama_plain" in runs:
            r["speedup_vs_sf_llama_plain"] = {k: paired(k, "sf_llama_plain") for k in runs
                                              if k.startswith(("llama", "sf_llama"))}
        if lookups:
            r["sf_ngram_vs_hf_lookup_best"] = paired("sf_ngram", r["hf_lookup_best"])
        results["workloads"].append(r)
    results["rounds"] = args.rounds
    _save(results, args.out)

    if not args.skip_bars:
        results["coupled"] = coupled_bar(target, rows, args.coupled_new)
        print("coupled", results["coupled"], flush=True)
        _save(results, args.out)
        results["batch"] = batch_bar(target, rows, args.batch_new)
        print("batch", {k: v for k, v in results["batch"].items() if k != "per_prompt"}, flush=True)
    results["machine"]["load_avg_end"] = os.getloadavg()
    results["specfast"] = specfast.__version__
    _save(results, args.out)
    print(open(os.path.join(args.out, "results.md")).read())
    return 0


def coupled_bar(target, rows, max_new, temperature=0.8, seed=1234):
    """Coupled sampling with two drafters vs plain coupled sampling (k = 0)."""
    from specfast.decoder import SpeculativeDecoder
    from specfast.drafters import ModelDrafter, NgramDrafter

    out = []
    picks = [w for w in rows if w["kind"] == "code"][:1] + [w for w in rows if w["kind"] != "code"][:1]
    for w in picks:
        ids = target.encode(w["messages"])
        kw = dict(temperature=temperature, seed=seed, method="coupled")
        ref = SpeculativeDecoder(target, None).generate(ids, max_new, **kw).tokens
        row = {"name": w["name"], "tokens": len(ref)}
        for name, drafter in (("ngram", NgramDrafter()), ("model(self)", ModelDrafter(target))):
            g = SpeculativeDecoder(target, drafter, k=4).generate(ids, max_new, **kw)
            row[name] = {"identical": g.tokens == ref, "acceptance": g.metrics.acceptance_rate}
        out.append(row)
    return out


def batch_bar(target, rows, max_new, size=8):
    """8 prompts in one batch vs 8 single runs, with the n-gram drafter, greedy."""
    from specfast.decoder import SpeculativeDecoder
    from specfast.drafters import NgramDrafter

    prompts = [target.encode(w["messages"]) for w in rows]
    prompts = (prompts * ((size + len(prompts) - 1) // len(prompts)))[:size]
    singles, t_single = [], 0.0
    for p in prompts:
        g, dt = _timed(lambda: SpeculativeDecoder(target, NgramDrafter()).generate(p, max_new))
        singles.append(g.tokens)
        t_single += dt
    dec = SpeculativeDecoder(target, NgramDrafter())
    batch, t_batch = _timed(lambda: dec.generate(prompts, max_new))
    plain_batch, t_plain_batch = _timed(lambda: SpeculativeDecoder(target, None).generate(prompts, max_new))
    same = [b.tokens == s for b, s in zip(batch, singles)]
    same_plain = [b.tokens == s for b, s in zip(plain_batch, singles)]
    tokens = sum(len(b.tokens) for b in batch)
    return {"size": size, "max_new": max_new, "tokens": tokens,
            "single_runs_s": t_single, "batch_s": t_batch, "plain_batch_s": t_plain_batch,
            "speedup_vs_singles": t_single / t_batch,
            "all_identical": all(same), "plain_batch_identical": all(same_plain),
            "per_prompt": same, "memory": dec.memory_report()}


def _save(results, out):
    save(out, "results", results, table(results))
    try:
        plot(results, os.path.join(out, "speedup.png"))
    except ImportError:  # matplotlib is optional
        pass


def table(results) -> str:
    names = ["sf_plain", "sf_ngram", "sf_model", "hf_plain", "hf_lookup_best", "hf_assisted"]
    present = [n for n in names if any(n in w["runs"] or n in w for w in results["workloads"])]
    lines = ["| workload | kind | tokens | " + " | ".join(present)
             + " | sf_ngram / sf_plain | sf_ngram / hf_lookup_best | acceptance | tok/step | greedy identical |",
             "|" + "---|" * (len(present) + 8)]
    for w in results["workloads"]:
        runs = w["runs"]
        best = w.get("hf_lookup_best")
        cells = [f"{runs[best]['tokens_per_s']:.2f} ({best[len('hf_lookup_'):]})"
                 if n == "hf_lookup_best" and best else
                 f"{runs[n]['tokens_per_s']:.2f}" if n in runs else "" for n in present]
        vs_hf = w.get("sf_ngram_vs_hf_lookup_best")
        ident = all(r["identical_to_sf_plain"] for k, r in runs.items()
                    if k.startswith("sf_") and not k.startswith("sf_llama"))
        hf_same = runs.get("hf_plain", {}).get("identical_to_sf_plain")
        lines.append(
            f"| {w['name']} | {w['kind']} | {runs['sf_plain']['n_tokens']} | " + " | ".join(cells)
            + f" | {w['speedup_vs_sf_plain']['sf_ngram']:.2f}x | "
            + (f"{vs_hf:.2f}x" if vs_hf else "n/a")
            + f" | {runs['sf_ngram']['acceptance']:.2f} | {runs['sf_ngram']['tokens_per_step']:.2f}"
            + f" | {'yes' if ident else 'NO'}{'' if hf_same is None else (' (hf_plain too)' if hf_same else ' (hf_plain differs)')} |")
    lines += _llama_table(results)
    m = results["machine"]
    lines.append("")
    lines.append(f"tokens/s (median of {results.get('rounds', 1)} interleaved rounds, prefill "
                 f"included), greedy, {results['target']}, max_new_tokens "
                 + (f"capped at {results['max_new_cap']}" if results['max_new_cap']
                    else "as each workload sets it")
                 + f", torch threads {m['threads']} of {m['cpus']} CPUs, "
                 f"load average {m['load_avg_start'][0]:.1f} at start"
                 + (f", {m['load_avg_end'][0]:.1f} at end." if 'load_avg_end' in m else "."))
    return "\n".join(lines) + "\n"


def _llama_table(results) -> list:
    """llama.cpp's own loop (plain, prompt lookup 10) beside specfast's loop on the
    llama.cpp adapter; "same text" compares with specfast's plain llama.cpp run."""
    names = ["llama_plain", "llama_lookup_10", "sf_llama_plain", "sf_llama_ngram"]
    rows = [w for w in results["workloads"] if "sf_llama_plain" in w["runs"]]
    if not rows:
        return []
    lines = ["", "| workload | " + " | ".join(names)
             + " | sf_llama_ngram / sf_llama_plain | vs llama_lookup_10 | same text (first diff) |",
             "|" + "---|" * (len(names) + 4)]
    for w in rows:
        runs = w["runs"]
        ng = runs["sf_llama_ngram"]
        diffs = ", ".join(f"{n}: {'yes' if runs[n]['identical_to_sf_plain'] else runs[n]['first_diff']}"
                          for n in ("llama_plain", "llama_lookup_10", "sf_llama_ngram"))
        lines.append(f"| {w['name']} | " + " | ".join(f"{runs[n]['tokens_per_s']:.2f}" for n in names)
                     + f" | {w['speedup_vs_sf_llama_plain']['sf_llama_ngram']:.2f}x"
                     + f" | {ng['tokens_per_s'] / runs['llama_lookup_10']['tokens_per_s']:.2f}x"
                     + f" | {diffs} |")
    return lines


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ws = results["workloads"]
    methods = [n for n in ("sf_ngram", "hf_plain", "hf_lookup_best", "sf_model", "hf_assisted")
               if any(n in w["speedup_vs_sf_plain"] or n in w for w in ws)]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(ws)), 4))
    width = 0.8 / max(1, len(methods))
    for j, name in enumerate(methods):
        xs = [i + j * width for i in range(len(ws))]
        ys = [w["speedup_vs_sf_plain"].get(w.get(name, name), 0) for w in ws]
        ax.bar(xs, ys, width, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(ws))])
    ax.set_xticklabels([w["name"] for w in ws], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("tokens/s relative to sf_plain (k = 0)")
    ax.set_title(f"{results['target']}: speculative decoding, greedy")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
