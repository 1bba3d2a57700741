"""The drafter side: serves any :class:`specfast.drafters.Drafter` over gRPC.

    specfast serve-drafter --drafter ngram --port 50061
    specfast serve-drafter --drafter ./small-model --host 0.0.0.0 --token-file secret.txt

Each stream is one generation with a drafter of its own (made by the factory),
so concurrent targets do not share state. The server keeps the verified
contexts; the target sends only what changed. Every message is checked before
it touches the drafter: a malformed, out-of-order or oversized message ends
the session with an Error that says what was wrong.
"""

from __future__ import annotations

import hmac
import logging
import queue
import re
import threading
import time
from concurrent import futures

import grpc
import numpy as np

from .. import _api
from ..drafters import Sampling
from . import drafter_pb2 as pb
from . import drafter_pb2_grpc as pb_grpc

VERSION = 1
MAX_MESSAGE = 64 << 20  # bytes; a dense payload of 16 x 262144 float32 rows fits
MAX_DRAFT = 1024  # the verifier's limit per request
MAX_TOP_K = 1024
MAX_BATCH = 1 << 16
HELLO_WAIT = 10.0  # seconds from a stream's start to its hello
# The stream's metadata key that carries the token's UTF-8 (as well as the
# hello), so that a peer without it is refused as its stream opens, not after
# holding a worker for HELLO_WAIT ("-bin": gRPC takes any bytes there).
TOKEN_KEY = "specfast-auth-bin"
MAX_TOKENS = 1 << 21  # context tokens a session may hold, all requests together
log = logging.getLogger("specfast.remote")


class ProtocolError(ValueError):
    """A message the protocol does not allow."""


class OverLimit(ProtocolError):
    """More than this drafter serves (a session's tokens): the client drafts
    locally (a transient Error), not a refusal of its settings."""


def _sampling(s) -> Sampling:
    """A request's Sampling, refused at hello where a drafter could not use it
    (it would fail later, a bare gRPC error). An unset top_p (proto3 reads 0) is 1."""
    values = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p or 1.0,
              "min_p": s.min_p}
    if _api._first_bad_param(values) is not None:
        raise ProtocolError(f"hello: sampling needs {_api._param_detail(values, 0)}")
    return Sampling(float(s.temperature), int(s.top_k), float(values["top_p"]),
                    float(s.min_p), int(s.seed), "coupled" if s.coupled else "rejection")


def encode_draft(d, payload: int, top_k: int, vocab: int):
    """A Draft message for one :class:`specfast.drafters.Draft`."""
    msg = pb.Draft(tokens=d.tokens, match=max(0, int(d.match or 0)))
    if d.parents is not None:
        msg.parents.extend(d.parents)
    if payload == pb.TOKENS or not d.tokens or d.probs is None:
        return msg
    if payload == pb.DENSE:
        q = d.probs.dense(vocab) if isinstance(d.probs, _api.SparseProbs) else \
            np.asarray(d.probs, np.float32)
        if q.shape[1] < vocab:  # a draft model's smaller vocabulary: the rest has q = 0
            q = np.pad(q, ((0, 0), (0, vocab - q.shape[1])))
        msg.probs = np.ascontiguousarray(q, "<f4").tobytes()
        return msg
    if isinstance(d.probs, _api.SparseProbs):
        ids, vals = np.asarray(d.probs.indices, np.int32), np.asarray(d.probs.values, np.float32)
    else:  # keep the K largest; the drafter sampled from them only (see serve)
        q = np.asarray(d.probs, np.float32)
        ids = np.argsort(-q, axis=1, kind="stable")[:, :top_k].astype(np.int32)
        vals = np.take_along_axis(q, ids, axis=1)
        if np.any(vals.sum(axis=1) < 1.0 - 1e-5):  # K ids would misstate q: refuse
            raise ProtocolError(f"this drafter's distributions are not confined to "
                                f"{top_k} tokens: use the DENSE payload")
    ids, vals = ids[:, :top_k], vals[:, :top_k]
    pad = top_k - ids.shape[1]
    if pad:
        ids = np.pad(ids, ((0, 0), (0, pad)), constant_values=-1)
        vals = np.pad(vals, ((0, 0), (0, pad)))
    msg.ids.extend(np.where((ids >= 0) & (vals > 0), ids, 0).ravel().tolist())
    msg.probs = np.ascontiguousarray(vals, "<f4").tobytes()
    return msg


class _Session:
    """One generation: the verified contexts, the sampling and a drafter."""

    def __init__(self, hello, drafter, max_tokens=MAX_TOKENS, max_message=MAX_MESSAGE):
        if hello.version != VERSION:
            raise ProtocolError(f"protocol version {hello.version} is not supported "
                                f"(this drafter speaks version {VERSION})")
        if hello.payload not in (pb.TOKENS, pb.TOP_K, pb.DENSE):
            raise ProtocolError("hello: payload must be TOKENS, TOP_K or DENSE")
        if hello.payload == pb.TOP_K and not 1 <= hello.top_k <= MAX_TOP_K:
            raise ProtocolError(f"hello: TOP_K payload needs 1 <= top_k <= {MAX_TOP_K}")
        if not hello.requests:
            raise ProtocolError("hello: no requests")
        if len(hello.requests) > MAX_BATCH:  # more than this drafter serves: drafted locally
            raise OverLimit(f"hello: at most {MAX_BATCH} requests, got {len(hello.requests)}")
        if not 0 < hello.vocab_size <= _api._MAX_VOCAB:
            raise ProtocolError(f"hello: vocab_size must be in (0, {_api._MAX_VOCAB}]")
        if hello.lookahead > MAX_DRAFT:
            raise ProtocolError(f"hello: lookahead must be at most {MAX_DRAFT}")
        self.vocab = hello.vocab_size
        # a model drafter reads ids of its own vocabulary only (its embedding)
        model_vocab = getattr(getattr(drafter, "model", None), "vocab_size", None)
        self.ids = min(self.vocab, model_vocab) if model_vocab else self.vocab
        self.lookahead = hello.lookahead
        self.last = []  # the drafts of the last step, for the look-ahead
        self.payload, self.top_k = hello.payload, hello.top_k
        self.max_tokens = max_tokens
        # A step's dense rows must fit in one message (4 bytes a token of the
        # vocabulary, up to 15 for its id and parent, 32 per request of framing).
        self.max_dense = max(1, (max_message - 32 * len(hello.requests)) // (4 * self.vocab + 16))
        self.held = 0  # context tokens held, all requests together
        self.contexts = [self._tokens(r.tokens, "prompt") for r in hello.requests]
        if any(not c for c in self.contexts):
            raise ProtocolError("hello: empty prompt")
        self.sampling = [_sampling(r.sampling) for r in hello.requests]
        needs_q = any(s.method == "rejection" and s.temperature > 0 for s in self.sampling)
        if needs_q and not drafter.deterministic and self.payload == pb.TOKENS:
            raise ProtocolError(
                "a TOKENS payload carries no draft distribution: rejection sampling with "
                "this drafter needs TOP_K or DENSE (or use coupled mode)")
        if needs_q and self.payload == pb.TOP_K and hasattr(drafter, "sparse_top"):
            drafter.sparse_top = self.top_k  # draw from the K tokens that travel
        self.drafter = drafter
        self.step = 0
        drafter.start([list(c) for c in self.contexts], self.sampling)

    def _tokens(self, tokens, what):
        # The contexts' memory, and a model drafter's prefill, grow with them.
        self.held += len(tokens)
        if self.held > self.max_tokens:
            raise OverLimit(f"{what}: the session's contexts would hold {self.held} tokens, "
                            f"over this drafter's limit of {self.max_tokens}")
        t = list(tokens)
        if t and (min(t) < 0 or max(t) >= self.ids):
            raise ProtocolError(f"{what}: token ids must be in [0, {self.ids})"
                                + (" (the drafter's vocabulary)" if self.ids < self.vocab else ""))
        return t

    def _budget(self, ks, held):
        """ks cut, first requests first, so that the drafter holds at most
        max_tokens tokens (contexts and drafts: a model drafter's cache) and a
        DENSE step's rows fit in a message. A draft may be shorter than its k."""
        left = self.max_tokens - held
        if self.payload == pb.DENSE:
            left = min(left, self.max_dense)
        if sum(ks) <= left:
            return ks
        out = []
        for k in ks:
            out.append(max(0, min(k, left)))
            left -= out[-1]
        return out

    def advance(self, st):
        if st.step != self.step + 1:
            raise ProtocolError(f"step {st.step} out of order (expected {self.step + 1})")
        self.step = st.step
        if st.keep:
            if len(st.keep) != len(self.contexts):
                raise ProtocolError(f"keep has {len(st.keep)} entries for "
                                    f"{len(self.contexts)} requests")
            self.drafter.rollback([int(n) for n in st.keep])
        if st.select:
            rows = list(st.select)
            if len(set(rows)) != len(rows) or max(rows) >= len(self.contexts):
                raise ProtocolError("select: indices must be distinct and inside the batch")
            self.contexts = [self.contexts[r] for r in rows]
            self.held = sum(len(c) for c in self.contexts)
            self.sampling = [self.sampling[r] for r in rows]
            self.drafter.select(rows)
        if len(st.updates) != len(self.contexts):
            raise ProtocolError(f"{len(st.updates)} updates for {len(self.contexts)} requests")
        ks = []
        for ctx, u in zip(self.contexts, st.updates):
            ctx.extend(self._tokens(u.append, "append"))
            if u.k > MAX_DRAFT:
                raise ProtocolError(f"k = {u.k} exceeds {MAX_DRAFT}")
            ks.append(int(u.k))
        ks = self._budget(ks, self.held)
        out = pb.Drafts(step=self.step)
        self.last = []
        if any(ks):
            self.last = self.drafter.propose(self.contexts, ks, self.sampling)
            out.drafts.extend(encode_draft(d, self.payload, self.top_k, self.vocab)
                              for d in self.last)
        else:
            out.drafts.extend(pb.Draft() for _ in ks)
        return out

    def ahead(self):
        """The look-ahead of the last step (None when look-ahead is off): for
        each request whose draft is a chain, the next draft assuming all of it
        is accepted followed by the drafter's own next token (drafted here while
        the target verifies). Sent even empty, where there is none to draft: a
        client whose drafts were all accepted waits for it."""
        if not self.lookahead:
            return None
        out = pb.Drafts(step=self.step, ahead=True)
        chains = [d.tokens and d.parents is None for d in self.last]
        if not any(chains):
            return out
        contexts = [ctx + list(d.tokens) if c else ctx
                    for ctx, d, c in zip(self.contexts, self.last, chains)]
        ks = [self.lookahead + 1 if c else 0 for c in chains]
        held = self.held + sum(len(d.tokens) for d in self.last)
        if self._budget(ks, held) != ks:
            return out  # the step's own drafts took what the limits leave
        drafts = self.drafter.propose(contexts, ks, self.sampling)
        for d, last, c in zip(drafts, self.last, chains):
            if not c or len(d.tokens) < 2:
                out.drafts.add()
                continue
            msg = encode_draft(d.tail(), self.payload, self.top_k, self.vocab)
            msg.assumed.extend(list(last.tokens) + [d.tokens[0]])
            out.drafts.append(msg)
        return out


def put_until(q: queue.Queue, item, stopped: threading.Event) -> bool:
    """Puts item on the bounded queue q, waiting while it is full, unless stopped
    is set first (the reader is gone): then False."""
    while not stopped.is_set():
        try:
            q.put(item, timeout=0.5)
            return True
        except queue.Full:
            pass
    return False


class _Watchdog:
    """Cancels a call whose reply has waited ``limit`` seconds to be sent: a
    client that stops reading fills the window, and the session's generator
    then blocks where no timeout of its own can end it."""

    def __init__(self, context, limit):
        self.since = None  # when the reply now waiting began to
        self.done = threading.Event()
        threading.Thread(target=self._watch, args=(context, limit), daemon=True).start()

    def _watch(self, context, limit):
        while not self.done.wait(min(1.0, limit / 4)):
            since = self.since
            if since is not None and time.monotonic() - since > limit:
                log.warning("session closed: a reply unread for %g s", limit)
                context.cancel()
                return


class DrafterService(pb_grpc.DrafterServicer):
    """The gRPC service; ``make_drafter()`` gives a fresh drafter per session."""

    def __init__(self, make_drafter, auth_token: str | None = None, idle: float = 600.0,
                 max_tokens: int = MAX_TOKENS, max_message: int = MAX_MESSAGE):
        self.make_drafter = make_drafter
        self.auth_token = auth_token
        self.idle = idle  # seconds a session may stay silent (or unread) before it is closed
        self.max_tokens = max_tokens
        self.max_message = max_message
        self.name = getattr(make_drafter(), "name", "drafter")

    def Session(self, request_iterator, context):  # noqa: N802 - gRPC's name
        if self.auth_token is not None and not self._authentic(context):
            log.warning("session refused: authentication failed")
            # a status, not an Error message: the client may still be sending its hello
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "authentication failed")
        # a reader thread, so that a step that has already arrived cancels the
        # look-ahead it would make stale; it reads one message ahead at most
        # (what a client sends faster waits in gRPC's flow control, not here)
        inbox: queue.Queue = queue.Queue(maxsize=1)
        watchdog = _Watchdog(context, self.idle)

        def pump():  # to the session, unless it has ended
            try:
                for m in request_iterator:
                    put_until(inbox, m, watchdog.done)
            except Exception:  # the client went away
                pass
            put_until(inbox, None, watchdog.done)

        threading.Thread(target=pump, daemon=True).start()
        session = None

        def messages():
            while True:
                # a peer that never says hello holds a worker for seconds, not minutes
                wait = self.idle if session is not None else min(self.idle, HELLO_WAIT)
                try:
                    m = inbox.get(timeout=wait)
                except queue.Empty:
                    raise ProtocolError(f"no message for {wait:g} s: session closed") from None
                if m is None:
                    return
                yield m

        def reply(msg):
            watchdog.since = time.monotonic()
            return msg

        try:
            for msg in messages():
                kind = msg.WhichOneof("msg")
                if session is None:
                    if kind != "hello":
                        raise ProtocolError("the first message must be hello")
                    if self.auth_token is not None and not self._same(msg.hello.auth_token):
                        raise ProtocolError("authentication failed")
                    drafter = self.make_drafter()
                    session = _Session(msg.hello, drafter, self.max_tokens, self.max_message)
                    yield reply(pb.FromDrafter(welcome=pb.Welcome(
                        version=VERSION, drafter=getattr(drafter, "name", "drafter"),
                        deterministic=bool(drafter.deterministic))))
                elif kind != "step":
                    raise ProtocolError("after hello only steps may follow")
                else:
                    yield reply(pb.FromDrafter(drafts=session.advance(msg.step)))
                    watchdog.since = None
                    ahead = session.ahead() if inbox.empty() else None  # while the target verifies
                    if ahead is not None:
                        yield reply(pb.FromDrafter(drafts=ahead))
                watchdog.since = None
        except ProtocolError as e:
            log.warning("session refused: %s", e)
            yield reply(pb.FromDrafter(error=pb.Error(message=str(e),
                                                      transient=isinstance(e, OverLimit))))
        except Exception as e:  # the drafter's own failure: the client drafts locally
            log.exception("drafter failed")
            yield reply(pb.FromDrafter(error=pb.Error(
                message=f"drafter failed: {type(e).__name__}: {e}", transient=True)))
        finally:
            watchdog.done.set()

    def _same(self, token) -> bool:
        token = token.encode() if isinstance(token, str) else token
        return hmac.compare_digest(token, self.auth_token.encode())

    def _authentic(self, context) -> bool:
        sent = [v for k, v in context.invocation_metadata() or () if k == TOKEN_KEY]
        return len(sent) == 1 and isinstance(sent[0], bytes) and self._same(sent[0])


def serve(make_drafter, host: str = "127.0.0.1", port: int = 0, *, auth_token=None,
          tls: tuple | None = None, workers: int = 8, max_message: int = MAX_MESSAGE,
          idle: float = 600.0, max_tokens: int = MAX_TOKENS):
    """Starts a server; returns ``(server, port)``. ``make_drafter`` is called with
    no arguments once per session (and once at start, for its name) and returns
    the :class:`specfast.drafters.Drafter` that serves it (e.g. ``lambda:
    NgramDrafter()``, or a ``ModelDrafter`` over one shared model). ``tls`` is
    ``(cert_pem, key_pem)`` bytes. Binds to loopback unless told otherwise; a message over
    ``max_message`` bytes ends its stream (RESOURCE_EXHAUSTED); a session
    silent for ``idle`` seconds, or whose client leaves a reply unread as long,
    is closed (each holds one of ``workers``); one whose contexts would hold
    more than ``max_tokens`` tokens in all is refused with an Error (the client
    drafts locally), and a step's drafts are cut to what that limit leaves
    (and, with the DENSE payload, to what fits in one message)."""
    if auth_token is not None and not auth_token:
        raise ValueError("auth_token must not be empty: every client sends '' by default")
    check_tls_pair(tls)
    # Sessions beyond the workers are refused (RESOURCE_EXHAUSTED: the client
    # drafts locally), not queued behind sessions that may last minutes.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers),
                         maximum_concurrent_rpcs=workers, options=[
        ("grpc.max_receive_message_length", max_message),
        ("grpc.max_send_message_length", max_message),
        ("grpc.so_reuseport", 0)])  # a port in use is an error, not a second server
    pb_grpc.add_DrafterServicer_to_server(
        DrafterService(make_drafter, auth_token, idle, max_tokens, max_message), server)
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if tls is not None:
        creds = grpc.ssl_server_credentials([(tls[1], tls[0])])
        port = server.add_secure_port(where, creds)
    else:
        port = server.add_insecure_port(where)
    if port == 0:
        raise OSError(f"cannot bind {where}")
    server.start()
    return server, port


# What every PEM certificate holds (grpc takes any bytes, and fails later).
PEM_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"


def check_tls_pair(tls):
    """Refuses a (certificate, key) that is not PEM: grpc would log a TLS error
    and then say only that it cannot bind the address."""
    if tls is None:
        return
    if not (isinstance(tls, tuple) and len(tls) == 2 and all(isinstance(t, bytes) for t in tls)):
        raise TypeError("tls must be (cert_pem, key_pem) bytes")
    if PEM_CERTIFICATE not in tls[0]:
        raise ValueError("the TLS certificate is not PEM (-----BEGIN CERTIFICATE-----)")
    if not re.search(rb"-----BEGIN [A-Z ]*PRIVATE KEY-----", tls[1]):
        raise ValueError("the TLS key is not a PEM private key (-----BEGIN ... PRIVATE KEY-----)")
