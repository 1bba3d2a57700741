"""Drafting over the network, payload mode by round trip, in one run.

Each row gives bytes per token, tokens/s and the speed-up over target-only
decoding.

The drafter runs in a ``specfast serve-drafter`` server of this process on
loopback, behind :class:`specfast.remote.proxy.DelayProxy` (half the round
trip each way). Modes:

- ``tokens``: the n-gram drafter, greedy (ids only travel);
- ``tokens-ahead``: the same, drafting ahead while the target verifies;
- ``topk``: a draft model sampling from its top K, rejection sampling;
- ``dense``: the same with full rows (reference).

The draft model defaults to the target itself (the only model shipped here):
as slow as the target, it cannot pay, so its rows measure bytes and the
protocol, not a speed-up. Each row also shows the decode tokens/s the
draft-length cost model predicted for the steps it chose.

    python bench/e2e/remote.py --threads 2 --rtt 0 1 5 20 --max-new 96
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from results_io import save


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="model folder or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--draft-model", default=None, help="draft model (default: the target)")
    ap.add_argument("--rtt", type=float, nargs="*", default=[0, 1, 5, 20], help="milliseconds")
    ap.add_argument("--modes", nargs="*", default=["tokens", "tokens-ahead", "topk", "dense"])
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--workloads", nargs="*", default=["code-rewrite-rgb", "chat-tips"])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results"))
    args = ap.parse_args(argv)

    import torch

    from specfast import workloads
    from specfast.adapters.hf import HFModel, smollm2_path
    from specfast.decoder import SpeculativeDecoder
    from specfast.drafters import ModelDrafter, NgramDrafter
    from specfast.remote import RemoteDrafter, serve
    from specfast.remote.proxy import DelayProxy

    if args.threads:
        torch.set_num_threads(args.threads)
    target = HFModel.from_pretrained(args.target or smollm2_path())
    draft = HFModel.from_pretrained(args.draft_model) if args.draft_model else target
    makers = {"tokens": lambda: NgramDrafter(), "model": lambda: ModelDrafter(draft)}
    rows = workloads.load(names=args.workloads)
    rejection = dict(temperature=0.7, method="rejection", seed=1)
    sampling = {"tokens": dict(), "tokens-ahead": dict(), "topk": rejection, "dense": rejection}
    results = {"target": target.name, "draft": draft.name, "max_new": args.max_new,
               "threads": torch.get_num_threads(), "cells": []}
    # Warm up torch, a server and a session first: the first cell was the process's
    # first generate (and measured a longer round trip than the rest).
    for maker, payload in (("tokens", "tokens"), ("model", "topk")):  # and a draft model
        server, port = serve(makers[maker])
        with RemoteDrafter(f"127.0.0.1:{port}", vocab_size=target.vocab_size,
                           payload=payload, top_k=args.top_k) as d:
            SpeculativeDecoder(target, d).generate(target.encode(rows[0]["messages"]), 8,
                                                   **rejection)
        server.stop(None).wait()
    SpeculativeDecoder(target, None).generate([1, 2, 3], 4)
    for w in rows:
        ids = target.encode(w["messages"])
        n = min(w["max_new_tokens"], args.max_new)
        for mode in args.modes:
            for rtt in args.rtt:
                # target-only decoding right before and right after, so that both
                # sides see the same machine
                base = SpeculativeDecoder(target, None)
                plain = base.generate(ids, n, **sampling[mode]).metrics.tokens_per_s
                # a server per run: no session of an earlier run can hold it up
                server, port = serve(makers["tokens" if mode.startswith("tokens") else "model"])
                with DelayProxy(("127.0.0.1", port), delay=rtt / 2000) as proxy:
                    d = RemoteDrafter(f"127.0.0.1:{proxy.port}", payload=mode.split("-")[0],
                                      top_k=args.top_k, vocab_size=target.vocab_size,
                                      timeout=10.0, lookahead=10 if mode == "tokens-ahead" else 0)
                    dec = SpeculativeDecoder(target, d)
                    g = dec.generate(ids, n, **sampling[mode])
                    d.close()
                    wire = proxy.bytes_up + proxy.bytes_down
                server.stop(None).wait()  # let its last draft finish before timing more
                time.sleep(0.5)
                after = base.generate(ids, n, **sampling[mode]).metrics.tokens_per_s
                plain = 0.5 * (plain + after)
                m, st = g.metrics, d.stats
                total = st.bytes_sent + st.bytes_received + st.session_bytes
                cell = {"workload": w["name"], "mode": mode, "rtt_ms": rtt,
                        "tokens": m.tokens, "tokens_per_s": m.tokens_per_s,
                        "speedup": m.tokens_per_s / plain,
                        "bytes_per_drafted_token": st.bytes_per_drafted_token,
                        "drafter_bytes_per_drafted_token": st.bytes_received / max(1, st.drafted),
                        "bytes_per_token": total / max(1, m.tokens),
                        "session_bytes": st.session_bytes,
                        "wire_bytes_per_drafted_token": wire / max(1, st.drafted),
                        "round_trip_ms": 1000 * statistics.median(st.round_trips)
                        if st.round_trips else None,
                        "tokens_per_step": m.mean_accepted_length, "remote_steps": st.steps,
                        "ahead_hits": st.ahead_hits, "local_steps": st.local_steps,
                        "failures": st.failures,
                        "decode_tokens_per_s": m.decode_tokens_per_s,
                        "predicted_tokens_per_s": dec.last_metrics.predicted_tokens_per_s}
                results["cells"].append(cell)
                print({k: round(v, 3) if isinstance(v, float) else v for k, v in cell.items()},
                      flush=True)
    text = table(results)
    save(args.out, "remote", results, text)
    print(text)
    return 0


def table(results) -> str:
    lines = ["| workload | payload | round trip | drafter's bytes / drafted token | "
             "both ways (wire) | bytes / token | tok/step | look-ahead hits | "
             "tokens/s vs target-only | decode tok/s, measured / predicted |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in results["cells"]:
        pred = c["predicted_tokens_per_s"]
        lines.append(f"| {c['workload']} | {c['mode']} | {c['rtt_ms']:g} ms | "
                     f"{c['drafter_bytes_per_drafted_token']:.1f} | "
                     f"{c['bytes_per_drafted_token']:.1f} ({c['wire_bytes_per_drafted_token']:.1f})"
                     f" | {c['bytes_per_token']:.1f} | "
                     f"{c['tokens_per_step']:.2f} | {c['ahead_hits']}/{c['remote_steps']} | "
                     f"{c['speedup']:.2f}x | "
                     + (f"{c['decode_tokens_per_s'] / pred:.2f} |" if pred else "n/a |"))
    lines += ["", f"target {results['target']}, drafter model {results['draft']}, at most "
              f"{results['max_new']} new tokens, torch threads {results['threads']}; tokens: "
              "n-gram drafter, greedy; topk/dense: the draft model, rejection sampling at T 0.7. "
              "Bytes: protobuf messages; the drafter's (drafts and look-aheads) and both ways "
              "(the target's steps too) per drafted token, without the session's opening (in "
              "brackets: all TCP payload through the proxy, gRPC and HTTP/2 framing and the "
              "opening with the prompt included); per token: all messages. Speed-up: against "
              "the mean of target-only runs just before and after."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
