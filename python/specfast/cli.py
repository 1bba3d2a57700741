"""The ``specfast`` command: ``info``, ``bench``, ``demo``, ``generate``, ``serve-drafter``.

Each subcommand lives in its own module and is imported only when it runs,
so ``specfast info`` needs nothing beyond the core.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys

# name -> (module, help); each module has add_arguments(parser) and run(args).
_COMMANDS = {
    "info": ("specfast.cli", "version, SIMD level and threads"),
    "bench": ("specfast._bench_cli", "microbenchmarks of verify against numpy.max and torch"),
    "demo": ("specfast.demo", "speculative decoding of a real model, plain vs speculative"),
    "generate": ("specfast.generate", "generate with any target/drafter pair"),
    "serve-drafter": ("specfast.remote.serve_cli", "serve a drafter to targets on other machines"),
}


def count(low, high=None):
    """An argparse type: an int in [low, high]."""
    def parse(text):
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if n < low or (high is not None and n > high):
            raise argparse.ArgumentTypeError(
                f"{n} is outside [{low}, {high}]" if high is not None else f"{n} is below {low}")
        return n
    return parse


def number(low, strict=False):
    """An argparse type: a finite float >= low (> low when strict)."""
    def parse(text):
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(x):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if not (x > low if strict else x >= low):
            raise argparse.ArgumentTypeError(
                f"{x} is not above {low:g}" if strict else f"{x} is below {low:g}")
        return x
    return parse


def read_file(path, option, binary=False):
    """The contents of an option's file, or SystemExit saying why it cannot be read."""
    try:
        with open(path, "rb" if binary else "r") as f:
            return f.read()
    except OSError as e:
        raise SystemExit(f"{option} {path}: {e.strerror or e}") from None


class HelpFormatter(argparse.HelpFormatter):
    """Help that ends with an option's default, where the default is a value
    (not None, nor a flag's False) and the help does not already say it."""

    def _get_help_string(self, action):
        text, default = action.help or "", action.default
        if (not action.option_strings or default is None or default is False
                or default == argparse.SUPPRESS or "default" in text):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, list) else str(default)
        shown = shown.replace("%", "%%")  # argparse formats help with %
        return f"{text} (default: {shown})" if text else f"default: {shown}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args) -> int:
    import specfast

    print(f"specfast {specfast.__version__}")
    print(f"simd level: {specfast.simd_level()}")
    print(f"threads: {specfast.get_num_threads()}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="specfast",
                                     description=__doc__.splitlines()[0].replace("``", ""))
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = argv[0] if argv and argv[0] in _COMMANDS else None
    module = None
    for name, (mod, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text[:1].upper() + help_text[1:]
                           + ".", formatter_class=HelpFormatter)
        if name == chosen:
            try:
                module = importlib.import_module(mod)
            except ImportError as exc:
                parser.error(f"`specfast {name}` is not available: {exc}")
            module.add_arguments(p)
    args = parser.parse_args(argv)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
