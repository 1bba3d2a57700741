"""Drafting over the network on loopback: exactness through RemoteDrafter,
bytes on the wire, faults (drafter down, killed, restarted) and refusals."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from concurrent import futures

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
grpc = pytest.importorskip("grpc")

from specfast.decoder import SpeculativeDecoder  # noqa: E402
from specfast import SparseProbs  # noqa: E402
from specfast.drafters import Draft, ModelDrafter, NgramDrafter, Sampling  # noqa: E402
from specfast.remote import RemoteDrafter, RemoteError, serve  # noqa: E402
from specfast.remote import drafter_pb2 as pb  # noqa: E402
from specfast.remote import drafter_pb2_grpc as pb_grpc  # noqa: E402
from specfast.remote.proxy import DelayProxy  # noqa: E402

from stats import assert_outcomes, scaled  # noqa: E402
from test_decoder import (PROMPTS, draft_model, one_thread, reference,  # noqa: E402,F401
                          target, tiny_model, two_token_joint)



@pytest.fixture
def ngram_server():
    server, port = serve(lambda: NgramDrafter())
    yield port
    server.stop(0)


def remote(port, target, **kw):
    kw.setdefault("timeout", 5.0)
    return RemoteDrafter(f"127.0.0.1:{port}", vocab_size=target.vocab_size, **kw)


def test_greedy_through_the_network_equals_plain(target, ngram_server):
    d = remote(ngram_server, target)
    dec = SpeculativeDecoder(target, d, k=4)
    out = dec.generate(PROMPTS, 30)
    for prompt, g in zip(PROMPTS, out):
        assert g.tokens == reference(target, prompt, 30, temperature=0.0)
    local = SpeculativeDecoder(target, NgramDrafter(), k=4).generate(PROMPTS, 30)
    assert [g.metrics.draft_n for g in out] == [g.metrics.draft_n for g in local]
    st = d.stats
    assert st.sessions == 1 and st.steps > 0 and st.local_steps == 0 and not st.failures
    assert st.drafted == dec.last_metrics.draft_n
    # tokens only: ids and framing, far below 16 bytes per drafted token
    assert 0 < st.bytes_per_drafted_token <= 16, st.as_dict()
    t = dec.last_metrics.transfer  # the generation's metrics say what crossed
    assert t["total_bytes"] == st.total_bytes > st.session_bytes > 0
    assert t["bytes_per_token"] == st.total_bytes / dec.last_metrics.tokens
    assert "B/drafted token" in dec.last_metrics.summary()


def test_trees_travel(target, ngram_server):
    server, port = serve(lambda: NgramDrafter(branches=3))
    try:
        dec = SpeculativeDecoder(target, remote(port, target), k=6)
        out = dec.generate(PROMPTS, 24, temperature=0.9, seed=[1, 2, 3, 4], method="coupled")
        for prompt, s, g in zip(PROMPTS, [1, 2, 3, 4], out):
            assert g.tokens == reference(target, prompt, 24, seed=s, method="coupled",
                                         temperature=0.9)
    finally:
        server.stop(0)


@pytest.fixture(params=[0, 5], ids=["loopback", "rtt-5ms"])
def link(request):
    """Wraps a server port into the port of a link with this round trip (ms)."""
    proxies = []

    def wrap(port):
        if not request.param:
            return port
        proxies.append(DelayProxy(("127.0.0.1", port), delay=request.param / 2000))
        return proxies[-1].port

    wrap.proxies = proxies  # their byte counters: what crossed the link
    yield wrap
    for p in proxies:
        p.close()


@pytest.mark.parametrize("payload", ["tokens", "topk"])
def test_coupled_draft_model_equals_local(target, draft_model, payload, link):
    server, port = serve(lambda: ModelDrafter(draft_model))
    try:
        kw = dict(temperature=1.0, top_k=8, seed=[5, 6, 7, 8], method="coupled")
        d = remote(link(port), target, payload=payload)
        got = SpeculativeDecoder(target, d, k=3).generate(PROMPTS, 24, **kw)
        want = SpeculativeDecoder(target, ModelDrafter(draft_model), k=3).generate(
            PROMPTS, 24, **kw)
        assert [g.tokens for g in got] == [g.tokens for g in want]
        # the same drafts were proposed, so the same ones were accepted
        assert [g.metrics.draft_n_accepted for g in got] == \
            [g.metrics.draft_n_accepted for g in want]
        if link.proxies:  # the messages counted went through the link, inside gRPC's framing
            wire = sum(p.bytes_up + p.bytes_down for p in link.proxies)
            assert 0 < d.stats.total_bytes <= wire < 3 * d.stats.total_bytes + 20_000, \
                (d.stats.as_dict(), wire)
    finally:
        server.stop(0)


def test_topk_rejection_sampling_is_exact(link):
    """K ids and probabilities are all the verifier gets; the drafter drew from
    exactly those K tokens, so the output is the target's distribution (6000
    generations see 6% of it: the protocol's bookkeeping, not the kernel's 1%)."""
    target, draft = tiny_model(vocab=6, seed=3, scale=0.4), tiny_model(vocab=6, seed=4, scale=0.4)
    server, port = serve(lambda: ModelDrafter(draft))
    try:
        prompt = [1, 2, 1, 2, 1]
        n = scaled(6000)
        d = remote(link(port), target, payload="topk", top_k=3, timeout=60.0)
        out = SpeculativeDecoder(target, d, k=2).generate(
            [prompt] * n, 2, temperature=1.0, seed=list(range(n)), method="rejection")
        assert d.stats.local_steps == 0 and d.stats.drafted > 0
    finally:
        server.stop(0)
    assert_outcomes([tuple(g.tokens) for g in out], two_token_joint(target, prompt),
                    "rejection/remote-topk", resolution=0.06)


@pytest.mark.parametrize("payload", ["dense", "topk"])
def test_rejection_sampling_equals_local_drafting(target, draft_model, payload):
    """The same draws as a local drafter reporting the same q (the full distribution, or
    its top 8): the same tokens, seed for seed."""
    server, port = serve(lambda: ModelDrafter(draft_model))
    try:
        kw = dict(temperature=0.9, top_p=0.95, seed=[7, 8, 9, 10], method="rejection")
        d = remote(port, target, payload=payload)
        got = SpeculativeDecoder(target, d, k=3).generate(PROMPTS, 24, **kw)
        assert d.stats.local_steps == 0 and d.stats.drafted > 0
    finally:
        server.stop(0)
    local = ModelDrafter(draft_model, sparse_top=8 if payload == "topk" else 0)
    want = SpeculativeDecoder(target, local, k=3).generate(PROMPTS, 24, **kw)
    assert [g.tokens for g in got] == [g.tokens for g in want]
    assert [g.metrics.draft_n_accepted for g in got] == [g.metrics.draft_n_accepted for g in want]


def test_tokens_payload_refuses_rejection_with_a_sampling_drafter(target, draft_model):
    server, port = serve(lambda: ModelDrafter(draft_model))
    try:
        dec = SpeculativeDecoder(target, remote(port, target, payload="tokens"), k=2)
        with pytest.raises(RemoteError, match="TOP_K or DENSE"):
            dec.generate(PROMPTS[0], 4, temperature=1.0, method="rejection")
    finally:
        server.stop(0)


def test_drafter_unreachable_decodes_locally(target):
    server, port = serve(lambda: NgramDrafter())
    server.stop(0)  # nothing listens there now
    d = remote(port, target, timeout=0.5)
    dec = SpeculativeDecoder(target, d, k=4)
    out = dec.generate(PROMPTS[0], 30)
    assert out.tokens == reference(target, PROMPTS[0], 30, temperature=0.0)
    assert d.stats.steps == 0 and d.stats.local_steps > 0 and d.stats.failures
    # said in the summary that `specfast generate` prints, not only in the stats
    said = dec.last_metrics.summary()
    assert f"drafted remotely 0 steps, locally {d.stats.local_steps}" in said, said
    assert f"{len(d.stats.failures)} failed tries, the last: ConnectionError: UNAVAILABLE: " \
        in said, said
    assert "\n" not in said and "Rendezvous" not in said, said  # one line: status, details


class Counting(NgramDrafter):
    """An n-gram drafter that calls ``hook`` after each proposal."""

    hook = None

    def propose(self, contexts, ks, sampling):
        out = super().propose(contexts, ks, sampling)
        if Counting.hook is not None:
            Counting.hook()
        return out


def test_drafter_killed_and_restarted_mid_generation(target):
    """The generation completes with the output of an uninterrupted run; the
    drafter coming back is used again."""
    server, port = serve(lambda: Counting())
    calls = []

    def kill_after_3():
        calls.append(1)
        if len(calls) == 3:
            threading.Thread(target=server.stop, args=(0,)).start()

    Counting.hook = kill_after_3
    try:
        d = remote(port, target, timeout=1.0, retry=0.0)
        dec = SpeculativeDecoder(target, d, k=4)
        first = dec.generate(PROMPTS, 40)
        assert d.stats.failures and d.stats.local_steps > 0
        for prompt, g in zip(PROMPTS, first):
            assert g.tokens == reference(target, prompt, 40, temperature=0.0)
        Counting.hook = None
        again, _ = serve(lambda: Counting(), port=port)  # restarted on the same port
        try:
            for _ in range(50):  # until the client's reconnection finds it
                second = dec.generate(PROMPTS, 40)
                assert [g.tokens for g in second] == [g.tokens for g in first]
                if d.stats.sessions >= 1:  # stats are per generation
                    break
                time.sleep(0.1)
            assert d.stats.sessions >= 1
            # That one may have reconnected at any step; the next opens its
            # session at the start and drafts remotely throughout.
            third = dec.generate(PROMPTS, 40)
            assert [g.tokens for g in third] == [g.tokens for g in first]
            assert d.stats.sessions >= 1 and d.stats.steps > 3
        finally:
            again.stop(0)
    finally:
        Counting.hook = None


def test_slow_drafter_times_out_into_local_drafting(target):
    slow = threading.Event()

    class Slow(NgramDrafter):
        def propose(self, contexts, ks, sampling):
            if slow.is_set():
                time.sleep(1.0)
            return super().propose(contexts, ks, sampling)

    server, port = serve(lambda: Slow())
    try:
        d = remote(port, target, timeout=0.2, retry=60.0)
        slow.set()
        t0 = time.perf_counter()
        out = SpeculativeDecoder(target, d, k=4).generate(PROMPTS[0], 30)
        assert time.perf_counter() - t0 < 10  # one timeout, then local drafting
        assert out.tokens == reference(target, PROMPTS[0], 30, temperature=0.0)
        assert any("TimeoutError" in f for f in d.stats.failures)
    finally:
        server.stop(0)


def cli_drafter(target, address, *options):
    """The RemoteDrafter that `specfast generate --drafter remote:ADDRESS ...` makes."""
    import argparse

    from specfast import generate

    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    args = parser.parse_args(["--prompt", "-", "--drafter", f"remote:{address}", *options])
    return generate.remote_drafter(args, target.vocab_size)


def test_auth_token(target, tmp_path):
    server, port = serve(lambda: NgramDrafter(), auth_token="s3cret")
    try:
        with pytest.raises(RemoteError, match="authentication"):
            SpeculativeDecoder(target, remote(port, target), k=2).generate(PROMPTS[0], 4)
        ok = remote(port, target, auth_token="s3cret")
        SpeculativeDecoder(target, ok, k=2).generate(PROMPTS[0], 8)
        assert ok.stats.steps > 0
        token = tmp_path / "token"
        token.write_text("s3cret\n")
        cli = cli_drafter(target, f"127.0.0.1:{port}", "--token-file", str(token))
        SpeculativeDecoder(target, cli, k=2).generate(PROMPTS[0], 8)
        assert cli.stats.steps > 0 and not cli.stats.failures
    finally:
        server.stop(0)


def test_a_peer_without_the_token_is_refused_as_its_stream_opens(target):
    """The token also travels in the stream's metadata: a peer without it is
    refused before it sends anything (it held a worker for HELLO_WAIT, 10 s,
    waiting for a hello); the hello's token is checked too; any UTF-8 token."""
    import time as _time

    token = "s3cret-\u00e9\u6f22"
    server, port = serve(lambda: NgramDrafter(), auth_token=token, workers=1)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.DrafterStub(ch)
            silent = threading.Event()
            for metadata in (None, (("specfast-auth-bin", b"wrong"),)):
                t0 = _time.monotonic()
                with pytest.raises(grpc.RpcError) as refused:
                    list(stub.Session(iter(lambda: silent.wait(5) and None, 1),
                                      metadata=metadata, timeout=5))
                assert _time.monotonic() - t0 < 2
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert refused.value.details() == "authentication failed"
            replies = list(stub.Session(iter([hello(auth_token="wrong")]), timeout=5, metadata=(
                ("specfast-auth-bin", token.encode()),)))
            assert [r.error.message for r in replies] == ["authentication failed"]
        ok = remote(port, target, auth_token=token)
        SpeculativeDecoder(target, ok, k=2).generate(PROMPTS[0], 8)
        assert ok.stats.steps > 0 and not ok.stats.failures
    finally:
        server.stop(0)


def raw_session(port, messages, timeout=5.0):
    """Sends messages on one stream; returns the replies."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.DrafterStub(ch)
        return list(stub.Session(iter(messages), timeout=timeout))


def hello(version=1, sampling=None, **kw):
    h = pb.Hello(version=version, payload=pb.TOKENS, vocab_size=48, **kw)
    h.requests.add(tokens=[1, 2, 3, 1, 2], sampling=sampling or pb.Sampling(coupled=True))
    return pb.ToDrafter(hello=h)


@pytest.mark.parametrize("messages, error", [
    ([hello(version=2)], "protocol version 2 is not supported"),
    ([pb.ToDrafter(step=pb.Step(step=1))], "first message must be hello"),
    ([hello(), pb.ToDrafter(step=pb.Step(step=2))], "out of order"),
    ([hello(), pb.ToDrafter(step=pb.Step(step=1, updates=[pb.Update(append=[99], k=2)]))],
     "token ids must be in"),
    ([hello(), pb.ToDrafter(step=pb.Step(step=1, updates=[]))], "0 updates for 1 requests"),
    ([hello(), pb.ToDrafter(step=pb.Step(step=1, updates=[pb.Update(k=5000)]))], "exceeds"),
    ([hello(), pb.ToDrafter(step=pb.Step(step=1, select=[3], updates=[pb.Update()]))],
     "select"),
    ([hello(), hello()], "only steps"),
    ([hello(sampling=pb.Sampling(temperature=float("nan"), coupled=True))], "sampling needs"),
    ([hello(sampling=pb.Sampling(temperature=-1.0, coupled=True))], "temperature=-1.0"),
    ([hello(sampling=pb.Sampling(temperature=0.7, min_p=2.0, coupled=True))], "min_p=2.0"),
    ([hello(sampling=pb.Sampling(temperature=0.7, top_p=1.5, coupled=True))], "top_p=1.5"),
    ([hello(sampling=pb.Sampling(temperature=0.7, top_k=-1, coupled=True))], "top_k=-1"),
], ids=["version", "no-hello", "order", "token-id", "updates", "k", "select", "hello-twice",
        "nan-temperature", "negative-temperature", "min_p", "top_p", "top_k"])
def test_malformed_messages_are_refused(ngram_server, messages, error):
    replies = raw_session(ngram_server, messages)
    assert replies[-1].WhichOneof("msg") == "error"
    assert error in replies[-1].error.message


def test_a_valid_raw_session(ngram_server):
    step = pb.ToDrafter(step=pb.Step(step=1, updates=[pb.Update(k=3)]))
    replies = raw_session(ngram_server, [hello(), step])
    assert replies[0].welcome.version == 1
    assert list(replies[1].drafts.drafts[0].tokens) == [3, 1, 2]


def test_oversized_messages_are_refused():
    server, port = serve(lambda: NgramDrafter(), max_message=1 << 20)
    big = pb.Hello(version=1, payload=pb.TOKENS, vocab_size=48)
    big.requests.add(tokens=np.ones(2 << 20, np.int32).tolist())
    try:
        with pytest.raises(grpc.RpcError) as e:
            raw_session(port, [pb.ToDrafter(hello=big)], timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        server.stop(0)


def test_client_checks_its_arguments(target):
    with pytest.raises(ValueError, match="payload"):
        RemoteDrafter("127.0.0.1:1", payload="bytes", vocab_size=10)
    with pytest.raises(ValueError, match="top_k"):
        RemoteDrafter("127.0.0.1:1", payload="topk", top_k=0, vocab_size=10)
    for name, value, error in [("timeout", -1.0, ValueError), ("timeout", 0.0, ValueError),
                               ("timeout", float("nan"), ValueError), ("retry", -1.0, ValueError),
                               ("lookahead", 2.0, TypeError), ("lookahead", -1, ValueError)]:
        with pytest.raises(error, match=f"RemoteDrafter: {name} must be"):
            RemoteDrafter("127.0.0.1:1", vocab_size=10, **{name: value})
    for address in ("127.0.0.1:99999", "127.0.0.1:0", "127.0.0.1", "host:http"):
        with pytest.raises(ValueError, match="address must be HOST:PORT"):
            RemoteDrafter(address, vocab_size=10)  # 99999 connected to port 34463
    d = RemoteDrafter("127.0.0.1:1", vocab_size=10)
    d.close()
    with pytest.raises(ValueError, match="closed"):  # was grpc's "Channel closed!" mid-call
        d.start([[1, 2]], [Sampling()])


@pytest.mark.parametrize("payload, sampling", [
    ("tokens", dict()),
    ("tokens", dict(temperature=0.9, seed=[1, 2], method="coupled")),
    ("topk", dict(temperature=0.9, seed=[1, 2], method="rejection")),
], ids=["greedy", "coupled", "topk-rejection"])
def test_lookahead_serves_steps_without_a_round_trip(target, draft_model, payload, sampling):
    """The drafter drafts ahead while the target verifies; when the target
    accepted everything and the drafter's next token, that draft is used as it
    is. Output unchanged and the look-ahead really served (the target drafting
    for itself: its drafts are accepted, its next token guessed)."""
    server, port = serve(lambda: ModelDrafter(target))
    try:
        d = remote(port, target, payload=payload, lookahead=4)
        got = SpeculativeDecoder(target, d, k=3).generate(PROMPTS[:2], 30, **sampling)
        if sampling.get("method") != "rejection":
            for prompt, s, g in zip(PROMPTS, sampling.get("seed", [0, 0]), got):
                assert g.tokens == reference(target, prompt, 30, seed=s, method="coupled",
                                             temperature=sampling.get("temperature", 0.0))
        else:  # the drafts drawn ahead are the ones a local top-8 drafter draws
            local = SpeculativeDecoder(target, ModelDrafter(target, sparse_top=8), k=3)
            assert [g.tokens for g in got] == \
                [g.tokens for g in local.generate(PROMPTS[:2], 30, **sampling)]
        assert d.stats.ahead_hits > 0 and d.stats.local_steps == 0, d.stats.as_dict()
    finally:
        server.stop(0)


def test_a_silent_session_is_closed():
    server, port = serve(lambda: NgramDrafter(), idle=0.3)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.DrafterStub(ch)
            hold = threading.Event()

            def messages():
                yield hello()
                hold.wait(5)  # say nothing more

            replies = stub.Session(messages(), timeout=5)
            assert next(replies).WhichOneof("msg") == "welcome"
            assert "no message for 0.3 s" in next(replies).error.message
            hold.set()
    finally:
        server.stop(0)


def test_tls(target, tmp_path):
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    server, port = serve(lambda: NgramDrafter(), tls=(cert.read_bytes(), key.read_bytes()))
    try:
        d = RemoteDrafter(f"localhost:{port}", vocab_size=target.vocab_size,
                          tls=cert.read_bytes(), timeout=5.0)
        out = SpeculativeDecoder(target, d, k=3).generate(PROMPTS[0], 20)
        assert out.tokens == reference(target, PROMPTS[0], 20, temperature=0.0)
        assert d.stats.steps > 0 and not d.stats.failures
        cli = cli_drafter(target, f"localhost:{port}", "--tls-ca", str(cert))
        SpeculativeDecoder(target, cli, k=3).generate(PROMPTS[0], 8)
        assert cli.stats.steps > 0 and not cli.stats.failures
        plain = remote(port, target, timeout=1.0)  # no TLS: no session, decodes locally
        SpeculativeDecoder(target, plain, k=3).generate(PROMPTS[0], 8)
        assert plain.stats.steps == 0 and plain.stats.failures
    finally:
        server.stop(0)


class _Recording(NgramDrafter):
    keeps: list = []

    def rollback(self, lengths):
        _Recording.keeps.append(list(lengths))
        super().rollback(lengths)


def test_keep_of_a_silent_step_combines_with_a_pending_select():
    """rollback, select, rollback again with no step between (every k was 0):
    the step that goes out carries one keep in the order before the select, the
    shorter of the two per request (a keep sized after the select was refused
    by the server, which dropped the session)."""
    _Recording.keeps = []
    server, port = serve(lambda: _Recording())
    d = RemoteDrafter(f"127.0.0.1:{port}", vocab_size=48, timeout=5.0)
    try:
        ctx = [[1, 2, 3, 1, 2], [4, 5, 4, 5], [7, 8, 9, 7, 8]]
        samp = [Sampling() for _ in ctx]
        d.start(ctx, samp)
        d.propose(ctx, [2, 2, 2], samp)
        for c in ctx:
            c.extend([3, 1])
        d.rollback([len(c) - 1 for c in ctx])  # 6, 5, 6
        d.select([0, 2])
        d.rollback([len(ctx[0]) - 2, len(ctx[2])])  # 5, 7: the first shorter now
        d.propose([ctx[0], ctx[2]], [2, 2], [samp[0], samp[2]])
        assert d.stats.sessions == 1 and not d.stats.failures and d.stats.steps == 2
        assert _Recording.keeps[-1][0] == 5 and _Recording.keeps[-1][2] == 6
    finally:
        d.close()
        server.stop(0)


class _BadProbs(NgramDrafter):
    deterministic = False
    repeat = False  # a repeated id instead of NaN values

    def propose(self, contexts, ks, sampling):
        ids = np.array([1, 1, 2, 3] if self.repeat else [0, 1, 2, 3], np.int32)
        value = 0.25 if self.repeat else np.nan
        return [Draft([1] * k, SparseProbs(np.tile(ids, (k, 1)), np.full((k, 4), value, np.float32)))
                for k in ks]


@pytest.mark.parametrize("repeat", [False, True], ids=["nan", "repeated-id"])
def test_malformed_remote_probabilities_fall_back(target, repeat):
    """Probabilities the verifier would refuse end the session, not the generation."""
    _BadProbs.repeat = repeat
    server, port = serve(lambda: _BadProbs())
    d = remote(port, target, payload="topk", top_k=4, retry=100.0)
    try:
        g = SpeculativeDecoder(target, d, k=3).generate(PROMPTS[0], 12, temperature=1.0,
                                                       method="rejection", seed=4)
        assert len(g.tokens) == 12 and d.stats.local_steps > 0
        assert any("draft probabilities" in f or "repeats a token" in f for f in d.stats.failures)
    finally:
        d.close()
        server.stop(0)


class _Scripted(pb_grpc.DrafterServicer):
    """A drafter (not ours) that answers each step with what ``reply(step)`` yields
    (FromDrafter messages)."""

    def __init__(self, reply):
        self.reply = reply

    def Session(self, messages, context):
        for m in messages:
            if m.WhichOneof("msg") == "hello":
                yield pb.FromDrafter(welcome=pb.Welcome(version=1, drafter="scripted"))
                continue
            yield from self.reply(m.step)


def _fake_server(servicer):
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_DrafterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def _stray_byte(payload):
    """A drafter (not ours) whose probabilities carry one byte too many."""
    def reply(step):
        out = pb.Drafts(step=step.step)
        for u in step.updates:
            d = out.drafts.add(tokens=[1] * u.k)
            if u.k:
                d.ids.extend([1, 2, 3, 4] * u.k if payload == "topk" else [])
                d.probs = bytes(16 * u.k + 1)
        yield pb.FromDrafter(drafts=out)
    return _Scripted(reply)


@pytest.mark.parametrize("payload", ["topk", "dense"])
def test_probabilities_of_a_stray_byte_fall_back(target, payload):
    server, port = _fake_server(_stray_byte(payload))
    d = remote(port, target, payload=payload, top_k=4, retry=100.0)
    try:
        g = SpeculativeDecoder(target, d, k=3).generate(PROMPTS[0], 8, temperature=1.0,
                                                       method="rejection", seed=1)
        assert len(g.tokens) == 8 and d.stats.local_steps > 0
        assert any("not float32s" in f for f in d.stats.failures)
    finally:
        d.close()
        server.stop(0)


class _ChainOnly:
    """A target without keep_paths (as LlamaCppModel): it verifies chains only."""

    def __init__(self, target):
        self._target = target

    def __getattr__(self, name):
        if name == "keep_paths":
            raise AttributeError(name)
        return getattr(self._target, name)


def test_remote_trees_reach_a_chain_only_target_as_chains(target):
    server, port = serve(lambda: NgramDrafter(branches=3))
    d = remote(port, target)
    try:
        g = SpeculativeDecoder(_ChainOnly(target), d, k=4).generate(PROMPTS[0], 20)
        assert g.tokens == reference(target, PROMPTS[0], 20, temperature=0.0)
        assert d.stats.steps > 0 and not d.stats.failures
    finally:
        d.close()
        server.stop(0)


def test_sessions_beyond_the_workers_are_refused_and_freed_at_the_end(target):
    """workers=1: a second client is refused at once (and drafts locally) while
    the first holds the session; the first generation's end frees it."""
    server, port = serve(lambda: NgramDrafter(), workers=1)
    first, second = remote(port, target, retry=0.0), remote(port, target, retry=0.0)
    try:
        first.start([list(PROMPTS[0])], [Sampling()])
        t0 = time.monotonic()
        out = SpeculativeDecoder(target, second, k=4).generate(PROMPTS[0], 10)
        assert time.monotonic() - t0 < 4.0  # refused, not queued behind the first
        assert second.stats.sessions == 0 and second.stats.failures
        assert out.tokens == reference(target, PROMPTS[0], 10, temperature=0.0)
        first.finish()
        for _ in range(50):  # until the server has seen the first session end
            SpeculativeDecoder(target, second, k=4).generate(PROMPTS[0], 10)
            if second.stats.sessions:
                break
            time.sleep(0.1)
        assert second.stats.sessions == 1 and second.stats.steps > 0
        for _ in range(50):  # the second client's generation has ended: its session too
            SpeculativeDecoder(target, first, k=4).generate(PROMPTS[0], 10)
            if first.stats.sessions:
                break
            time.sleep(0.1)
        assert first.stats.sessions == 1 and first.stats.steps > 0
    finally:
        first.close()
        second.close()
        server.stop(0)


def test_serve_cli_runs_as_a_module():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "specfast.remote.serve_cli", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--workers" in out.stdout and "--idle" in out.stdout


def test_stale_replies_do_not_extend_the_wait(target):
    """A drafter that answers a step only with stale look-aheads, each well inside
    the timeout: the step still gives up after one timeout and drafts locally."""
    def stale(step):
        for _ in range(40):  # 8 s of them at most
            time.sleep(0.2)
            yield pb.FromDrafter(drafts=pb.Drafts(step=0, ahead=True))

    server, port = _fake_server(_Scripted(stale))
    d = remote(port, target, timeout=1.0, retry=100.0)
    try:
        ctx = [[1, 2, 3, 1, 2]]
        d.start(ctx, [Sampling()])
        t0 = time.monotonic()
        out = d.propose(ctx, [3], [Sampling()])
        assert time.monotonic() - t0 < 2.5
        assert d.stats.local_steps == 1 and out[0].tokens == [3, 1, 2]  # the n-gram's draft
        assert any("TimeoutError" in f for f in d.stats.failures)
    finally:
        d.close()
        server.stop(0)


def _edge_rows(rng, vocab, count):
    """Draft rows summing to within a few 2^-40 of 1 -/+ 1e-3 (float32 values):
    where a float sum and verify's exact sum of floor(q 2^40) can disagree."""
    rows = []
    for _ in range(count):
        target_sum = 1.0 + rng.choice([-1e-3, 1e-3])
        r = np.zeros(vocab, np.float32)
        r[1:] = (rng.dirichlet(np.ones(vocab - 1)) * (target_sum - 1e-6)).astype(np.float32)
        r[0] = np.float32(target_sum - r[1:].sum(dtype=np.float64))  # ~1e-6: fine steps
        for _ in range(int(rng.integers(-400, 400))):
            r[0] = np.nextafter(r[0], np.float32(1))
        rows.append(r)
    return rows


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "topk"])
def test_client_refuses_exactly_the_sums_verify_refuses(sparse):
    """A q row the client lets through must not make verify raise (that would
    end the generation, not the session): near both edges of the 1e-3 tolerance,
    the client's check agrees with verify's on every row, dense rows summed as
    fixed point, top-k ones in double (a top-k row summing to 1 + 1.00000002e-3
    passed the fixed-point check and verify raised)."""
    import specfast as sf
    from specfast.remote.client import _check_probs

    vocab = 48
    logits = np.zeros((3, vocab), np.float32)
    logits[0, 0] = -np.inf  # node 0 drafts token 0: rejected, its residual formed whole
    other = np.zeros(vocab, np.float32)
    other[1] = 1.0
    outcomes = set()
    for row in _edge_rows(np.random.default_rng(7), vocab, 300):
        q = np.stack([row, other])
        draft = q
        if sparse:  # as the client builds it: every id, -1 where q is 0
            draft = sf.SparseProbs(np.where(q > 0, np.arange(vocab), -1).astype(np.int32), q)
        try:
            sf.verify(logits, np.array([0, 1]), np.array([2]), draft_probs=draft,
                      parents=np.array([-1, -1]), seed=3)
            verify_ok = True
        except ValueError:
            verify_ok = False
        try:
            _check_probs(q, sparse=sparse)
            client_ok = True
        except RemoteError:
            client_ok = False
        assert client_ok == verify_ok, (row.sum(dtype=np.float64), verify_ok)
        outcomes.add(verify_ok)
    assert outcomes == {True, False}


@pytest.mark.parametrize("payload", ["topk", "dense"])
def test_a_draft_token_without_probability_falls_back(target, payload):
    """A drafter whose probabilities put nothing on the token it drafted did not draw
    it from them: verifying it would bias the output. The session ends, locally
    drafted steps go on."""
    vocab = target.vocab_size

    def liar(step):
        out = pb.Drafts(step=step.step)
        for u in step.updates:
            d = out.drafts.add(tokens=[0] * u.k)
            if u.k and payload == "topk":
                d.ids.extend([3, 1] * u.k)
                d.probs = np.tile(np.array([1.0, 0.0], "<f4"), u.k).tobytes()
            elif u.k:
                q = np.zeros((u.k, vocab), "<f4")
                q[:, 3] = 1.0
                d.probs = q.tobytes()
        yield pb.FromDrafter(drafts=out)

    server, port = _fake_server(_Scripted(liar))
    d = remote(port, target, payload=payload, top_k=2, retry=100.0)
    try:
        g = SpeculativeDecoder(target, d, k=2).generate(PROMPTS[0], 8, temperature=1.0,
                                                       method="rejection", seed=2)
        assert len(g.tokens) == 8 and d.stats.steps == 0 and d.stats.local_steps > 0
        assert any("no probability" in f or "probability 0" in f for f in d.stats.failures)
    finally:
        d.close()
        server.stop(0)


def _step(n, updates, keep=()):
    st = pb.Step(step=n, keep=list(keep))
    for append, k in updates:
        st.updates.add(append=append, k=k)
    return pb.ToDrafter(step=st)


def test_model_drafter_served_survives_what_the_protocol_allows(draft_model):
    """A step without keep (the protocol's 'no rollback') or with a keep past what the
    drafter holds still gets drafts from a model drafter; a prompt id outside the
    draft model's vocabulary is refused at hello, with what was wrong."""
    server, port = serve(lambda: ModelDrafter(draft_model))
    try:
        h = pb.Hello(version=1, payload=pb.TOKENS, vocab_size=draft_model.vocab_size)
        for p in ([1, 2, 3], [4, 5, 6]):
            h.requests.add(tokens=p, sampling=pb.Sampling())
        for later in (_step(2, [([], 2), ([], 2)]),
                      _step(2, [([], 2), ([], 2)], keep=[0, 5])):
            replies = raw_session(port, [pb.ToDrafter(hello=h), _step(1, [([], 2), ([], 2)]),
                                         later])
            assert [r.WhichOneof("msg") for r in replies] == ["welcome", "drafts", "drafts"]
            assert all(len(d.tokens) == 2 for d in replies[-1].drafts.drafts)
        big = pb.Hello(version=1, payload=pb.TOKENS, vocab_size=draft_model.vocab_size + 52)
        big.requests.add(tokens=[1, draft_model.vocab_size + 12], sampling=pb.Sampling())
        replies = raw_session(port, [pb.ToDrafter(hello=big), _step(1, [([], 2)])])
        assert replies[-1].WhichOneof("msg") == "error"
        assert "drafter's vocabulary" in replies[-1].error.message
    finally:
        server.stop(0)


def test_a_failing_drafter_ends_its_session_with_an_error():
    class Broken(NgramDrafter):
        def propose(self, contexts, ks, sampling):
            raise RuntimeError("out of memory")

    server, port = serve(lambda: Broken())
    try:
        replies = raw_session(port, [hello(), _step(1, [([], 3)])])
        assert replies[-1].WhichOneof("msg") == "error"
        assert "drafter failed: RuntimeError: out of memory" in replies[-1].error.message
    finally:
        server.stop(0)


def test_a_drafter_failing_at_connect_hands_over_to_the_fallback(target):
    """A drafter that fails as its session starts (out of memory, say) ends the
    session, not the generation (its Error is transient; it raised RemoteError)."""
    class Broken(NgramDrafter):
        def start(self, contexts, sampling):
            raise RuntimeError("out of memory")

    server, port = serve(lambda: Broken())
    try:
        replies = raw_session(port, [hello()])
        assert replies[-1].error.transient and "out of memory" in replies[-1].error.message
        d = remote(port, target, timeout=2.0)
        out = SpeculativeDecoder(target, d, k=3).generate(PROMPTS[0], 12)
        assert out.tokens == reference(target, PROMPTS[0], 12, temperature=0.0)
        assert d.stats.sessions == 0 and d.stats.local_steps > 0
        assert "drafter failed: RuntimeError: out of memory" in d.stats.failures[0]
        refused = raw_session(port, [hello(version=2)])  # refused before the drafter starts
        assert not refused[-1].error.transient  # a refusal of the settings stays one
    finally:
        server.stop(0)


def test_a_client_that_stops_reading_is_closed_after_idle(target):
    """A client that asks for drafts and never reads them fills the stream's window;
    the session's worker blocked in sending was never freed (workers=1: every later
    target was refused). It is closed after idle seconds."""
    server, port = serve(lambda: NgramDrafter(), workers=1, idle=1.0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            B = 200
            hold = threading.Event()

            def flood():
                h = pb.Hello(version=1, payload=pb.TOKENS, vocab_size=48)
                for _ in range(B):  # long repeats: every draft is k tokens
                    h.requests.add(tokens=list(range(40)) * 30,
                                   sampling=pb.Sampling(coupled=True))
                yield pb.ToDrafter(hello=h)
                for i in range(1, 60):  # ~200 KB of replies each, never read
                    yield _step(i, [([], 1024)] * B)
                hold.wait(60)

            call = pb_grpc.DrafterStub(ch).Session(flood())  # its replies never read
            try:
                time.sleep(1.0)
                deadline = time.monotonic() + 20
                while True:  # a target's session once the stalled one is closed
                    d = remote(port, target, timeout=2.0)
                    d.start([[1, 2, 3, 1, 2]], [Sampling()])
                    d.close()
                    if d.stats.sessions or time.monotonic() > deadline:
                        break
                    time.sleep(0.5)
                assert d.stats.sessions == 1, d.stats.failures
            finally:
                hold.set()
                call.cancel()
    finally:
        server.stop(0)


def test_a_client_that_half_closes_ends_its_session_cleanly():
    """Messages sent back to back, then the end of the stream, while the drafter is
    busy: every step is answered and the session ends without an error (the end
    of the stream was dropped when the one-message inbox was full)."""
    class Slow(NgramDrafter):
        def propose(self, contexts, ks, sampling):
            time.sleep(1.2)
            return super().propose(contexts, ks, sampling)

    server, port = serve(lambda: Slow(), idle=30.0)
    try:
        replies = raw_session(port, [hello(), _step(1, [([], 2)]), _step(2, [([], 2)])],
                              timeout=20.0)
        assert [r.WhichOneof("msg") for r in replies] == ["welcome", "drafts", "drafts"]
    finally:
        server.stop(0)


def test_a_session_past_max_tokens_is_refused(target):
    """Contexts grow the server's memory (and a model drafter's prefill): a session
    may hold max_tokens tokens in all (a client appending 4M ids a step reached GBs).
    Past it the client drafts locally: the Error is transient."""
    server, port = serve(lambda: NgramDrafter(), max_tokens=100)
    try:
        ok = raw_session(port, [hello(), _step(1, [(list(range(40)), 2)]),
                                _step(2, [(list(range(40)), 2)])])
        assert [r.WhichOneof("msg") for r in ok] == ["welcome", "drafts", "drafts"]  # 85
        over = raw_session(port, [hello(), _step(1, [(list(range(96)), 2)])])  # 101
        assert "would hold 101 tokens, over this drafter's limit of 100" in \
            over[-1].error.message
        big = pb.Hello(version=1, payload=pb.TOKENS, vocab_size=48)
        for _ in range(3):
            big.requests.add(tokens=[1] * 40, sampling=pb.Sampling(coupled=True))
        refused = raw_session(port, [pb.ToDrafter(hello=big)])[-1].error
        assert "limit of 100" in refused.message and refused.transient
        d = remote(port, target, timeout=2.0)  # prompts past it: drafted locally
        try:
            d.start([[1] * 120], [Sampling()])
            assert d.stats.sessions == 0 and "limit of 100" in d.stats.failures[0]
        finally:
            d.close()
    finally:
        server.stop(0)


def _draft_for(d, seconds):
    """Starts d and asks it for drafts, as a decoding loop would, for ``seconds``."""
    d.start([[1, 2, 3]], [Sampling()])
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        d.propose([[1, 2, 3]], [2], [Sampling()])
        time.sleep(0.005)


def test_reconnection_tries_back_off_while_they_fail(target):
    """Each failed try may cost the whole timeout (a peer that hangs): tries come
    after retry seconds, doubling while they fail (every retry seconds before: a
    hung drafter cost 3x the generation's time)."""
    server, port = serve(lambda: NgramDrafter())
    server.stop(0)  # nothing listens there now: each try fails at once
    d = remote(port, target, timeout=0.5, retry=0.05)
    try:
        _draft_for(d, 1.6)
        # at 0.05, 0.1, 0.2, 0.4, 0.8 s apart: the start's try and 4 or 5 more (32 without)
        assert 4 <= len(d.stats.failures) <= 7, d.stats.failures
    finally:
        d.close()


def test_a_drafter_that_welcomes_then_hangs_is_tried_less_and_less(target):
    """Backing off counts from the last drafted step, not the last welcome: a
    drafter that answers hello and then never drafts was tried every retry s."""
    release = threading.Event()

    class Hung(NgramDrafter):
        def propose(self, contexts, ks, sampling):
            release.wait(10)
            return super().propose(contexts, ks, sampling)

    server, port = serve(lambda: Hung(), workers=16)
    d = remote(port, target, timeout=0.3, retry=0.1)
    try:
        _draft_for(d, 3.0)
        # tries at about 0, 0.4, 0.9, 1.6, 2.7 s (every 0.4 s, 8 of them, before)
        assert 2 <= d.stats.sessions <= 5, d.stats.failures
    finally:
        release.set()
        d.close()
        server.stop(0)


def test_a_tls_root_that_is_not_pem_is_refused(target):
    with pytest.raises(ValueError, match="PEM"):
        remote(1, target, tls=b"not a certificate")


def test_a_server_certificate_or_key_that_is_not_pem_is_refused():
    """Said as such, not as grpc's 'cannot bind' after its TLS log lines."""
    cert = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    key = b"-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n"
    with pytest.raises(ValueError, match="certificate is not PEM"):
        serve(lambda: NgramDrafter(), tls=(b"junk", key))
    with pytest.raises(ValueError, match="key is not a PEM private key"):
        serve(lambda: NgramDrafter(), tls=(cert, cert))  # the certificate twice
    with pytest.raises(TypeError, match="cert_pem, key_pem"):
        serve(lambda: NgramDrafter(), tls=cert)


def test_an_empty_token_is_refused(tmp_path):
    import subprocess
    import sys

    with pytest.raises(ValueError, match="auth_token"):
        serve(lambda: NgramDrafter(), auth_token="")
    empty = tmp_path / "token"
    empty.write_text("\n")
    out = subprocess.run([sys.executable, "-m", "specfast.remote.serve_cli", "--port", "0",
                          "--token-file", str(empty)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "holds no token" in out.stderr


def test_a_step_that_timed_out_is_not_priced_as_drafting(target):
    """A step whose drafts never came waited the whole timeout: that time is not what
    drafting costs (Drafter.stalled), so the draft length controller leaves it out.
    It kept it, priced the fallback's drafts at the timeout, and hardly drafted
    again in that generation (270 target steps where 29 did)."""
    calls = [0]

    class HangsOnce(NgramDrafter):
        def propose(self, contexts, ks, sampling):
            calls[0] += 1
            if calls[0] == 2:
                time.sleep(3.0)
            return super().propose(contexts, ks, sampling)

    server, port = serve(lambda: HangsOnce())
    d = remote(port, target, timeout=1.0, retry=60.0)
    try:
        ctx = [[1, 2, 3, 1, 2]]
        d.start(ctx, [Sampling()])
        stalled = []
        for _ in range(3):
            d.propose(ctx, [2], [Sampling()])
            stalled.append(d.stalled)
        assert stalled == [False, True, False] and d.stats.local_steps == 2
        d.close()
        calls[0] = 0
        d = remote(port, target, timeout=1.0, retry=60.0)
        dec = SpeculativeDecoder(target, d, k=4)
        out = dec.generate(PROMPTS[0], 24)
        assert out.tokens == reference(target, PROMPTS[0], 24, temperature=0.0)
        assert any("TimeoutError" in f for f in d.stats.failures)
        seen = [t for times in dec.controller._draft.values() for t in times]
        assert seen and max(seen) < 1.0, seen
    finally:
        d.close()
        server.stop(0)


def test_backoff_outlives_the_generation(target):
    """A drafter that failed is tried again after retry seconds, not at the next
    generation's start: each start tried a hung drafter and paid the timeout."""
    release = threading.Event()

    class Hung(pb_grpc.DrafterServicer):
        def Session(self, messages, context):
            next(messages)
            release.wait(20)
            return
            yield

    server, port = _fake_server(Hung())
    d = remote(port, target, timeout=0.3, retry=60.0)
    try:
        dec = SpeculativeDecoder(target, d, k=2)
        for _ in range(3):
            dec.generate(PROMPTS[0], 4)
        assert d.stats.failures == []  # this generation's: no try was made
        assert d.stats.local_steps > 0 and d.stats.sessions == 0
    finally:
        release.set()
        d.close()
        server.stop(0)


def test_the_client_reads_ahead_a_bounded_number_of_replies(target):
    """A drafter that streams replies faster than steps read them fills gRPC's
    window, not the target's memory (the client queued 300 stale 1 MB messages
    within 3 s)."""
    def flood(step):
        out = pb.Drafts(step=step.step)
        for u in step.updates:
            out.drafts.add(tokens=[3] * u.k)
        yield pb.FromDrafter(drafts=out)
        for _ in range(100):
            yield pb.FromDrafter(drafts=pb.Drafts(step=0, ahead=True,
                                                  drafts=[pb.Draft(probs=bytes(1 << 16))]))

    server, port = _fake_server(_Scripted(flood))
    before = set(threading.enumerate())
    d = remote(port, target)
    try:
        ctx = [[1, 2, 3, 1, 2]]
        d.start(ctx, [Sampling()])
        assert d.propose(ctx, [2], [Sampling()])[0].tokens == [3, 3]
        deadline = time.monotonic() + 10
        while d._stream._in.qsize() < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert d._stream._in.qsize() == 8  # of the 100 sent: the rest wait in gRPC
    finally:
        d.close()
        server.stop(0)

    def readers():  # the reader, blocked on the full inbox, ends with the stream
        return [t for t in set(threading.enumerate()) - before if t.name.endswith("(_read)")]

    deadline = time.monotonic() + 10
    while readers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not readers()


def test_drafts_are_cut_to_the_sessions_limits(draft_model):
    """A step's drafts count against max_tokens with the contexts (a model drafter
    holds them in its cache), and a DENSE step's rows must fit in one message: k is
    cut to what is left. 20 requests asking 300 tokens each, at max_tokens=100, had
    the drafter hold 6080 tokens."""
    room = 32 * 20 + 4 * 64 * (4 * draft_model.vocab_size + 16)  # 256 rows of 20 requests
    server, port = serve(lambda: ModelDrafter(draft_model), max_tokens=100, max_message=room)
    try:
        h = pb.Hello(version=1, payload=pb.DENSE, vocab_size=draft_model.vocab_size)
        for _ in range(20):
            h.requests.add(tokens=[1, 2, 3, 4], sampling=pb.Sampling(temperature=1.0))
        replies = raw_session(port, [pb.ToDrafter(hello=h), _step(1, [([], 300)] * 20)])
        sizes = [len(d.tokens) for d in replies[-1].drafts.drafts]
        assert [r.WhichOneof("msg") for r in replies] == ["welcome", "drafts"]
        assert sum(sizes) == 20 and sizes[0] == 20  # 100 - 80 held, first requests first
        h.requests[0].tokens[:] = [1]
        replies = raw_session(port, [pb.ToDrafter(hello=h), _step(1, [([], 300)] * 20)])
        assert sum(len(d.tokens) for d in replies[-1].drafts.drafts) == 23  # 100 - 77
    finally:
        server.stop(0)
    server, port = serve(lambda: ModelDrafter(draft_model), max_message=room)
    try:
        replies = raw_session(port, [pb.ToDrafter(hello=h), _step(1, [([], 300)] * 20)])
        assert sum(len(d.tokens) for d in replies[-1].drafts.drafts) == 4 * 64  # the message
    finally:
        server.stop(0)


def test_dense_drafts_of_a_smaller_draft_vocabulary_travel(target):
    """A draft model with fewer ids than the target (the server takes it) sends its
    dense rows padded with zeros to the target's vocabulary; they were sent at the
    draft model's width and refused every step ("a dense draft of the wrong size")."""
    big, small = tiny_model(vocab=48, seed=0), tiny_model(vocab=40, seed=1)
    with torch.no_grad():  # the target's top 5 stay in the draft's ids
        big.model.lm_head.weight[40:] = 0
    server, port = serve(lambda: ModelDrafter(small))
    d = remote(port, big, payload="dense")
    try:
        out = SpeculativeDecoder(big, d, k=3).generate([1, 2, 3, 1, 2, 3, 1], 12,
                                                       temperature=1.0, top_k=5, seed=3,
                                                       method="rejection")
        assert len(out.tokens) == 12
        assert d.stats.steps > 0 and d.stats.local_steps == 0, d.stats.failures
    finally:
        d.close()
        server.stop(0)


def test_a_batch_past_the_servers_limit_drafts_locally(target, monkeypatch):
    """More requests than the server serves is a transient refusal (drafted locally),
    as more tokens is: it raised RemoteError and failed the generation."""
    from specfast.remote import server as srv

    monkeypatch.setattr(srv, "MAX_BATCH", 2)
    server, port = serve(lambda: NgramDrafter())
    d = remote(port, target)
    try:
        out = SpeculativeDecoder(target, d, k=2).generate(PROMPTS[:3], 6)
        assert [o.tokens for o in out] == [reference(target, p, 6, temperature=0.0)
                                           for p in PROMPTS[:3]]
        assert d.stats.sessions == 0 and "at most 2 requests" in d.stats.failures[0]
    finally:
        d.close()
        server.stop(0)


def test_an_unused_top_k_slot_may_hold_any_id(target):
    """drafter.proto: a slot of probability 0 is unused and its id means nothing; a
    drafter padding with 0xFFFFFFFF had every draft refused."""
    def padded(step):
        out = pb.Drafts(step=step.step)
        for u in step.updates:
            d = out.drafts.add(tokens=[3] * min(u.k, 1))
            for _ in d.tokens:
                d.ids.extend([3, 0xFFFFFFFF])
                d.probs += np.array([1.0, 0.0], "<f4").tobytes()
        yield pb.FromDrafter(drafts=out)

    server, port = _fake_server(_Scripted(padded))
    d = remote(port, target, payload="topk", top_k=2)
    try:
        ctx = [[1, 2, 3, 1, 2]]
        d.start(ctx, [Sampling(temperature=1.0)])
        got = d.propose(ctx, [2], [Sampling(temperature=1.0)])[0]
        assert got.tokens == [3] and d.stats.failures == []
        assert got.probs.indices.tolist() == [[3, -1]]
    finally:
        d.close()
        server.stop(0)


def test_the_delay_proxy_closes_what_ended():
    """DelayProxy closes both sockets of a connection once both directions have
    ended (they stayed open until the proxy closed)."""
    import socket

    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def echo():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            c.sendall(c.recv(16))
            c.close()

    threading.Thread(target=echo, daemon=True).start()
    with DelayProxy(("127.0.0.1", port), delay=0.0) as proxy:
        for _ in range(5):
            with socket.create_connection(("127.0.0.1", proxy.port)) as c:
                c.sendall(b"hi")
                assert c.recv(16) == b"hi"
        deadline = time.monotonic() + 5
        while proxy._conns and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proxy._conns == []
    srv.close()


@contextlib.contextmanager
def _backed_off(target, make_drafter, prompt, client=(), server=()):
    """A RemoteDrafter whose generation started within the backoff of a failed try
    (nothing listened on its port then), and a server that now listens there, the
    backoff over: the next step's try is the generation's first. ``client`` and
    ``server``: their extra keyword arguments."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    # timeout: room for a loaded machine to answer (the sanitized suite beside other
    # work once took over 0.5 s, and the try was drafted around)
    d = remote(port, target, timeout=3.0, retry=0.5, **dict(client))
    srv = None
    try:
        d.start(prompt, [Sampling()])  # nothing listens yet: a failure, then a backoff
        assert d.stats.failures and d.stats.sessions == 0
        srv, _ = serve(make_drafter, port=port, **dict(server))
        d.start(prompt, [Sampling()])  # within the backoff: no try
        time.sleep(0.6)
        yield d
    finally:
        d.close()
        if srv is not None:
            srv.stop(0)


def test_a_refusal_at_a_generations_first_try_raises(target):
    """A generation whose start waits out an earlier failure's backoff still says a
    refusal of its settings at its first try (a wrong token): it was drafted around."""
    ctx = [[1, 2, 3, 1, 2]]
    with _backed_off(target, lambda: NgramDrafter(), ctx, client=dict(auth_token="wrong"),
                     server=dict(auth_token="right")) as d:
        with pytest.raises(RemoteError, match="authentication failed"):
            d.propose(ctx, [2], [Sampling()])
        d.propose(ctx, [2], [Sampling()])  # a later try of the same generation: drafted around


def test_closing_the_delay_proxy_ends_its_connections():
    """close() shuts the connections down, so both peers see the link drop (a pump
    blocked on a socket kept it open)."""
    import socket

    srv = socket.create_server(("127.0.0.1", 0))
    proxy = DelayProxy(("127.0.0.1", srv.getsockname()[1]), delay=0.0)
    c = socket.create_connection(("127.0.0.1", proxy.port))
    up, _ = srv.accept()
    c.sendall(b"x")
    assert up.recv(1) == b"x"
    proxy.close()
    c.settimeout(5)
    up.settimeout(5)
    assert c.recv(1) == b"" and up.recv(1) == b""
    for sock in (c, up, srv):
        sock.close()


def test_a_draft_tree_with_a_forward_parent_falls_back(target):
    """A drafter (not ours) whose tree names a later node as a parent ([1, -1]) is
    refused by the client ("invalid parents") and the fallback drafts: the output is
    plain greedy decoding's (let through, tree_mask raised and ended the generation)."""
    def forward(step):
        out = pb.Drafts(step=step.step)
        for u in step.updates:
            if u.k >= 2:
                out.drafts.add(tokens=[3, 4], parents=[1, -1])
            else:
                out.drafts.add()
        yield pb.FromDrafter(drafts=out)

    server, port = _fake_server(_Scripted(forward))
    d = remote(port, target, retry=100.0)
    try:
        out = SpeculativeDecoder(target, d, k=4).generate(PROMPTS[0], 12)
        assert out.tokens == reference(target, PROMPTS[0], 12, temperature=0.0)
        assert d.stats.steps == 0 and d.stats.local_steps > 0
        assert any("invalid parents" in f for f in d.stats.failures), d.stats.failures
    finally:
        d.close()
        server.stop(0)


def test_rows_selected_away_stop_counting_toward_max_tokens():
    """After a select the session holds only the kept rows' tokens: the surviving
    row may append and get drafts up to max_tokens (the dropped rows' 40 tokens
    still counted would make this 110 tokens, over the limit of 100)."""
    server, port = serve(lambda: NgramDrafter(), max_tokens=100)
    try:
        h = pb.Hello(version=1, payload=pb.TOKENS, vocab_size=48)
        for p in ([4, 5, 6, 7] * 10, [1, 2, 3] * 13 + [1]):
            h.requests.add(tokens=p, sampling=pb.Sampling(coupled=True))
        st = pb.Step(step=1, select=[1])
        st.updates.add(append=[2, 3, 1] * 10, k=3)  # 40 + 30 = 70 held
        replies = raw_session(port, [pb.ToDrafter(hello=h), pb.ToDrafter(step=st)])
        assert [r.WhichOneof("msg") for r in replies] == ["welcome", "drafts"], replies[-1]
        assert [list(d.tokens) for d in replies[-1].drafts.drafts] == [[2, 3, 1]]
    finally:
        server.stop(0)


class _Ramp(NgramDrafter):
    """Drafts len(context), len(context) + 1, ... (k of them): each draft says
    which context and k it was asked for."""

    def propose(self, contexts, ks, sampling):
        return [Draft([(len(c) + j) % 48 for j in range(k)]) for c, k in zip(contexts, ks)]


def _live_session(port):
    """A stream whose messages are sent one at a time: ``(send, replies, close)``."""
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    out: queue.Queue = queue.Queue()
    replies = pb_grpc.DrafterStub(ch).Session(iter(out.get, None), timeout=20)

    def close():
        out.put(None)
        replies.cancel()
        ch.close()

    return out.put, replies, close


def test_the_lookahead_drafts_lookahead_tokens_past_its_assumption():
    """The look-ahead assumes the step's whole draft and the drafter's own next
    token accepted, and drafts ``lookahead`` tokens past them (lookahead + 1 asked
    of the drafter, its first token assumed)."""
    server, port = serve(lambda: _Ramp())
    send, replies, close = _live_session(port)
    try:
        send(hello(lookahead=4))  # a prompt of 5 tokens
        assert next(replies).WhichOneof("msg") == "welcome"
        send(_step(1, [([], 3)]))
        drafts = next(replies).drafts
        assert drafts.step == 1 and not drafts.ahead
        assert list(drafts.drafts[0].tokens) == [5, 6, 7]
        ahead = next(replies).drafts
        assert ahead.step == 1 and ahead.ahead and len(ahead.drafts) == 1
        assert list(ahead.drafts[0].assumed) == [5, 6, 7, 8]  # the draft, then its next
        assert list(ahead.drafts[0].tokens) == [9, 10, 11, 12]  # lookahead = 4 past them
    finally:
        close()
        server.stop(0)


@pytest.mark.parametrize("max_tokens, sent", [(13, True), (12, False)])
def test_the_lookahead_counts_the_steps_drafts_against_max_tokens(max_tokens, sent):
    """A prompt of 5, a step draft of 3 and a look-ahead of 4 + 1 hold 13 tokens:
    at max_tokens=13 the look-ahead goes out, at 12 an empty one (the step's own
    drafts take what the limit leaves), and the next reply is the next step's."""
    server, port = serve(lambda: _Ramp(), max_tokens=max_tokens)
    send, replies, close = _live_session(port)
    try:
        send(hello(lookahead=4))
        assert next(replies).WhichOneof("msg") == "welcome"
        send(_step(1, [([], 3)]))
        drafts = next(replies).drafts
        assert not drafts.ahead and list(drafts.drafts[0].tokens) == [5, 6, 7]  # uncut
        ahead = next(replies).drafts
        assert ahead.ahead and ahead.step == 1
        if sent:
            assert list(ahead.drafts[0].tokens) == [9, 10, 11, 12]
        else:  # said empty: a client whose drafts were all accepted waits for it
            assert len(ahead.drafts) == 0
        send(_step(2, [([], 0)]))
        nxt = next(replies).drafts
        assert nxt.step == 2 and not nxt.ahead, nxt
    finally:
        close()
        server.stop(0)


def test_bytes_per_step_counts_both_directions(target):
    """TransferStats counts the steps' messages both ways: bytes_sent those the
    drafter received, bytes_received those it sent, bytes_per_step their sum per
    step (as the generation's metrics report it)."""
    up, down = [], []

    def echo(step):
        out = pb.FromDrafter(drafts=pb.Drafts(step=step.step, drafts=[
            pb.Draft(tokens=[3] * u.k) for u in step.updates]))
        up.append(pb.ToDrafter(step=step).ByteSize())
        down.append(out.ByteSize())
        yield out

    server, port = _fake_server(_Scripted(echo))
    d = remote(port, target, retry=100.0)
    try:
        dec = SpeculativeDecoder(target, d, k=4)
        out = dec.generate(PROMPTS[0], 12)
        assert out.tokens == reference(target, PROMPTS[0], 12, temperature=0.0)
        st = d.stats
        assert st.steps == len(up) == len(down) > 0 and not st.failures
        assert st.bytes_sent == sum(up) and st.bytes_received == sum(down) > 0
        assert st.bytes_per_step == pytest.approx((sum(up) + sum(down)) / st.steps)
        assert st.bytes_per_drafted_token == pytest.approx((sum(up) + sum(down)) / st.drafted)
        assert dec.last_metrics.transfer["bytes_per_step"] == st.bytes_per_step
    finally:
        d.close()
        server.stop(0)


@pytest.mark.parametrize("max_tokens", [12, 4096], ids=["past-the-limit", "within"])
def test_a_lookahead_the_server_cannot_draft_costs_no_wait(target, max_tokens):
    """Every draft accepted, the client waits for the look-ahead before its next
    step; where the server's limits leave it none to draft it says so (an empty
    one), so the step goes out at once: it waited out the whole timeout, then
    dropped the session and drafted locally."""
    server, port = serve(lambda: _Ramp(), max_tokens=max_tokens)
    d = remote(port, target, timeout=3.0, lookahead=4)
    try:
        ctx = [[1, 2, 3, 4, 5]]
        d.start(ctx, [Sampling()])
        first = d.propose(ctx, [3], [Sampling()])[0].tokens  # [5, 6, 7]
        ctx = [ctx[0] + first + [8]]  # all accepted, then the target's own token
        t0 = time.monotonic()
        d.propose(ctx, [3], [Sampling()])
        assert time.monotonic() - t0 < 1.5
        assert d.stats.steps == 2 and not d.stats.failures, d.stats.failures
    finally:
        d.close()
        server.stop(0)


def test_an_interrupt_awaiting_the_welcome_frees_the_servers_worker(target, monkeypatch):
    """Ctrl-C while a session opens (the welcome not yet read) closes its stream:
    the server's one worker was held until its idle limit, and every other
    client drafted locally meanwhile."""
    from specfast.remote import client

    server, port = serve(lambda: NgramDrafter(), workers=1)
    receive = client._Stream.receive

    def interrupted(self, deadline=None):
        raise KeyboardInterrupt

    ctx = [[1, 2, 3, 1, 2]]
    d, other = remote(port, target), remote(port, target)
    try:
        monkeypatch.setattr(client._Stream, "receive", interrupted)
        with pytest.raises(KeyboardInterrupt):
            d.start(ctx, [Sampling()])
        monkeypatch.setattr(client._Stream, "receive", receive)
        for _ in range(50):  # the server sees the cancel at once; allow a slow machine
            other.start(ctx, [Sampling()])
            if other.stats.sessions:
                break
            other._next_try = 0.0
            time.sleep(0.1)
        assert other.stats.sessions == 1, other.stats.failures
    finally:
        d.close()
        other.close()
        server.stop(0)


def test_a_refusal_of_generated_ids_drafts_around(target):
    """A draft model with fewer ids than the target: a session opened mid-generation
    (the first try after a backoff) sends contexts holding generated ids past the
    draft vocabulary, which the server refuses. That refusal is the generation's, not
    a setting to fix: it drafts locally (it raised, ending the generation). Prompt ids
    past it at the first try still raise (test_a_refusal_at_a_generations_first_try_raises
    for the rule)."""
    small = tiny_model(vocab=40, seed=1)
    prompt = [[1, 2, 3, 1, 2]]
    with _backed_off(target, lambda: ModelDrafter(small), prompt) as d:
        grown = [prompt[0] + [45, 3]]  # a generated id the draft model lacks
        d.propose(grown, [2], [Sampling()])
        assert d.stats.sessions == 0 and d.stats.local_steps == 1
        assert "[0, 40)" in d.stats.failures[-1], d.stats.failures
        d._next_try = 0.0
        with pytest.raises(RemoteError, match=r"\[0, 40\)"):
            d.start(grown, [Sampling()])  # the same ids as a prompt: said
