"""The target side: :class:`RemoteDrafter`, a drafter on another machine.

It is a :class:`specfast.drafters.Drafter` like any other: the decoder calls
``start``, ``propose``, ``rollback`` and ``select``; it turns them into one
gRPC stream per generation that carries only what changed (the verified
tokens since the last step, the rollback lengths, the draft lengths) and
brings back drafts in the payload chosen (token ids; K ids and probabilities;
dense rows).

Faults never stop or change a generation: every wait is bounded, and while the
drafter is unreachable, slow, restarted or gone, drafts come from a local
fallback (the n-gram drafter by default, kept in step all along) and the
connection is tried again after ``retry`` seconds, from the decoding step (a
try waits at most ``timeout``; the interval doubles, to 32 x ``retry``, while
tries keep failing); when it is back, a new session sends the full
contexts and drafting moves back to the remote side. The output does
not depend on which drafter proposed (greedy and coupled), or stays exact
because every draft carries the distribution it was drawn from (rejection).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .. import _api
from ..drafters import Draft, Drafter, NgramDrafter, check_arg
from . import drafter_pb2 as pb
from .server import (MAX_DRAFT, MAX_MESSAGE, MAX_TOP_K, PEM_CERTIFICATE, TOKEN_KEY, VERSION,
                     put_until)

_KEEP_ALL = (1 << 32) - 1  # a keep (uint32) that rolls nothing back

PAYLOADS = {"tokens": pb.TOKENS, "topk": pb.TOP_K, "dense": pb.DENSE}


class RemoteError(RuntimeError):
    """The drafter refused the session (version, token, payload, message); a
    drafter that failed on its side is a ConnectionError (tried again later)."""


@dataclass
class TransferStats:
    """What travelled (serialized messages), steps, round trips. Per step and per
    drafted token count the steps' traffic; ``session_bytes`` (the prompts,
    once per session) is apart."""

    session_bytes: int = 0  # opening sessions: hello (the prompts) and welcome
    bytes_sent: int = 0  # steps: contexts' news and draft lengths
    bytes_received: int = 0  # drafts and look-aheads
    steps: int = 0  # steps drafted remotely
    ahead_hits: int = 0  # of which the look-ahead served, without a round trip
    local_steps: int = 0  # steps drafted by the fallback
    drafted: int = 0  # tokens drafted remotely
    sessions: int = 0
    failures: list = field(default_factory=list)
    round_trips: list = field(default_factory=list)  # seconds per remote step

    @property
    def total_bytes(self) -> int:
        return self.session_bytes + self.bytes_sent + self.bytes_received

    @property
    def bytes_per_step(self) -> float:
        return (self.bytes_sent + self.bytes_received) / self.steps if self.steps else 0.0

    @property
    def bytes_per_drafted_token(self) -> float:
        return (self.bytes_sent + self.bytes_received) / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(total_bytes=self.total_bytes, bytes_per_step=self.bytes_per_step,
                 bytes_per_drafted_token=self.bytes_per_drafted_token)
        return d


class _Stream:
    """One gRPC bidirectional stream with bounded waits."""

    INBOX = 8  # replies read ahead; a step brings at most two (drafts, look-ahead)

    def __init__(self, stub, timeout, auth_token=None):
        self._out: queue.Queue = queue.Queue()
        # Bounded: a drafter that sends faster than steps read waits in gRPC's
        # flow control, instead of filling this process's memory.
        self._in: queue.Queue = queue.Queue(maxsize=self.INBOX)
        self._closed = threading.Event()
        self._call = stub.Session(iter(self._out.get, None), metadata=(
            ((TOKEN_KEY, auth_token.encode()),) if auth_token is not None else None))
        self.timeout = timeout
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        try:
            for msg in self._call:
                if not put_until(self._in, msg, self._closed):
                    return
        except Exception as e:  # the stream broke: wake the reader up
            put_until(self._in, e, self._closed)
        put_until(self._in, EOFError("the drafter closed the stream"), self._closed)

    def send(self, msg):
        self._out.put(msg)

    def poll(self):
        """The next message if one has arrived, else None."""
        try:
            msg = self._in.get_nowait()
        except queue.Empty:
            return None
        return self._check(msg)

    def receive(self, deadline=None):
        """The next message, waiting up to ``timeout`` s or until ``deadline``
        (time.monotonic), whichever is sooner."""
        wait = self.timeout if deadline is None else min(
            self.timeout, max(0.0, deadline - time.monotonic()))
        try:
            msg = self._in.get(timeout=wait)
        except queue.Empty:
            raise TimeoutError(f"no answer from the drafter within {self.timeout} s") from None
        return self._check(msg)

    @staticmethod
    def _check(msg):
        if isinstance(msg, Exception):
            code = getattr(msg, "code", None)  # a grpc.RpcError's status
            if callable(code) and getattr(code(), "name", "") == "UNAUTHENTICATED":
                raise RemoteError(msg.details()) from None  # a setting to fix: said
            if callable(code) and callable(getattr(msg, "details", None)):
                # a status and its details, not the call object's many lines
                raise ConnectionError(f"{code().name}: {msg.details()}") from msg
            raise ConnectionError(str(msg)) from msg
        if msg.WhichOneof("msg") == "error":
            if msg.error.transient:  # the drafter failed, not our settings: try again later
                raise ConnectionError(msg.error.message)
            raise RemoteError(msg.error.message)
        return msg

    def close(self):
        self._closed.set()
        self._out.put(None)
        self._call.cancel()  # ends the server's side too, and our reader


class RemoteDrafter(Drafter):
    """Drafts on a remote ``specfast serve-drafter``.

    Parameters
    ----------
    address : "host:port"
    payload : {"tokens", "topk", "dense"}
        What a draft carries: token ids only (deterministic drafters, or coupled
        mode), the ``top_k`` ids and probabilities the drafter sampled from, or
        dense rows (for reference).
    top_k : int
        Entries per drafted token with ``payload="topk"`` (1 to 1024).
    vocab_size : int
        The target's vocabulary (drafts are checked against it).
    timeout : float
        Seconds to wait for a draft (or a connection) before drafting locally.
    fallback : Drafter or None
        Drafts while the remote drafter is away; default an n-gram drafter.
    retry : float
        Seconds between reconnection attempts, doubling (up to 32 x) while
        they keep failing.
    auth_token : str or None
        Sent at connect; the server refuses a session without the right one.
    tls : bytes or None
        PEM root certificate(s) to connect with TLS; None: plain TCP.
    lookahead : int
        Ask the drafter to draft this many tokens ahead while the target
        verifies, assuming its whole draft and its own next token are accepted;
        when they are, the next draft is already here and the step pays no
        round trip (0: off).

    Examples
    --------
    >>> dec = SpeculativeDecoder(target, RemoteDrafter("10.0.0.2:50061",
    ...                          vocab_size=target.vocab_size))   # doctest: +SKIP
    """

    cheap = False

    def __init__(self, address: str, *, payload: str = "tokens", top_k: int = 8,
                 vocab_size: int, timeout: float = 2.0, fallback: Drafter | None = None,
                 retry: float = 1.0, auth_token: str | None = None, tls: bytes | None = None,
                 lookahead: int = 0):
        import grpc

        from . import drafter_pb2_grpc as pb_grpc

        if payload not in PAYLOADS:
            raise ValueError(f"payload must be one of {sorted(PAYLOADS)}, got {payload!r}")
        if payload == "topk":
            check_arg("RemoteDrafter", "top_k", top_k, 1, MAX_TOP_K, integer=True)
        check_arg("RemoteDrafter", "lookahead", lookahead, 0, MAX_DRAFT, integer=True)
        check_arg("RemoteDrafter", "timeout", timeout, 0.0, open_lo=True)
        check_arg("RemoteDrafter", "retry", retry, 0.0)
        check_address(address)
        check_tls_roots(tls)
        self.address, self.payload, self.top_k = address, payload, top_k
        self.lookahead = lookahead
        self.vocab_size, self.timeout, self.retry = int(vocab_size), timeout, retry
        self.auth_token = auth_token
        self.fallback = fallback if fallback is not None else NgramDrafter()
        self.name = f"remote:{address}"
        self.deterministic = payload == "tokens"
        backoff = max(100, int(1000 * retry))  # grpc's own reconnect backoff, in ms
        opts = [("grpc.max_receive_message_length", MAX_MESSAGE),
                ("grpc.max_send_message_length", MAX_MESSAGE),
                ("grpc.initial_reconnect_backoff_ms", backoff),
                ("grpc.min_reconnect_backoff_ms", backoff),
                ("grpc.max_reconnect_backoff_ms", backoff)]
        self._channel = (grpc.secure_channel(address, grpc.ssl_channel_credentials(tls), opts)
                         if tls is not None else grpc.insecure_channel(address, opts))
        self._stub = pb_grpc.DrafterStub(self._channel)
        self.stats = TransferStats()
        self.remote_name = None
        self._stream = None
        self._closed = False
        self._next_try = 0.0
        self._failed = 0  # tries failed in a row
        self._strict = False  # the next try is the generation's first (see _connect)
        self._prompt_lens: list = []
        self._contexts: list = []
        self._sampling: list = []
        self._new_session()

    def _new_session(self, sent=()):
        """The state of one session: ``sent``, the tokens of each context the
        drafter holds."""
        self._sent = list(sent)
        self._keep = self._select = None  # news for the next step
        self._before_select = 0  # the batch a pending select picks from
        self._step = 0
        self._ahead = None  # the latest look-ahead
        self._last = []  # the chains drafted last step, per request

    # -- the Drafter interface ------------------------------------------------
    def start(self, contexts, sampling):
        if self._closed:
            raise ValueError("RemoteDrafter: closed (its channel is gone); make a new one")
        self.fallback.start(contexts, sampling)
        self._contexts = [list(c) for c in contexts]
        self._prompt_lens = [len(c) for c in contexts]
        self._sampling = list(sampling)
        self.stats = TransferStats()  # per generation
        self._close()
        # A drafter that failed in an earlier generation waits out its backoff:
        # each try at a hung one would cost this generation the whole timeout.
        self._strict = True
        if time.monotonic() >= self._next_try:
            self._connect()

    def propose(self, contexts, ks, sampling):
        self._contexts = contexts
        # A step that tried to connect, or whose drafts never came, waited on
        # that: its time is not what drafting costs (Drafter.stalled).
        self.stalled = False
        if self._stream is None and time.monotonic() >= self._next_try:
            self.stalled = True
            self._connect()
        if self._stream is not None:
            try:
                return self._remote(contexts, ks)
            except (TimeoutError, ConnectionError, RemoteError) as e:
                self.stalled = True
                self._lost(e)
        self.stats.local_steps += 1
        return self.fallback.propose(contexts, ks, sampling)

    def rollback(self, lengths):
        """Pending until the next step goes out, which applies keep before select:
        a step that sent nothing (every k 0) leaves its keep pending, and the next
        one combines with it (the shorter wins), in the order before the select."""
        self.fallback.rollback(lengths)
        if self._stream is None:
            return  # a new session starts from the contexts
        lengths = [int(n) for n in lengths]
        if self._select is None:
            self._keep = (lengths if self._keep is None
                          else [min(a, b) for a, b in zip(self._keep, lengths)])
        else:
            keep = self._keep if self._keep is not None else [_KEEP_ALL] * self._before_select
            for j, r in enumerate(self._select):
                keep[r] = min(keep[r], lengths[j])
            self._keep = keep

    def select(self, rows):
        self.fallback.select(rows)
        rows = list(rows)
        if self._stream is not None:
            self._sent = [self._sent[r] for r in rows]
            if self._select is None:
                self._before_select = len(self._sampling)
            # a later select composes with one not yet sent
            self._select = rows if self._select is None else [self._select[r] for r in rows]
        self._sampling = [self._sampling[r] for r in rows]

    def finish(self):
        """Ends the session (the server's worker is free again); the channel stays."""
        self._close()

    def close(self):
        self._close()
        self._closed = True
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the session ----------------------------------------------------------
    def _connect(self):
        """Opens a session with the current contexts; on failure, retry later.
        The generation's first try (at its start, or its first step after a
        backoff) raises a refusal (version, token, payload, prompt ids) as
        RemoteError: a configuration error is said, not decoded around. Once
        tokens were generated a refusal may be theirs (ids past a smaller
        draft vocabulary), so a later first try drafts around it too."""
        strict = self._strict and [len(c) for c in self._contexts] == self._prompt_lens
        self._strict = False
        stream = None
        try:
            stream = _Stream(self._stub, self.timeout, self.auth_token)
            hello = pb.Hello(version=VERSION, auth_token=self.auth_token or "",
                             payload=PAYLOADS[self.payload], top_k=self.top_k,
                             vocab_size=self.vocab_size, lookahead=self.lookahead)
            for ctx, s in zip(self._contexts, self._sampling):
                hello.requests.add(tokens=ctx, sampling=pb.Sampling(
                    temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                    min_p=s.min_p, seed=s.seed & ((1 << 64) - 1),
                    coupled=s.method == "coupled"))
            msg = pb.ToDrafter(hello=hello)
            stream.send(msg)
            reply = stream.receive()
            self.stats.session_bytes += msg.ByteSize() + reply.ByteSize()  # it was answered
            if reply.WhichOneof("msg") != "welcome" or reply.welcome.version != VERSION:
                raise RemoteError("the drafter answered hello with something else")
        except (RemoteError, TimeoutError, ConnectionError) as e:
            if stream is not None:
                stream.close()  # its call and reader thread end with it
            self._lost(e)
            if strict and isinstance(e, RemoteError):
                raise
            return
        except BaseException:  # Ctrl-C awaiting the welcome: free the server's worker
            if stream is not None:
                stream.close()
            raise
        self._stream = stream
        self.remote_name = reply.welcome.drafter
        self.stats.sessions += 1
        self._new_session(len(c) for c in self._contexts)

    def _lost(self, why):
        self.stats.failures.append(f"{type(why).__name__}: {why}")
        self._close()
        # A peer that keeps failing (or hangs: each try then waits the whole
        # timeout) is tried less and less often: retry, doubling to 32 x retry.
        self._next_try = time.monotonic() + self.retry * 2 ** min(self._failed, 5)
        self._failed += 1

    def _close(self):
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def _collect(self, step, block, ahead=False, deadline=None):
        """Reads replies up to this step's drafts (``block``), or its look-ahead
        (``ahead``), or what has arrived; keeps the latest look-ahead. Returns
        the step's drafts or None. Stale replies do not extend the wait: it
        ends at ``deadline`` (TimeoutError)."""
        while True:
            if ahead and self._ahead is not None and self._ahead.step == step:
                return None
            reply = self._stream.receive(deadline) if block or ahead else self._stream.poll()
            if reply is None:
                return None
            if reply.WhichOneof("msg") != "drafts":
                raise RemoteError("expected drafts")
            self.stats.bytes_received += reply.ByteSize()
            got = reply.drafts
            if got.step > step:
                raise RemoteError(f"drafts for step {got.step} during step {step}")
            if got.ahead:
                self._ahead = got
            elif got.step == step and block:
                return got

    def _accepted_all(self, contexts, ks):
        """Did every drafting request accept its whole last draft (a chain)?"""
        if len(self._last) != len(contexts):
            return False
        for i, (ctx, k, last) in enumerate(zip(contexts, ks, self._last)):
            new = ctx[self._sent[i]:]
            if k and (last is None or not last or new[:-1] != last):
                return False
        return True

    def _hit(self, contexts, ks):
        """The look-ahead drafts, when every drafting request got what it assumed."""
        a = self._ahead
        if a is None or a.step != self._step or len(a.drafts) != len(contexts):
            return None
        out = []
        for i, (ctx, k, d) in enumerate(zip(contexts, ks, a.drafts)):
            if k == 0:
                out.append(Draft([]))
                continue
            if not d.tokens or list(d.assumed) != ctx[self._sent[i]:]:
                return None
            out.append(self._decode(d, len(d.tokens)).head(k))
        return out

    def _remote(self, contexts, ks):
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.timeout  # the whole step's wait
        self._collect(self._step, block=False)
        ahead = None
        if (self._select is None and self.lookahead and any(ks)
                and self._accepted_all(contexts, ks)):
            # the look-ahead may serve: it is on its way (the drafter started it
            # before this step was sent, so a fresh request would wait for it too)
            self._collect(self._step, block=False, ahead=True, deadline=deadline)
            ahead = self._hit(contexts, ks)
        self._step += 1
        step = pb.Step(step=self._step)
        if self._keep is not None:
            step.keep.extend(self._keep)
        if self._select is not None:
            step.select.extend(self._select)
        for i, (ctx, k) in enumerate(zip(contexts, ks)):
            step.updates.add(append=ctx[self._sent[i]:], k=int(k))
        msg = pb.ToDrafter(step=step)
        self._stream.send(msg)
        self._sent = [len(c) for c in contexts]
        self._keep = self._select = None
        self.stats.bytes_sent += msg.ByteSize()
        if ahead is not None:  # the step's own drafts are read (and dropped) later
            drafts = ahead
            self.stats.ahead_hits += 1
        else:
            reply = self._collect(self._step, block=True, deadline=deadline)
            if len(reply.drafts) != len(ks):
                raise RemoteError(f"{len(reply.drafts)} drafts for {len(ks)} requests")
            drafts = [self._decode(d, k) for d, k in zip(reply.drafts, ks)]
        self._last = [d.tokens if d.parents is None else None for d in drafts]
        self._failed = 0  # a drafted step, not a welcome: a drafter may welcome, then hang
        self.stats.steps += 1
        self.stats.drafted += sum(len(d.tokens) for d in drafts)
        self.stats.round_trips.append(time.perf_counter() - t0)
        return drafts

    def _decode(self, d, k) -> Draft:
        """A Draft from a message, checked: ids in the vocabulary, at most k nodes,
        parents valid, probabilities of the announced shape."""
        tokens = list(d.tokens)
        n = len(tokens)
        if n > k or any(t < 0 or t >= self.vocab_size for t in tokens):
            raise RemoteError("a draft with token ids outside the vocabulary or more than k")
        parents = list(d.parents) or None
        if parents is not None and (len(parents) != n or
                                    any(not -1 <= p < i for i, p in enumerate(parents))):
            raise RemoteError("a draft tree with invalid parents")
        probs = None
        if n and self.payload == "topk" and d.ids:
            ids = np.array(d.ids, np.int64)
            vals = _floats(d.probs)
            if ids.size != n * self.top_k or vals.size != ids.size:
                raise RemoteError("a top-k draft of the wrong size")
            if np.any(ids[vals > 0] >= self.vocab_size):  # an unused slot's id means nothing
                raise RemoteError("a top-k draft with ids outside the vocabulary")
            ids = np.where(vals > 0, ids, -1).astype(np.int32)  # unused slots
            _check_probs(vals.reshape(n, self.top_k), sparse=True)
            if _api._repeats(ids.reshape(n, self.top_k)):
                raise RemoteError("a top-k draft that repeats a token id")
            ids, vals = ids.reshape(n, self.top_k), vals.reshape(n, self.top_k)
            if not np.all(((ids == np.array(tokens)[:, None]) & (vals > 0)).any(axis=1)):
                raise RemoteError("a top-k draft whose token has no probability in its row")
            probs = _api.SparseProbs(ids, vals.copy())
        elif n and self.payload == "dense" and d.probs:
            vals = _floats(d.probs)
            if vals.size != n * self.vocab_size:
                raise RemoteError("a dense draft of the wrong size")
            probs = vals.reshape(n, self.vocab_size).copy()
            _check_probs(probs)
            if not np.all(probs[np.arange(n), tokens] > 0):
                raise RemoteError("a dense draft whose token has probability 0")
        return Draft(tokens, probs, int(d.match), parents)


def check_address(address):
    """Refuses an address that is not HOST:PORT with a port in [1, 65535] (grpc
    would take the port modulo 65536, or read the text as a name to resolve)."""
    host, _, port = str(address).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address must be HOST:PORT with a port in [1, 65535], got {address!r}")


def check_tls_roots(tls):
    """Refuses root certificates that are not PEM: grpc takes anything, and
    every connection would then fail, drafting locally without a word."""
    if tls is not None and (not isinstance(tls, bytes)
                            or PEM_CERTIFICATE not in tls):
        raise ValueError("tls must be PEM certificate bytes (-----BEGIN CERTIFICATE-----)")


def _floats(buf):
    """Little-endian float32s from a message's bytes (a stray byte is the
    drafter's fault: RemoteError, not numpy's ValueError)."""
    if len(buf) % 4:
        raise RemoteError(f"draft probabilities of {len(buf)} bytes, not float32s")
    return np.frombuffer(buf, "<f4")


def _check_probs(rows, sparse=False):
    """Draft probabilities verify would refuse end the session (the fallback
    drafts), not the generation: finite, in [0, 1.001], rows summing to 1 as
    verify sums them: a dense row as dist.c's q_sum_off (floor(q 2^40) each,
    within 2^40 / 1000 of 2^40), a sparse one as verify.c's check_draft (in
    double, in order, within 1e-3)."""
    if not (np.all(rows >= 0) and np.all(rows <= np.float32(1.001))):
        raise RemoteError("draft probabilities outside [0, 1]")
    if sparse:
        total = np.cumsum(rows.astype(np.float64), axis=1)[:, -1]  # cumsum adds in order
        ok = np.abs(total - 1.0) <= 1e-3
    else:
        one = 1 << 40
        mass = (rows * np.float32(one)).astype(np.uint64).sum(axis=1)
        ok = (mass <= one + one // 1000) & (mass + one // 1000 >= one)
    if not np.all(ok):
        raise RemoteError("draft probabilities not summing to 1 (within 1e-3)")
