"""Writes one case of `specfast bench` (its synthetic inputs) to a file for ab.c.

    python bench/ab/inputs.py OUT --batch 64 --draft-len 4 --vocab 151936 --draft-probs dense
        [--filters topk50-topp0.9 | --top-k K --top-p P] [--method coupled]

The file holds a header of int64 (batch, draft_len, vocab, dense q, top_k) and a float64
top_p, then the float32 logits, the int32 draft tokens, the uint64 seeds, the int64
positions and, with dense q, the float32 draft probabilities.
"""

import argparse

import numpy as np

from specfast import _bench_cli as bc


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--draft-len", type=int, default=5)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--draft-probs", choices=["none", "dense"], default="none")
    p.add_argument("--filters", choices=list(bc.FILTERS), default="none")
    p.add_argument("--top-k", type=int, help="instead of --filters' top_k")
    p.add_argument("--top-p", type=float, help="instead of --filters' top_p")
    p.add_argument("--method", choices=["rejection", "coupled"], default="rejection",
                   help="coupled: drafts are the drafter's coupled samples (time with AB_METHOD=coupled)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    case = bc.Case(batch=a.batch, draft_len=a.draft_len, vocab=a.vocab, dtype="float32",
                   method=a.method, draft=a.draft_probs, filters=a.filters)
    inp = bc.make_inputs(case, seed=a.seed)
    dense = inp.q_dense is not None
    with open(a.out, "wb") as f:
        params = bc.FILTERS[a.filters]
        top_k = params.get("top_k", 0) if a.top_k is None else a.top_k
        top_p = params.get("top_p", 1.0) if a.top_p is None else a.top_p
        f.write(np.array([a.batch, a.draft_len, a.vocab, int(dense), top_k], np.int64).tobytes())
        f.write(np.array([top_p], np.float64).tobytes())
        for x in (inp.logits, inp.tokens, inp.seed, inp.position):
            f.write(np.ascontiguousarray(x).tobytes())
        if dense:
            f.write(inp.q_dense.tobytes())


if __name__ == "__main__":
    main()
