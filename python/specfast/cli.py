"""The ``specfast`` command."""

from __future__ import annotations

import argparse
import sys


def _info(args) -> int:
    import specfast

    print(f"specfast {specfast.__version__}")
    print(f"simd level: {specfast.simd_level()}")
    print(f"threads: {specfast.get_num_threads()}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="specfast", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="version, SIMD level and threads").set_defaults(run=_info)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
