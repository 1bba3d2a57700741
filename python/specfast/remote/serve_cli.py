"""``specfast serve-drafter``: serve a drafter to remote targets.

    specfast serve-drafter --drafter ngram --port 50061
    specfast serve-drafter --drafter ./small.gguf --host 0.0.0.0 --token-file secret.txt
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from ..cli import count, number, read_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drafter", default="ngram",
                        help="'ngram', 'ngram:N' or a draft model folder/.gguf")
    parser.add_argument("--tree", type=count(1), default=1, metavar="N",
                        help="draft token trees of N branches per node (1: chains)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default loopback only; 0.0.0.0 for the LAN)")
    parser.add_argument("--port", type=count(0, 65535), default=50061,
                        help="0: any free port (the one bound is printed)")
    parser.add_argument("--token-file", default=None,
                        help="file holding a shared token every client must send")
    parser.add_argument("--tls-cert", default=None, help="PEM certificate (enables TLS)")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--threads", type=count(0), default=0, help="torch threads (0: default)")
    parser.add_argument("--workers", type=count(1), default=8,
                        help="sessions served at once; more are refused, not queued")
    parser.add_argument("--idle", type=number(0, strict=True), default=600.0,
                        help="seconds a silent session (or a reply left unread) is kept "
                             "before the session is closed")
    parser.add_argument("--max-tokens", type=count(1), default=None,
                        help="tokens a session may hold, all its requests' contexts and "
                             "drafts together (default 2^21)")


def run(args) -> int:
    from ..drafters import is_ngram, make
    from .server import MAX_TOKENS, check_tls_pair, serve

    if (args.tls_cert is None) != (args.tls_key is None):
        raise SystemExit("--tls-cert and --tls-key go together")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    token = None
    if args.token_file:
        token = read_file(args.token_file, "--token-file").strip()
        if not token:  # an empty token would be what every client sends by default
            raise SystemExit(f"--token-file {args.token_file}: the file holds no token")
    tls = None
    if args.tls_cert:
        tls = (read_file(args.tls_cert, "--tls-cert", binary=True),
               read_file(args.tls_key, "--tls-key", binary=True))
        try:
            check_tls_pair(tls)  # before a model loads
        except ValueError as e:
            raise SystemExit(f"--tls-cert {args.tls_cert}, --tls-key {args.tls_key}: {e}") \
                from None
    if is_ngram(args.drafter):
        try:
            make(args.drafter)
        except ValueError as e:
            raise SystemExit(f"--drafter: {e}") from None
    elif not os.path.exists(args.drafter):
        raise SystemExit(f"--drafter {args.drafter}: no such draft model folder or file")
    model = None
    if not is_ngram(args.drafter):
        from ..adapters import load

        model = load(args.drafter)  # loaded once, a fresh drafter state per session

    def make_drafter():
        if model is None:
            return make(args.drafter, branches=args.tree)
        from ..drafters import ModelDrafter

        return ModelDrafter(model, branches=args.tree)

    try:
        server, port = serve(make_drafter, args.host, args.port, auth_token=token, tls=tls,
                             workers=args.workers, idle=args.idle,
                             max_tokens=args.max_tokens or MAX_TOKENS)
    except (OSError, RuntimeError) as e:  # grpc: a bad address, a port in use, bad PEM
        raise SystemExit(f"cannot serve on {args.host}:{args.port}"
                         f"{' with this TLS certificate and key' if tls else ''}: {e}") from None
    print(f"specfast drafter ({make_drafter().name}) on {args.host}:{port}"
          f"{' with TLS' if tls else ''}{', token required' if token else ''} (pid {os.getpid()})",
          flush=True)
    signal.signal(signal.SIGTERM, lambda *_: server.stop(1))
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:
        server.stop(1)
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m specfast.remote.serve_cli")
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
