"""Writes the seed corpora of fuzz_api.c and fuzz_tree.c into fuzz/corpus/ (deterministic).

The harness reads its input byte by byte (fuzz_api.c, LLVMFuzzerTestOneInput):
byte 0 picks the entry point (0 probs, 1 sample, 2 and 3 verify; 0xF0 and up
also resize the pool), bytes 1-8 seed the PRNG that fills large rows, and the
rest choose the vocabulary, shapes, counts, parents, draft distributions,
parameters and special logits. Seeds here are a spread of entry points and
lengths, plus bodies that steer into the cases the issue names (long chains,
trees, dense and sparse drafts, special values); libFuzzer mutates from them.
Files named regress-* are inputs that once found a bug: keep them. Files named
cov-* come from coverage-minimising a long fuzzing run (see fuzz/README.md);
this script leaves both alone and rewrites only seed-*.

    python3 fuzz/make_corpus.py
"""

from __future__ import annotations

import pathlib
import random

HERE = pathlib.Path(__file__).resolve().parent / "corpus" / "api"


def main() -> None:
    HERE.mkdir(parents=True, exist_ok=True)
    for old in HERE.glob("seed-*"):
        old.unlink()
    rnd = random.Random(7)
    count = 0
    for head in (0, 1, 2, 3, 0xF2, 0xF3, 0xF5):
        for length in (12, 40, 120, 400, 1200):
            body = bytes(rnd.randrange(256) for _ in range(length))
            (HERE / f"seed-{head:02x}-{length}").write_bytes(bytes([head]) + body)
            count += 1
    # bodies biased to small byte values: small vocabularies, valid parameters
    for head in (0, 1, 2, 3):
        for length in (60, 300):
            body = bytes(rnd.randrange(8) for _ in range(length))
            (HERE / f"seed-{head:02x}-small-{length}").write_bytes(bytes([head]) + body)
            count += 1
    # bodies biased to 0xFF / 0xFE: the long-chain and malformed branches
    for head in (2, 3):
        for length in (80, 400):
            body = bytes(rnd.choice((0xFF, 0xFE, 0xFD, 0xF8, rnd.randrange(256)))
                         for _ in range(length))
            (HERE / f"seed-{head:02x}-edge-{length}").write_bytes(bytes([head]) + body)
            count += 1
    # fuzz_tree.c: byte 0 even = sf_tree_mask, odd = sf_kv_compact
    tree = HERE.parent / "tree"
    tree.mkdir(exist_ok=True)
    for old in tree.glob("seed-*"):
        old.unlink()
    for head in (0, 1, 2, 3):
        for length in (8, 40, 160):
            body = bytes(rnd.randrange(256) for _ in range(length))
            (tree / f"seed-{head:02x}-{length}").write_bytes(bytes([head]) + body)
            count += 1
    print(f"wrote {count} seeds to {HERE} and {tree}")


if __name__ == "__main__":
    main()
