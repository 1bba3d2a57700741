"""Replays a drafter and the draft-length controller against known greedy text.

Greedy decoding is deterministic, so each workload's continuation is known once
it is decoded. This decodes it once (plain), measures the target's forward cost
per width once, and then replays ``NgramDrafter`` + ``DraftLength`` step by step
against that text with the measured costs: target steps and modelled tokens/s
against plain decoding, for a change to the drafter or the controller in seconds
instead of a full ``run.py`` (whose rounds swing by 20% on a shared machine).
The decoded text and the costs are cached in ``--cache``.

    python bench/e2e/replay.py --threads 2 --resync -1 4 --margin 1.03 1.1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

import numpy as np

WIDTHS = tuple(range(1, 34))  # each width: BLAS kernels make the cost far from smooth


def decode_and_measure(target_path, cache):
    """{name: (prompt ids, greedy continuation)} of every workload and {width:
    seconds}, cached."""
    if os.path.exists(cache):
        with open(cache) as f:
            data = json.load(f)
        return {k: tuple(v) for k, v in data["texts"].items()}, \
            {int(w): s for w, s in data["costs"].items()}
    from specfast import workloads
    from specfast.adapters.hf import HFModel
    from specfast.decoder import plain_decoder

    target = HFModel.from_pretrained(target_path)
    texts = {}
    for w in workloads.load():
        ids = target.encode(w["messages"])
        texts[w["name"]] = (ids, plain_decoder(target).generate(ids, w["max_new_tokens"]).tokens)
    ids, gen = max(texts.values(), key=lambda t: len(t[1]))
    ctx, costs = ids + gen[:len(gen) // 2], {}
    for _ in range(3):  # the fastest of 3 per width, over a mid-answer context
        for width in WIDTHS:
            state = target.new_state(1)
            target.forward(state, [ctx], all_logits=False)
            t = time.perf_counter()
            target.forward(state, [(gen * 2)[:width]])
            costs[width] = min(costs.get(width, 1e9), time.perf_counter() - t)
    with open(cache, "w") as f:
        json.dump({"texts": texts, "costs": costs}, f)
    return texts, costs


def replay(ids, gen, drafter, controller, cost, noise, seed):
    """(seconds, target steps) of decoding ``gen`` after ``ids``; ``cost(width)``
    is a forward's seconds, inflated by up to ``noise`` at random (a busy machine)."""
    from specfast.drafters import Sampling

    rng, ctx, pos, seconds, steps = random.Random(seed), list(ids), 0, 0.0, 0
    drafter.start([list(ctx)], [Sampling()])
    controller.cheap_draft = drafter.cheap
    controller.pad = controller.pad_max  # HFModel widens a step where that is faster
    controller.start(1)
    while pos < len(gen):
        limit = len(gen) - pos - 1
        draft = drafter.propose([ctx], [min(controller.max_k, limit)], [Sampling()])[0]
        k = controller.choose(0, limit, draft.match, len(draft.tokens))
        tokens = draft.tokens[:k]
        accepted = 0
        while accepted < len(tokens) and tokens[accepted] == gen[pos + accepted]:
            accepted += 1
        width = controller.compute_width(len(tokens) + 1)
        t = cost(width) * (1 + noise * rng.random())
        controller.observe_target(width, t)
        controller.observe(0, len(tokens), accepted, draft.match)
        ctx.extend(gen[pos:pos + accepted + 1])
        pos += accepted + 1
        drafter.rollback([len(ctx)])
        seconds += t
        steps += 1
    return seconds, steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="model folder or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--names", nargs="*", default=None, help="workload names (default: all)")
    ap.add_argument("--resync", type=int, nargs="*", default=[4], help="NgramDrafter resync windows")
    ap.add_argument("--margin", type=float, nargs="*", default=[1.1], help="DraftLength margins")
    ap.add_argument("--pad-max", type=int, nargs="*", default=[3], help="DraftLength pad_max")
    ap.add_argument("--noise", type=float, default=0.3, help="forward cost inflation, up to")
    ap.add_argument("--seeds", type=int, default=4, help="noise draws averaged")
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "specfast_replay.json"),
                    help="decoded texts and costs (delete it to decode and measure again)")
    args = ap.parse_args(argv)

    import torch

    from specfast.adapters.hf import smollm2_path
    from specfast.decoder import DraftLength
    from specfast.drafters import NgramDrafter

    if args.threads:
        torch.set_num_threads(args.threads)
    texts, costs = decode_and_measure(args.target or smollm2_path(), args.cache)
    widths = sorted(costs)
    # As measured, not made monotone: with MKL a forward of 3 tokens can cost more
    # than one of 4 (its small-M matrix products), and the controller meets that.
    curve = np.array([costs[w] for w in widths])
    slope = max(0.0, (curve[-1] - curve[-5]) / (widths[-1] - widths[-5]))

    def cost(width):
        return float(np.interp(width, widths, curve)) + max(0, width - widths[-1]) * slope

    print("forward ms by width:", {w: round(1000 * costs[w]) for w in widths})
    for name, (ids, gen) in texts.items():
        if args.names and name not in args.names:
            continue
        plain = np.mean([replay(ids, gen, NgramDrafter(), DraftLength(0, 32), cost, args.noise, s)[0]
                         for s in range(args.seeds)])
        cells = []
        for resync in args.resync:
            for margin in args.margin:
                for pad in args.pad_max:
                    runs = [replay(ids, gen, NgramDrafter(resync=resync),
                                   DraftLength(None, 32, margin=margin, pad_max=pad), cost,
                                   args.noise, s)
                            for s in range(args.seeds)]
                    ratio = plain / np.mean([r[0] for r in runs])
                    cells.append(f"resync {resync} margin {margin} pad {pad}: {ratio:.2f}x "
                                 f"plain, {np.mean([r[1] for r in runs]):.0f} steps")
        print(f"{name} ({len(gen)} tokens): " + "; ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
