"""Where a profiled kernel spends its warps' time, from Nsight Compute's source page.

run.sh exports the source page of one verify launch as CSV
(`ncu -i REPORT --page source --csv --print-source sass|cuda`); this prints the
lines (SASS instructions, or CUDA source lines of a -lineinfo build) that hold the
most warp stall samples, and for SASS the samples per opcode. The CSV's layout
varies between Nsight Compute versions, so columns are found by name, and a file
whose columns are not found is shown as it is (its first lines), never an error.
    python bench/gpu/hotspots.py sass.csv [cuda.csv ...] [--top 40]
"""

import argparse
import collections
import csv
import re
import sys


def number(s):
    try:
        return float(s.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def column(header, *patterns):
    for pat in patterns:
        for i, name in enumerate(header):
            if re.search(pat, name, re.I):
                return i
    return None


def summarize(path, top):
    with open(path, newline="", errors="replace") as f:
        rows = list(csv.reader(f))
    at = next((i for i, r in enumerate(rows) if len(r) >= 3 and column(r, r"^source$")), None)
    if at is None:
        print(f"== {path}: no header with a Source column; its first lines:")
        for r in rows[:10]:
            print("  " + ",".join(r)[:200])
        return
    header, body = rows[at], [r for r in rows[at + 1:] if len(r) == len(rows[at])]
    src = column(header, r"^source$")
    samples = column(header, r"warp stall sampling \(all", r"stall sampling", r"sampl")
    executed = column(header, r"instructions executed", r"inst.*executed")
    where = column(header, r"^address$", r"^#$", r"^line", r"address")
    print(f"== {path}: {len(body)} lines; columns: {', '.join(header)}")
    if samples is None:
        print("  no stall-sampling column")
        return
    total = sum(number(r[samples]) for r in body) or 1.0
    print(f"  top {top} of {total:.0f} warp stall samples:")
    for r in sorted(body, key=lambda r: -number(r[samples]))[:top]:
        n = number(r[samples])
        if n == 0:
            break
        ex = f"{number(r[executed]):12.0f}" if executed is not None else ""
        loc = r[where] if where is not None else ""
        print(f"  {n:8.0f} {100 * n / total:5.1f}% {ex} {loc:>10s}  {r[src].strip()[:110]}")
    if "sass" in path.lower():  # run.sh names the SASS view so
        by_op = collections.Counter()
        for r in body:
            text = re.sub(r"^@!?U?P\w+\s+", "", r[src].strip())
            by_op[text.split(" ")[0].split(".")[0] if text else "?"] += number(r[samples])
        print("  samples by opcode: " + ", ".join(
            f"{op} {100 * n / total:.1f}%" for op, n in by_op.most_common(15) if n))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    for path in args.csv:
        try:
            summarize(path, args.top)
        except OSError as exc:
            print(f"== {path}: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
