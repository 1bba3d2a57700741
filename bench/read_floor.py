"""How close verify comes to the machine, and how far torch is from it.

Times side by side, in one process, on one `specfast bench` case (the first bar's by
default): specfast.verify, the torch peer, numpy.max over the target logits (the bars'
floor, one thread), and numpy.max over as many bytes as verify must read (bytes_read:
the rows each request reaches; a rejection's residual reads q at a few tokens) split
across all cores. torch / that last read bounds torch / verify for any implementation
that reads those bytes: the README's case for why 30x over torch is out of reach on 2
cores.

    python bench/read_floor.py [--batch 64 --draft-len 4 --vocab 151936 --threads 2]
"""

import argparse
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

import specfast
from specfast import _bench_cli as bc


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    specfast.set_num_threads(args.threads)
    bc.keep_freed_memory()  # as specfast bench: torch's temporaries are not page-faulted anew

    inp = bc.make_inputs(bc.Case(args.batch, args.draft_len, args.vocab, "float32",
                                 "rejection", "dense", "none"))
    verify = bc.specfast_call(inp)
    nbytes = bc.bytes_read("specfast", inp, verify().num_accepted)
    flat = inp.logits.reshape(-1)[: nbytes // 4]  # numpy.max releases the GIL
    parts = np.array_split(flat, args.threads)
    pool = ThreadPoolExecutor(args.threads)
    times = bc.measure({
        "specfast": verify,
        "torch": bc.torch_call(inp),
        "numpy.max": bc.floor_call(inp),
        "read": lambda: list(pool.map(np.max, parts)),
    })
    read = times["read"]
    print(f"verify must read {nbytes / 1e6:.1f} MB of {inp.logits.nbytes / 1e6:.1f} MB; "
          f"{args.threads} threads; medians of 7, interleaved")
    for name, t in times.items():
        print(f"  {name:10s} {t * 1e3:8.2f} ms  {t / read:6.2f}x the read")
    print(f"torch / verify {times['torch'] / times['specfast']:.1f}x; "
          f"torch / read {times['torch'] / read:.1f}x (about the most torch / verify "
          f"can be for a verifier that reads these bytes on {args.threads} threads)")


if __name__ == "__main__":
    main()
