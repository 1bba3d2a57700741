"""The decoding loop end to end on tiny random transformers models (seconds).

Exactness is checked against references that do not share the loop: greedy
and coupled sampling token by token with a full forward each step (no KV
cache, no drafting), and rejection mode statistically against the exact joint
distribution of the first tokens. The models run in float64 so that a forward
over k + 1 positions and one over 1 position round to the same float32 logits;
the real model (float32) is measured in test_decoder_smollm2.py.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import specfast  # noqa: E402
from specfast.adapters.hf import HFModel  # noqa: E402
from specfast import decoder  # noqa: E402
from specfast.decoder import DraftLength, SpeculativeDecoder  # noqa: E402
from specfast.drafters import Draft, Drafter, ModelDrafter, NgramDrafter  # noqa: E402

from reference import ref_probs_row  # noqa: E402
from stats import assert_outcomes, scaled  # noqa: E402


def tiny_model(vocab=48, seed=0, layers=2, scale=0.6):
    """A random Llama small enough to run thousands of steps per second."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=scale, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).double()
    adapter = HFModel(model, None, name=f"tiny-{vocab}-{seed}")
    adapter.eos_token_ids = []  # random models: no end of sequence
    return adapter


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread (and a busy CI machine punishes
    spinning thread pools)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def draft_model():
    return tiny_model(seed=1, layers=1)


def full_logits(adapter, ids):
    """Logits after ``ids``, by a full forward without cache (float32)."""
    with torch.inference_mode():
        out = adapter.model(input_ids=torch.tensor([ids]), use_cache=False)
    return out.logits[0, -1:].float().numpy()


def two_token_joint(target, prompt, **params):
    """The exact distribution of the first two tokens after ``prompt`` (float64
    reference of the sampling parameters, not specfast's kernels)."""
    p1 = ref_probs_row(full_logits(target, prompt)[0], **params)
    expected = {}
    for a in np.nonzero(p1)[0]:
        p2 = ref_probs_row(full_logits(target, prompt + [int(a)])[0], **params)
        for b in np.nonzero(p2)[0]:
            expected[(int(a), int(b))] = float(p1[a] * p2[b])
    return expected


def reference(adapter, prompt, n, **sampling):
    """Plain decoding, token by token: specfast.sample at each absolute position."""
    ids = list(prompt)
    for _ in range(n):
        tok = specfast.sample(full_logits(adapter, ids), position=len(ids), **sampling)
        ids.append(int(tok[0]))
    return ids[len(prompt):]


PROMPTS = [[3, 7, 11, 3, 7, 11, 3, 7], [5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [9, 9, 9]]


@pytest.mark.parametrize("k", ["auto", 1, 4], ids=lambda k: f"k={k}")
@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_greedy_matches_plain_decoding(target, draft_model, drafter, k):
    d = NgramDrafter() if drafter == "ngram" else ModelDrafter(draft_model)
    dec = SpeculativeDecoder(target, d, k=k)
    for prompt in PROMPTS[:3]:
        want = reference(target, prompt, 24, temperature=0.0)
        got = dec.generate(prompt, 24)
        assert got.tokens == want, prompt
        assert got.finish_reason == "length"
        assert SpeculativeDecoder(target).generate(prompt, 24).tokens == want


@pytest.mark.parametrize("drafter", ["ngram", "model"])
@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=5),
                                    dict(temperature=1.3, top_p=0.8, min_p=0.05)],
                         ids=["t1", "t0.7-topk5", "t1.3-topp-minp"])
def test_coupled_matches_plain_coupled_sampling(target, draft_model, drafter, params):
    d = NgramDrafter() if drafter == "ngram" else ModelDrafter(draft_model)
    for seed, prompt in enumerate(PROMPTS[:2]):
        want = reference(target, prompt, 20, seed=seed, method="coupled", **params)
        got = SpeculativeDecoder(target, d, k=3).generate(
            prompt, 20, seed=seed, method="coupled", **params)
        assert got.tokens == want


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_batch_matches_single_prompts(target, draft_model, drafter):
    """Ragged prompts, different acceptance per row, rows finishing early: each
    row equals its own single-prompt run (greedy, coupled, and rejection sampling,
    whose streams are keyed by seed and position, not by the batch)."""
    make = (lambda: NgramDrafter()) if drafter == "ngram" else (lambda: ModelDrafter(draft_model))
    for kw in (dict(), dict(temperature=1.0, method="coupled"),
               dict(temperature=0.9, top_p=0.9, method="rejection")):
        seeds = [11, 12, 13, 14]
        singles = [SpeculativeDecoder(target, make(), k=4).generate(p, 40, seed=s, **kw).tokens
                   for p, s in zip(PROMPTS, seeds)]
        batch = SpeculativeDecoder(target, make(), k=4).generate(PROMPTS, 40, seed=seeds, **kw)
        assert [g.tokens for g in batch] == singles


def test_batch_rows_finish_at_different_times(target):
    dec = SpeculativeDecoder(target, NgramDrafter())
    eos_token = dec.generate(PROMPTS[0], 12).tokens[5]
    target.eos_token_ids = [eos_token]
    try:
        out = dec.generate(PROMPTS, 30)
        singles = [dec.generate(p, 30) for p in PROMPTS]
    finally:
        target.eos_token_ids = []
    assert [g.tokens for g in out] == [g.tokens for g in singles]
    assert out[0].finish_reason == "eos" and eos_token not in out[0].tokens


@pytest.mark.parametrize("params", [dict(temperature=1.0),
                                    dict(temperature=0.8, top_k=4, top_p=0.95, min_p=0.02)],
                         ids=["t1", "filters"])
@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_rejection_sampling_is_exact(drafter, params):
    """The joint distribution of the first two tokens equals the target's (a smoke
    test of the whole loop: 6000 generations see 6% of the joint distribution, what a
    wrong key or rollback moves; test_rejection_passes_exact_rows_to_verify pins the
    inputs of every verification exactly, and test_verify holds the kernel to 1%)."""
    target, draft = tiny_model(vocab=6, seed=3, scale=0.4), tiny_model(vocab=6, seed=4, scale=0.4)
    prompt = [1, 2, 1, 2, 1]
    n = scaled(6000)
    d = NgramDrafter(max_ngram=2, min_ngram=1) if drafter == "ngram" else ModelDrafter(draft)
    out = SpeculativeDecoder(target, d, k=2).generate(
        [prompt] * n, 2, seed=list(range(n)), method="rejection", **params)
    assert_outcomes([tuple(g.tokens) for g in out], two_token_joint(target, prompt, **params),
                    f"rejection/{drafter}/{params}", resolution=0.06)
    total = sum(g.metrics.draft_n for g in out)
    assert total > 0  # the drafter really drafted


@pytest.mark.parametrize("sparse_top", [0, 5], ids=["dense", "sparse"])
def test_rejection_passes_exact_rows_to_verify(target, draft_model, monkeypatch, sparse_top):
    """Every verification of a rejection-mode batch gets, per request, the target's
    logits after the context and each drafted prefix, the draft model's exact filtered
    distribution at each drafted token (float64 reference of full forwards, no cache),
    the request's own seed and sampling parameters, and position = context length."""
    params = dict(temperature=0.9, top_k=8, top_p=0.9, min_p=0.02)
    seeds, prompts, n_new = [3, 4], [PROMPTS[0], PROMPTS[2]], 12
    calls = []
    real = specfast._api.verify

    def spy(logits, tokens, num_draft, **kw):
        r = real(logits, tokens, num_draft, **kw)
        calls.append((np.array(logits), np.array(tokens), np.array(num_draft), kw, r))
        return r

    monkeypatch.setattr(specfast._api, "verify", spy)
    out = SpeculativeDecoder(target, ModelDrafter(draft_model, sparse_top=sparse_top), k=3) \
        .generate(prompts, n_new, seed=seeds, method="rejection", **params)
    ctx = [list(p) for p in prompts]
    live, drafted = [0, 1], 0
    for logits, toks, nd, kw, r in calls:
        assert kw["method"] == "rejection"
        q = kw["draft_probs"]
        if sparse_top and q is not None:  # None: a step without drafts
            q = q.dense(target.vocab_size)
        row = off = 0
        for j, i in enumerate(live):
            assert kw["position"][j] == len(ctx[i]) and kw["seed"][j] == seeds[i]
            assert kw["temperature"][j] == np.float32(0.9) and kw["top_k"][j] == 8
            for a in range(nd[j] + 1):
                prefix = ctx[i] + [int(t) for t in toks[off:off + a]]
                np.testing.assert_allclose(logits[row + a], full_logits(target, prefix)[0],
                                           rtol=1e-5, atol=1e-5)
                if a < nd[j]:
                    # with sparse_top the drafter's own top_k is at most sparse_top
                    want = ref_probs_row(full_logits(draft_model, prefix)[0],
                                         **dict(params, top_k=sparse_top or params["top_k"]))
                    np.testing.assert_allclose(q[off + a], want, atol=2e-6)
            ctx[i] += [int(t) for t in r.tokens[j, :r.num_accepted[j] + 1]]
            drafted += int(nd[j])
            off += nd[j]
            row += nd[j] + 1
        live = [i for i in live if len(ctx[i]) - len(prompts[i]) < n_new]
    assert not live and drafted > 0
    assert [c[len(p):] for c, p in zip(ctx, prompts)] == [g.tokens for g in out]


def test_generate_edges(target):
    """No new tokens, a seed list of the wrong length, and eos=False running past the
    end-of-sequence token."""
    dec = SpeculativeDecoder(target, NgramDrafter())
    g = dec.generate(PROMPTS[0], 0)
    assert g.tokens == [] and g.metrics.tokens == 0 and g.metrics.target_steps == 0
    with pytest.raises(ValueError, match="3 seeds for 2 prompts"):
        dec.generate(PROMPTS[:2], 4, seed=[1, 2, 3])
    want = dec.generate(PROMPTS[0], 12).tokens
    target.eos_token_ids = [want[3]]
    try:
        assert dec.generate(PROMPTS[0], 12).tokens == want[:want.index(want[3])]
        g = dec.generate(PROMPTS[0], 12, eos=False)
        assert g.tokens == want and g.finish_reason == "length"
    finally:
        target.eos_token_ids = []


def test_stream_and_stop(target):
    chunks = []
    dec = SpeculativeDecoder(target, NgramDrafter())
    g = dec.generate(PROMPTS[0], 16, stream=lambda i, toks, text: chunks.append((i, toks, text)))
    assert [t for _, toks, _ in chunks for t in toks] == g.tokens
    assert "".join(text for _, _, text in chunks) == g.text
    # without a tokenizer text is ids joined by spaces: stop at the third token
    stop = " ".join(map(str, g.tokens[2:4]))
    s = dec.generate(PROMPTS[0], 16, stop=[stop])
    assert s.finish_reason == "stop" and stop not in s.text


@pytest.mark.parametrize("at", [1, 3, 6])
def test_stop_strings_end_where_plain_decoding_ends(target, at):
    """A stop string ends the output at the token that completes it, whatever
    the drafts, and the stream never repeats or takes back text: one run that
    accepted several tokens at once used to keep the tokens past the stop, and a
    stop string split across steps re-sent the whole text."""
    plain = SpeculativeDecoder(target).generate(PROMPTS[0], 24)
    # without a tokenizer text is ids joined by spaces: a stop across two tokens
    stop = " ".join(map(str, plain.tokens[at:at + 2]))
    runs = []
    for dec in (SpeculativeDecoder(target), SpeculativeDecoder(target, NgramDrafter(), k=8)):
        chunks = []
        g = dec.generate(PROMPTS[0], 24, stop=[stop],
                         stream=lambda i, toks, text: chunks.append((toks, text)))
        assert g.finish_reason == "stop" and g.text == plain.text[:plain.text.find(stop)]
        assert [t for toks, _ in chunks for t in toks] == g.tokens
        assert "".join(text for _, text in chunks) == g.text
        runs.append(g.tokens)
    assert runs[0] == runs[1] == plain.tokens[:at + 2]


class _Pieces:
    """Decodes as a byte-level tokenizer does (a character split across tokens
    reads U+FFFD until complete) and drops the space a text starts with, as
    SentencePiece decoders do: the two ways that a text decoded in parts can
    differ from the text decoded whole."""

    PIECES = [b"a", b" b", b" ", b"\n", b"\xc3", b"\xa9", b"\xe2\x82", b"\xac", b"ab", b" c",
              b"\xe2", b"\x82"]

    def __call__(self, ids):
        raw = b"".join(self.PIECES[i % len(self.PIECES)] for i in ids)
        text = raw.decode("utf-8", errors="replace")
        return text[1:] if text.startswith(" ") else text


@pytest.mark.parametrize("tail", [1, 2, 32])
def test_text_decoded_in_parts_is_the_whole_text(target, monkeypatch, tail):
    """A streamed generation decodes only the tokens after an anchor each step
    (decoder._Text): its stream, text and stop are still those of the text
    decoded whole, for anchors every `tail` tokens."""
    monkeypatch.setattr(decoder._Text, "TAIL", tail)
    monkeypatch.setattr(target, "decode", _Pieces())
    n = 150
    plain = SpeculativeDecoder(target).generate(PROMPTS[0], n)
    assert plain.text == target.decode(plain.tokens)
    text = plain.text
    stop = next(text[j:j + 3] for j in range(len(text) // 2, len(text) - 3)
                if "\ufffd" not in text[j:j + 3])  # in the second half, whole characters
    m = next(m for m in range(n + 1) if stop in target.decode(plain.tokens[:m]))
    for dec in (SpeculativeDecoder(target), SpeculativeDecoder(target, NgramDrafter(), k=4)):
        for stops, tokens in ((None, plain.tokens), ([stop], plain.tokens[:m])):
            chunks = []
            g = dec.generate(PROMPTS[0], n, stop=stops, stream=lambda i, t, s: chunks.append(s))
            whole = target.decode(tokens)
            assert g.tokens == tokens and "".join(chunks) == g.text
            assert g.text == (whole[:whole.find(stop)] if stops else whole)


@pytest.mark.parametrize("tail", [1, 2, 5])
def test_text_anchor_decodes_every_prefix_as_the_whole(monkeypatch, tail):
    """decoder._Text on every prefix of random token lists (split characters,
    dropped leading spaces) returns what decoding the prefix whole returns."""
    monkeypatch.setattr(decoder._Text, "TAIL", tail)
    decode, rng = _Pieces(), np.random.default_rng(tail)
    for _ in range(40):
        tokens = rng.integers(0, len(_Pieces.PIECES), 120).tolist()
        text = decoder._Text(decode)
        for n in range(1, len(tokens) + 1):
            assert text(tokens[:n]) == decode(tokens[:n]), (tokens[:n], text.at)
            text.advance(tokens[:n])
        assert text.at > 0


def test_a_long_streamed_generation_decodes_its_tail(target, monkeypatch):
    """Streaming (or stop strings) decodes the last tokens each step, not all of
    them: a 1000-token stream decoded about n^2 / 2 = 500,000 tokens."""
    seen, decode = [], target.decode
    monkeypatch.setattr(target, "decode", lambda ids: seen.append(len(ids)) or decode(ids))
    n = 1000
    for kw in (dict(stream=lambda *a: None), dict(stop=["never said"])):
        seen.clear()
        assert len(SpeculativeDecoder(target).generate(PROMPTS[0], n, **kw).tokens) == n
        assert sum(seen) < n * n / 5


def test_a_stop_string_given_alone(target):
    """stop="a b" is one stop string (was split into its characters, so the
    space stopped at once); an empty or non-string stop is refused."""
    dec = SpeculativeDecoder(target, NgramDrafter(), k=4)
    plain = dec.generate(PROMPTS[0], 16)
    stop = " ".join(map(str, plain.tokens[3:5]))
    assert dec.generate(PROMPTS[0], 16, stop=stop).tokens == \
        dec.generate(PROMPTS[0], 16, stop=[stop]).tokens == plain.tokens[:5]
    with pytest.raises(ValueError, match="must not be empty"):
        dec.generate(PROMPTS[0], 4, stop=[""])
    with pytest.raises(TypeError, match="stop strings must be str, got int"):
        dec.generate(PROMPTS[0], 4, stop=[7])


def test_metrics_add_up(target):
    dec = SpeculativeDecoder(target, NgramDrafter(), k=4)
    g = dec.generate(PROMPTS[0], 30)
    m = g.metrics
    assert m.tokens == len(g.tokens) == 30
    assert 0 <= m.draft_n_accepted <= m.draft_n
    assert m.target_steps <= m.tokens and m.mean_accepted_length >= 1
    assert sum(m.accepted_at) == m.draft_n_accepted
    assert all(0 <= p <= 1 for p in m.per_position_acceptance)
    assert m.t_total >= m.t_prefill + m.t_draft + m.t_target + m.t_verify - 1e-6
    assert "tok/s" in m.summary()
    plain = SpeculativeDecoder(target).generate(PROMPTS[0], 30).metrics
    assert plain.draft_n == 0 and plain.target_steps == 30
    rep = dec.memory_report()
    weights = sum(p.numel() * p.element_size() for p in target.model.parameters())
    assert rep["measured"]["target_params"] == weights  # float64: 8 bytes a weight
    assert rep["estimate"]["target_params"] == weights
    assert 0 < rep["measured"]["target_kv_peak"] <= 2 * rep["estimate"]["target_kv"]
    # A batch's totals: tokens per step of each request (not times the batch),
    # and the draft lengths of all its requests.
    plain_dec = SpeculativeDecoder(target)
    plain_dec.generate(PROMPTS[:3], 10)
    total = plain_dec.last_metrics
    assert total.target_steps == 10 and total.request_steps == 30
    assert total.mean_accepted_length == 1.0 and total.k_chosen == {0: 30}
    out = dec.generate(PROMPTS[:3], 30)
    total = dec.last_metrics
    assert sum(g.metrics.target_steps for g in out) == total.request_steps > total.target_steps
    assert total.mean_accepted_length == total.tokens / total.request_steps >= 1
    assert all(g.metrics.t_total > 0 for g in dec.generate(PROMPTS[:2], 0))


def test_a_padded_forward_is_the_unpadded_one(target):
    """forward(pad_to=...) computes extra tokens after every row's and drops them:
    the logits, the lengths and the cache are those of the unpadded step (ragged
    rows, a tree row, a step after keep_paths)."""
    def steps(pad):
        st = target.new_state(2)
        target.forward(st, [[1, 2, 3, 4, 5], [6, 7, 8]], all_logits=False)
        out = target.forward(st, [[9, 10, 11], [12]], pad_to=pad)
        target.truncate(st, [6, 4])
        out += target.forward(st, [[13, 14, 15], [16, 17, 18]], trees=[[-1, -1], [-1, 0]],
                              pad_to=pad)
        target.keep_paths(st, np.array([[1, -1], [0, 1]]), np.array([1, 2]))
        target.truncate(st, [8, 7])
        out += target.forward(st, [[19], [20, 21]], pad_to=pad)
        return [o.numpy() for o in out], list(st.lengths), st.slots, st.cache.get_seq_length()

    want = steps(0)
    for pad in (4, 6):
        got = steps(pad)
        assert got[1:] == want[1:]
        for a, b in zip(got[0], want[0]):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)


def test_a_step_is_computed_at_the_fastest_width_measured():
    """Where the target can widen a step, each width of w .. w + pad_max is tried
    once, then the fastest computes it, and k is chosen from those costs."""
    c = DraftLength(max_k=8, pad_max=3)
    c.start(1)
    assert c.compute_width(2) == 2  # pad 0 until the decoder says the target pads
    c.pad = c.pad_max
    seconds = {1: 0.06, 2: 0.11, 3: 0.13, 4: 0.09, 5: 0.09, 6: 0.10, 7: 0.12, 8: 0.095, 9: 0.11,
               10: 0.11, 11: 0.13, 12: 0.12}
    for _ in range(3):
        c.observe_target(1, seconds[1])
    tried = []
    for _ in range(5):
        w = c.compute_width(2)
        tried.append(w)
        c.observe_target(w, seconds[w])
    assert tried == [2, 3, 4, 5, 4] and c.compute_width(1) == 1
    for w in range(6, 13):
        c.observe_target(w, seconds[w])
    assert c.compute_width(6) == 8 and c.compute_width(9) == 9
    costs = c._forward_costs()  # k is chosen from what a step of k + 1 costs widened
    assert costs[1] == 0.06 and costs[2] == costs[3] == costs[4] == 0.09
    assert costs[6] == costs[7] == 0.095


def test_draft_length_controller():
    c = DraftLength(max_k=8, probe_every=4)
    c.start(2)
    for k in (1, 2, 4, 8, 9):  # forward cost grows 10% per token
        c.observe_target(k, 0.05 * (1 + 0.1 * (k - 1)))
    c.observe_fixed(0.002)
    for _ in range(30):
        c.observe(0, 8, 8)  # request 0 always accepts
        c.observe(1, 3, 0)  # request 1 never does
    assert c.choose(0, 100) == 8
    assert c.choose(0, 3) == 3  # never past the tokens left
    assert c.choose(0, 100, available=5) == 5  # nor past the draft
    assert DraftLength(fixed=5).choose(0, 100) == 5

    def drafted(c, i, accepted, steps=12):
        ks = []
        for _ in range(steps):
            ks.append(c.choose(i, 100))
            if ks[-1]:
                c.observe(i, ks[-1], accepted(ks[-1]))
        return ks

    # off, probing with probe_k after 4 skipped drafts, then after 8 (a failed probe backs off)
    ks = drafted(c, 1, lambda k: 0, 16)
    assert [j for j, k in enumerate(ks) if k] == [3, 11] and max(ks) == c.probe_k
    c.start(2)
    for _ in range(30):
        c.observe(1, 3, 0)
    ks = drafted(c, 1, lambda k: int(k == 1))  # probes pass, longer drafts fail
    assert ks[:8] == [0, 0, 0, 1, 0, 0, 0, 1]  # a probe that passes does not back off


def test_one_token_drafts_keep_what_longer_ones_said_of_q():
    """q (the next token accepted after one that was) is learned from drafts of 2 or
    more tokens; drafts of one say nothing of it and leave it as it was."""
    c = DraftLength()
    c.start(1)
    for _ in range(20):
        c.observe(0, 8, 8)
    q = c.acceptance(0)[1]
    for _ in range(40):
        c.observe(0, 1, 1)
    assert c.acceptance(0)[1] == q > 0.95
    c.observe(0, 8, 1)  # then one that fails at its second token weighs as one
    assert c.acceptance(0)[1] > 0.85


def test_draft_length_is_not_pinned_by_noise():
    """A slow outlier at some width must not pin k at 1 when acceptance is high;
    windowed minima per width are used, not running means."""
    c = DraftLength(max_k=10)
    c.start(1)
    rng = np.random.default_rng(0)
    for step in range(60):
        for w in (1, 2, 11):
            noise = 3.0 if rng.random() < 0.3 else 1.0  # a loaded machine
            c.observe_target(w, 0.02 * (1 + 0.03 * (w - 1)) * noise)
        c.observe(0, 10, 10 if step % 3 else 4)  # bursty: long accepted runs
    assert c.choose(0, 100) == 10


def test_forward_cost_follows_measured_widths():
    """On CPUs a one-token forward is a matrix-vector product and each further
    token costs less than the one before: the cost curve goes through the
    measured widths (made monotone), not a line that prices a plain step at
    the mean of wide ones."""
    c = DraftLength(max_k=40)
    measured = {1: 44, 2: 51, 4: 73, 8: 95, 12: 130, 13: 100, 16: 117, 32: 151}  # ms
    for w, ms in measured.items():
        c.observe_target(w, ms / 1000)
    costs = [c.step_seconds(k) for k in range(41)]
    assert costs == sorted(costs)
    assert costs[0] == pytest.approx(0.044) and costs[7] == pytest.approx(0.095)
    assert costs[11] == costs[12] == pytest.approx(0.115)  # 130 and 100 pooled
    assert costs[5] == pytest.approx((0.073 + 0.095) / 2)  # width 6: between 4 and 8
    assert costs[40] > costs[31]  # past the widest measured width it keeps rising


def test_one_slow_step_does_not_price_a_width_out():
    """A wide step measured once, slowly (the machine was busy), counts as
    unmeasured until it is seen three times: the controller tries it again."""
    c = DraftLength(max_k=32)
    c.start(1)
    for _ in range(5):
        for w, ms in {1: 44, 2: 51, 8: 95, 16: 117, 22: 120}.items():
            c.observe_target(w, ms / 1000)
    c.observe_target(33, 0.400)
    for _ in range(10):
        c.observe(0, 21, 21, match=40)
    assert c.choose(0, 100, match=40, available=32) == 32
    for _ in range(2):
        c.observe_target(33, 0.400)  # three times slow: it is that slow
    assert c.choose(0, 100, match=40, available=32) < 32


@pytest.mark.parametrize("p0, want", [(0.02, 0), (0.2, 1)])
def test_draft_length_needs_a_margin_over_plain(p0, want):
    """A draft whose expected gain is within the margin (10%) is not taken."""
    c = DraftLength(max_k=1, prior_first=p0, prior_weight=1e6)
    c.start(1)
    c.observe_target(1, 0.1)
    c.observe_target(2, 0.1)  # drafting one token costs nothing: the gain is p0
    assert c.choose(0, 100) == want


def test_draft_length_buckets_by_match():
    """Acceptance is tracked per confidence bucket: short lookups that fail do
    not switch off long ones that pass."""
    c = DraftLength(max_k=8)
    c.start(1)
    for w in range(1, 10):
        c.observe_target(w, 0.02 * (1 + 0.03 * (w - 1)))
    for _ in range(20):
        c.observe(0, 4, 0, match=2)
        c.observe(0, 8, 8, match=40)
    assert c.acceptance(0, 2)[0] < 0.1 and c.acceptance(0, 40)[0] > 0.9
    assert c.choose(0, 100, match=40, available=8) == 8
    assert c.choose(0, 100, match=2, available=8) == 0


def test_a_new_bucket_starts_from_how_the_request_drafts_fare():
    """The first long match of a request whose short matches keep failing (prose)
    is not worth a wide step; the same match in a request whose drafts pass is."""
    def first_long_match(short_accepted):
        c = DraftLength(max_k=24)
        c.start(1)
        for w, ms in {1: 44, 2: 51, 4: 73, 8: 95, 16: 117, 25: 125}.items():
            c.observe_target(w, ms / 1000)
        for _ in range(12):
            c.observe(0, 3, short_accepted, match=1)
        return c.choose(0, 100, match=6, available=24)

    assert first_long_match(0) <= 1  # its prior alone would draft 10
    assert first_long_match(3) >= 8
    fresh = DraftLength(max_k=24)
    fresh.start(1)  # nothing known of the request: the bucket's own prior
    assert fresh.acceptance(0, 6)[0] == pytest.approx(0.375)


def test_prompts_forms(target):
    dec = SpeculativeDecoder(target)
    assert isinstance(dec.generate([1, 2, 3], 2).tokens, list)
    assert len(dec.generate([[1, 2, 3], [4]], 2)) == 2
    # numpy arrays of ids (a tokenizer's return_tensors="np"), alone or in a list
    one = dec.generate(np.array([1, 2, 3], np.int64), 2)
    assert one.tokens == dec.generate([1, 2, 3], 2).tokens
    two = dec.generate([np.array([1, 2, 3]), [4]], 2)
    assert [g.tokens for g in two] == [g.tokens for g in dec.generate([[1, 2, 3], [4]], 2)]
    with pytest.raises(ValueError):
        dec.generate([1, 2], 2, method="nope")
    with pytest.raises(ValueError):
        SpeculativeDecoder(target, NgramDrafter(), k=-1)


@pytest.mark.parametrize("kw, error", [
    (dict(seed=-1), ValueError), (dict(seed=2**64), ValueError), (dict(seed=1.7), TypeError),
    (dict(max_new_tokens=2.5), TypeError), (dict(max_new_tokens=-1), ValueError),
    (dict(temperature=-0.5), ValueError), (dict(top_p=0.0), ValueError),
    (dict(temperature=10**400), ValueError), (dict(prompt=[1, 2, 48]), ValueError),
    (dict(prompt=[-1, 2]), ValueError), (dict(top_p=1e-50), ValueError),
    (dict(max_new_tokens=True), TypeError), (dict(stop=7), TypeError),
    (dict(stop=b"7"), TypeError), (dict(stream=True), TypeError),
], ids=["seed-negative", "seed-big", "seed-float", "max-float", "max-negative",
        "temperature", "top_p", "temperature-huge", "prompt-id", "prompt-negative",
        "top_p-0-in-float32", "max-bool", "stop-int", "stop-bytes", "stream-not-callable"])
def test_generate_rejects_bad_arguments_up_front(target, kw, error):
    """Checked before any forward, with the library's own rules (no OverflowError
    from a seed, no IndexError from the embedding, no silent int())."""
    dec = SpeculativeDecoder(target, NgramDrafter())
    kw = {"prompt": [1, 2, 3], "max_new_tokens": 2, "temperature": 1.0, **kw}
    forwards = []
    forward = target.forward
    target.forward = lambda *a, **k: forwards.append(1) or forward(*a, **k)
    try:
        with pytest.raises(error):
            dec.generate(kw.pop("prompt"), **kw)
    finally:
        del target.forward
    assert not forwards


def test_numpy_arguments_act_as_python_ones(target):
    """numpy ints in a batch's id prompts, a 0-d seed array, a numpy k: as their
    Python values (a batch of numpy-int prompts was taken for chat messages)."""
    dec = SpeculativeDecoder(target, NgramDrafter(), k=np.int64(3))
    alone = dec.generate([1, 2, 3, 1, 2], 6, temperature=1.0, seed=5).tokens
    ids = list(np.array([1, 2, 3, 1, 2]))
    batch = dec.generate([ids, [4, 5]], 6, temperature=1.0, seed=np.array(5))
    assert batch[0].tokens == alone and len(batch[1].tokens) == 6


@pytest.mark.parametrize("drafter, k", [("model", 16), ("ngram", 40)])
def test_a_fixed_draft_length_is_drafted_whole(target, draft_model, drafter, k):
    """k fixed past the adaptive ceiling (max_k: 10 for a model, 32 for n-grams)
    is what is drafted, not silently cut to it."""
    d = ModelDrafter(draft_model) if drafter == "model" else NgramDrafter()
    g = SpeculativeDecoder(target, d, k=k).generate(list(range(1, 6)) * 40, k + 3)
    assert max(g.metrics.k_chosen) == k


def test_a_draft_model_of_another_vocabulary_is_refused(target):
    with pytest.raises(ValueError, match="vocabulary \\(40 ids\\) differs"):
        SpeculativeDecoder(target, ModelDrafter(tiny_model(vocab=40, layers=1)))


def test_memory_report_gives_each_generation_its_own_peaks(target, draft_model):
    """Both KV peaks are the last generation's: a small one after a large one
    reports its own (the drafter's peak had kept the large one's)."""
    dec = SpeculativeDecoder(target, ModelDrafter(draft_model), k=3)
    dec.generate([PROMPTS[0] * 8] * 4, 8)
    big = dec.memory_report()["measured"]
    dec.generate(PROMPTS[0][:3], 8)
    small = dec.memory_report()["measured"]
    assert 0 < small["target_kv_peak"] < big["target_kv_peak"]
    assert 0 < small["draft_kv_peak"] < big["draft_kv_peak"]


def test_one_generation_at_a_time(target):
    """A generation started while one runs (a stream callback's, another
    thread's) is a RuntimeError, and leaves the running one intact; the decoder
    is free again after it (errors included)."""
    dec = SpeculativeDecoder(target, NgramDrafter(), k=3)
    want = dec.generate(PROMPTS[0], 12).tokens
    seen = []

    def again(i, tokens, text):
        with pytest.raises(RuntimeError, match="already generating"):
            dec.generate(PROMPTS[1], 4)
        seen.append(i)

    assert dec.generate(PROMPTS[0], 12, stream=again).tokens == want and seen
    started, release = threading.Event(), threading.Event()

    def hold(i, tokens, text):
        started.set()
        release.wait(10)

    worker = threading.Thread(target=dec.generate, args=(PROMPTS[0], 3), kwargs={"stream": hold})
    worker.start()
    assert started.wait(10)
    with pytest.raises(RuntimeError, match="already generating"):
        dec.generate(PROMPTS[1], 4)
    release.set()
    worker.join(10)
    with pytest.raises(ValueError, match="prompt token ids"):  # raised inside the loop
        dec.generate([target.vocab_size], 4)
    assert dec.generate(PROMPTS[0], 12).tokens == want


def test_memory_report_takes_each_size_alone(target):
    dec = SpeculativeDecoder(target, NgramDrafter())
    dec.generate([1, 2, 3], 4)
    one = dec.memory_report()
    assert dec.memory_report(batch=2)["estimate"]["target_kv"] == 2 * one["estimate"]["target_kv"]
    wide = dec.memory_report(context=100)
    assert wide["context"] == 100 and wide["batch"] == one["batch"]


def test_draft_length_arguments():
    with pytest.raises(ValueError):
        DraftLength(fixed=-1)
    with pytest.raises(ValueError):
        SpeculativeDecoder(tiny_model(), NgramDrafter(), k=True)
    dl = DraftLength()  # a step faster than the clock: no ZeroDivisionError
    dl.start(1)
    dl.observe_target(1, 0.0)
    assert 0 <= dl.choose(0, 5) <= 5


def test_draft_length_counts_a_round_trip_once_per_step():
    """Drafting costs a fixed round trip plus a time per token, each fitted from
    measurements: a round trip is paid once per step (so it never favours
    shorter drafts), and one that eats the gain turns drafting off."""
    def controller(rtt):
        c = DraftLength(max_k=10, probe_every=1000)
        c.start(1)
        for k in (1, 2, 4, 8, 11):
            c.observe_target(k, 0.05 + 0.005 * (k - 1))
        for k in (1, 3, 6):
            c.observe_draft(k, rtt + 0.004 * k)
        for _ in range(30):
            c.observe(0, 4, 2)  # p0 high, the chain breaks often
        return c

    near, far = controller(0.0), controller(0.02)
    assert far.choose(0, 100) >= near.choose(0, 100) > 0
    assert abs(far._drafting(5) - (0.02 + 5 * 0.004)) < 1e-9
    assert controller(1.0).choose(0, 100) == 0  # a 1 s round trip never pays


def test_draft_length_measures_a_plain_step():
    """Drafting every step measures only draft widths; the controller then takes
    a plain step now and then to learn what drafting costs against it."""
    c = DraftLength(max_k=4)
    c.start(1)
    c.observe_target(3, 0.06)
    ks = [c.choose(0, 100) for _ in range(8)]
    assert 0 in ks
    c.observe_target(1, 0.05)
    c.observe(0, 2, 2)
    assert all(c.choose(0, 100) > 0 for _ in range(16))  # measured: no more detours


def test_draft_length_measures_a_plain_step_until_the_fit_trusts_it():
    """A plain step seen fewer times than the fit requires (3, once a draft width has
    3) is left out of it, so its cost came from the draft widths' curve: on llama.cpp
    37 ms for a width that took 11, and drafting looked three times cheaper than it
    was. The controller now takes plain steps until it has 3."""
    c = DraftLength(max_k=16)
    c.start(1)
    for _ in range(5):
        c.observe_target(12, 0.057)
    c.observe_target(1, 0.007)
    c.observe(0, 11, 11)
    assert c._forward_costs()[1] > 0.02  # extrapolated: not what was measured
    ks = [c.choose(0, 100) for _ in range(16)]
    assert ks.count(0) >= 2
    c.observe_target(1, 0.007)
    c.observe_target(1, 0.007)
    assert abs(c._forward_costs()[1] - 0.007) < 1e-9


class _Odd(NgramDrafter):
    """Proposes what it is told to: too few drafts, ids past the vocabulary, or
    numpy tokens."""

    def __init__(self, how):
        super().__init__()
        self.how = how

    def propose(self, contexts, ks, sampling):
        drafts = super().propose(contexts, ks, sampling)
        if self.how == "count":
            return drafts[:-1]
        if self.how == "vocab":
            return [Draft([10**6] * k) for k in ks]
        return [Draft(np.array(d.tokens, np.int64), d.probs, d.match) for d in drafts]


def test_drafts_are_checked_before_the_target_sees_them(target):
    """A drafter is user code: a wrong count or an id outside the vocabulary is a
    ValueError naming the drafter, numpy token arrays are taken."""
    for how, match in (("count", "drafts for 2 requests"), ("vocab", "token ids outside")):
        with pytest.raises(ValueError, match=match):
            SpeculativeDecoder(target, _Odd(how), k=3).generate(PROMPTS[:2], 8)
    out = SpeculativeDecoder(target, _Odd("numpy"), k=3).generate(PROMPTS[0], 12)
    assert out.tokens == reference(target, PROMPTS[0], 12, temperature=0.0)


def test_adapter_refuses_what_it_cannot_run_exactly():
    """Sliding-window caches (their layers drop old tokens, which rollback needs)
    and attention that may ignore the 4-D masks are refused at load; a model with
    learned positions says before any forward how many new tokens fit."""
    cfg = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2)
    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(**cfg, sliding_window=16))
    with pytest.raises(ValueError, match="sliding-window"):
        HFModel(mistral)
    # A window as long as the model's positions never slides (Phi-3.5-mini's
    # 262144 over 131072): taken, with a full-attention cache, and exact.
    torch.manual_seed(3)
    phi3 = HFModel(transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **cfg, pad_token_id=0, max_position_embeddings=256, sliding_window=256)).double())
    phi3.eos_token_ids = []
    assert {type(layer).__name__ for layer in phi3.new_state(1).cache.layers} <= {"DynamicLayer"}
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6]]
    plain = [g.tokens for g in SpeculativeDecoder(phi3).generate(prompts, 24)]
    for branches in (1, 3):
        dec = SpeculativeDecoder(phi3, NgramDrafter(branches=branches), k=4)
        assert [g.tokens for g in dec.generate(prompts, 24)] == plain
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    llama.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="sdpa"):
        HFModel(llama)
    gpt2 = HFModel(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=48, n_positions=32, n_embd=32, n_layer=1, n_head=4)))
    gpt2.eos_token_ids = []
    dec = SpeculativeDecoder(gpt2, NgramDrafter())
    assert len(dec.generate(list(range(1, 21)), 13).tokens) == 13  # positions 0..31
    with pytest.raises(ValueError, match="32 positions"):
        dec.generate(list(range(1, 21)), 14)


def test_loading_quiets_transformers_only_while_it_loads():
    """GGUF de-quantization's own tqdm bar is off during a load, and the
    caller's transformers logging and bars are as they were after it (the load
    had turned them down for the whole process)."""
    from transformers import modeling_gguf_pytorch_utils as gguf
    from transformers.utils import logging

    from specfast.adapters.hf import _quiet_transformers

    before = logging.get_verbosity()
    logging.set_verbosity_info()
    bar = gguf.tqdm
    try:
        with _quiet_transformers():
            assert logging.get_verbosity() == logging.ERROR
            assert not logging.is_progress_bar_enabled()
            assert list(gguf.tqdm(range(3), desc="x")) == [0, 1, 2]
            assert gguf.tqdm(range(1)).disable
        assert logging.get_verbosity() == logging.INFO and logging.is_progress_bar_enabled()
        assert gguf.tqdm is bar
    finally:
        logging.set_verbosity(before)


def test_a_forward_that_ignores_the_cache_is_an_error():
    """transformers before 5.24 took the KV cache as past_key_values= and let
    cache= fall into **kwargs: every step saw only its own tokens, and plain
    decoding gave other tokens with no error. The adapter checks the cache grew."""
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2)).double()
    forward = llama.forward

    def old_forward(*args, cache=None, **kw):
        return forward(*args, **kw)

    llama.forward = old_forward
    adapter = HFModel(llama, name="old")
    with pytest.raises(RuntimeError, match="did not extend the cache"):
        SpeculativeDecoder(adapter).generate([1, 2, 3], 4)


@pytest.mark.parametrize("family", ["gpt_neo", "bloom", "mpt", "falcon-alibi"])
def test_adapter_refuses_positions_read_from_cache_slots(family):
    """Models whose attention reads cache slots, not the position ids the adapter
    gives (GPT-Neo's slot-indexed masks, ALiBi's slot distance), would get wrong
    logits or crash once a cache has holes, padding or a tree: refused at load."""
    small = dict(vocab_size=48, hidden_size=32, num_attention_heads=4)
    model = {
        "gpt_neo": lambda: transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
            **small, num_layers=2, attention_types=[[["global", "local"], 1]], window_size=4,
            max_position_embeddings=64)),
        "bloom": lambda: transformers.BloomForCausalLM(transformers.BloomConfig(
            vocab_size=48, hidden_size=32, n_layer=1, n_head=4)),
        "mpt": lambda: transformers.MptForCausalLM(transformers.MptConfig(
            vocab_size=48, d_model=32, n_layers=1, n_heads=4)),
        "falcon-alibi": lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
            **small, num_hidden_layers=1, alibi=True)),
    }[family]()
    with pytest.raises(ValueError, match="is not supported"):
        HFModel(model)


def test_opt_positions_are_known_up_front():
    opt = HFModel(transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=48, hidden_size=32, num_hidden_layers=1, ffn_dim=64, num_attention_heads=4,
        max_position_embeddings=32, word_embed_proj_dim=32)))
    opt.eos_token_ids = []
    assert opt.max_positions == 32
    dec = SpeculativeDecoder(opt, NgramDrafter())
    assert len(dec.generate(list(range(1, 21)), 13).tokens) == 13
    with pytest.raises(ValueError, match="32 positions"):
        dec.generate(list(range(1, 21)), 14)


def test_positions_the_rows_share_are_counted_up_front():
    """A target whose rows share a pool of positions (llama.cpp's n_ctx) refuses a
    batch that would outgrow it before the first forward (it failed mid-run)."""
    opt = HFModel(transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=48, hidden_size=32, num_hidden_layers=1, ffn_dim=64, num_attention_heads=4,
        max_position_embeddings=32, word_embed_proj_dim=32)))
    opt.eos_token_ids = []
    opt.max_batch_positions = 40
    dec = SpeculativeDecoder(opt, NgramDrafter())
    prompts = [list(range(1, 11)), list(range(5, 15))]
    assert [len(g.tokens) for g in dec.generate(prompts, 11)] == [11, 11]  # 2 x (10 + 10)
    forward = opt.forward
    opt.forward = lambda *a, **kw: pytest.fail("a forward before the check")
    with pytest.raises(ValueError, match="share 40 positions: 2 prompts of 20 tokens with 12 "
                                         "new tokens each need 42"):
        dec.generate(prompts, 12)
    opt.forward = forward


def test_a_draft_model_with_fewer_positions_stops_drafting_there():
    """A draft model with fewer learned positions than the target drafts up to
    its last one (it raised mid-generation); the target decodes on, output unchanged."""
    def gpt2(positions, seed):
        torch.manual_seed(seed)
        m = HFModel(transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=48, n_positions=positions, n_embd=32, n_layer=1, n_head=4)).double())
        m.eos_token_ids = []
        return m

    target, draft = gpt2(128, 0), gpt2(32, 1)
    plain = SpeculativeDecoder(target).generate([1, 2, 3], 60).tokens
    for k in ("auto", 5):
        out = SpeculativeDecoder(target, ModelDrafter(draft), k=k).generate([1, 2, 3], 60)
        assert out.tokens == plain and out.metrics.draft_n > 0
    # Trees in a batch: a row capped below the batch's deepest k feeds no leaves.
    prompts = [list(range(1, 21)), [1, 2, 3]]
    plain = [g.tokens for g in SpeculativeDecoder(target).generate(prompts, 40)]
    for branches in (2, 3):
        dec = SpeculativeDecoder(target, ModelDrafter(draft, branches=branches), k=5)
        assert [g.tokens for g in dec.generate(prompts, 40)] == plain


@pytest.mark.parametrize("prompt, error, said", [
    ([1, None, 3], TypeError, "token ids must all be ints"),
    ([1, "a"], TypeError, "token ids must all be ints"),
    ([[1.5, 2.0]], TypeError, "a prompt must be"),
    ([True, False, True], TypeError, "token ids must all be ints, got bool"),
    ([[1, 2], [True]], TypeError, "a prompt must be"),
], ids=["none-in-ids", "str-in-ids", "float-ids", "bool-ids", "bool-ids-in-a-batch"])
def test_malformed_prompts_are_clear_errors(target, prompt, error, said):
    with pytest.raises(error, match=said):
        SpeculativeDecoder(target, NgramDrafter()).generate(prompt, 2)


@pytest.mark.parametrize("tokens", [[1.7, 2.9], [True], np.array([1.0, 2.0])],
                         ids=["floats", "bool", "float-array"])
def test_drafted_tokens_that_are_not_ints_are_refused(target, tokens):
    """A drafter is user code: float or bool ids are a TypeError, as sf.verify
    makes them (they were cut to ints and verified)."""
    class Odd(NgramDrafter):
        def propose(self, contexts, ks, sampling):
            return [Draft(list(tokens)[:k]) for k in ks]

    with pytest.raises(TypeError, match="drafted token ids that are not ints"):
        SpeculativeDecoder(target, Odd(), k=2).generate([1, 2, 3], 4)


@pytest.mark.parametrize("make, error, said", [
    (lambda m: DraftLength(probe_k=-3), ValueError, "probe_k must be >= 0"),
    (lambda m: DraftLength(window=0), ValueError, "window must be >= 1"),
    (lambda m: DraftLength(probe_every=0), ValueError, "probe_every must be >= 1"),
    (lambda m: DraftLength(decay=2), ValueError, r"decay must be in \(0.0, 1.0\]"),
    (lambda m: DraftLength(decay=0.0), ValueError, r"decay must be in \(0.0, 1.0\]"),
    (lambda m: DraftLength(margin=float("nan")), ValueError, "margin must be finite"),
    (lambda m: DraftLength(prior_first=-0.1), ValueError, "prior_first must be in"),
    (lambda m: DraftLength(max_k=2.5), TypeError, "max_k must be an int"),
    (lambda m: ModelDrafter(m, sparse_top=-1), ValueError, "sparse_top must be >= 0"),
    (lambda m: ModelDrafter(m, sparse_top=2.5), TypeError, "sparse_top must be an int"),
    (lambda m: ModelDrafter(m, p_min=2.0), ValueError, "p_min must be in"),
    (lambda m: NgramDrafter(candidates=-1), ValueError, "candidates must be >= 1"),
    (lambda m: NgramDrafter(branches=2.5), TypeError, "branches must be an int"),
    (lambda m: NgramDrafter(min_ngram=4), ValueError, "min_ngram <= max_ngram"),
], ids=["probe_k", "window", "probe_every", "decay", "decay-0", "margin", "prior_first", "max_k",
        "sparse_top-negative", "sparse_top-float", "p_min", "candidates", "branches",
        "min_ngram"])
def test_bad_settings_fail_where_they_are_given(draft_model, make, error, said):
    """Settings of the length controller and the drafters are checked when they are
    made (probe_k=-3 was a ZeroDivisionError after a whole generation; sparse_top=-1
    a 'top_k=-1 is out of range' mid-way)."""
    with pytest.raises(error, match=said):
        make(draft_model)


def test_settings_at_their_edges_are_taken():
    DraftLength(decay=1.0, probe_k=0, margin=10**400, prior_next=np.float32(1.0), window=np.int64(3))
    NgramDrafter(max_match=10**20, decay=np.float64(0.5))


class _Scripted(Drafter):
    """Drafts from the known greedy continuation of each prompt: ``plan(row,
    generated)`` says how long the draft is and how many of its tokens are the
    target's own (the rest are wrong), cut to the k asked for, so what a run
    drafts and accepts at each step is known before it runs."""

    def __init__(self, refs, plan, vocab):
        self.refs, self.plan, self.vocab = refs, plan, vocab  # refs: [(prompt, continuation)]

    def propose(self, contexts, ks, sampling):
        out = []
        for ctx, k in zip(contexts, ks):
            row = next(r for r, (p, _) in enumerate(self.refs) if list(ctx[:len(p)]) == p)
            prompt, ref = self.refs[row]
            g = len(ctx) - len(prompt)
            assert list(ctx[len(prompt):]) == ref[:g]
            length, good = self.plan(row, g)
            length = min(length, k)
            good = min(good, length)
            wrong = (ref[g + good] + 1) % self.vocab if good < length else None
            out.append(Draft(ref[g:g + good] + [wrong] * (length - good)))
        return out


def _scripted_run(target, prompts, n, plan, k=4):
    refs = [(p, SpeculativeDecoder(target).generate(p, n + 1).tokens) for p in prompts]
    dec = SpeculativeDecoder(target, _Scripted(refs, plan, target.vocab_size), k=k)
    out = dec.generate(prompts if len(prompts) > 1 else prompts[0], n)
    for g, (_, ref) in zip(out if len(prompts) > 1 else [out], refs):
        assert g.tokens == ref[:n]
    return dec, out


def test_metrics_of_a_scripted_run_are_exact(target):
    """Drafts of known length and acceptance: 4 with 2 accepted, 3 all accepted, 2
    with none, 1 accepted, an empty draft, then a step with no room to draft. Each
    metric is counted by hand from that."""
    script = {0: (4, 2), 3: (3, 3), 7: (2, 0), 8: (1, 1), 10: (0, 0)}
    dec, g = _scripted_run(target, [PROMPTS[0]], 12, lambda row, gen: script[gen])
    for m in (g.metrics, dec.last_metrics):
        assert m.tokens == 12 and m.target_steps == 6
        assert m.draft_n == 4 + 3 + 2 + 1 and m.draft_n_accepted == 2 + 3 + 0 + 1
        assert m.acceptance_rate == 6 / 10
        # verified positions: 0-2 of the first draft (its 3rd token failed, its 4th
        # was never verified), 0-2 of the second, 0 of the third and of the fourth
        assert m.drafted_at == [4, 2, 2, 0] and m.accepted_at == [3, 2, 1, 0]
        assert m.per_position_acceptance == [3 / 4, 1.0, 1 / 2, 0.0]
        # k fixed at 4, cut to the tokens left (12 - generated - 1)
        assert m.k_chosen == {4: 3, 3: 1, 1: 1, 0: 1} and m.request_steps == 6
        assert m.mean_accepted_length == 12 / 6
        decode = m.t_total - m.t_prefill
        assert 0 < decode < m.t_total
        assert m.decode_tokens_per_s == pytest.approx(12 / decode, rel=1e-12)
        assert m.tokens_per_s == pytest.approx(12 / m.t_total, rel=1e-12)
    # The cost model's prediction, with the run's own acceptance: p0 = 3/4 (position
    # 0), q = (2 + 1) / (2 + 2) (later positions), E[tokens | k] = 1 + p0 (1 - q^k) / (1 - q).
    total, ctl = dec.last_metrics, dec.controller
    p0, q = 3 / 4, 3 / 4
    steps = {4: 3, 3: 1, 1: 1, 0: 1}
    want = sum(n * (1 + p0 * (1 - q ** k) / (1 - q)) for k, n in steps.items())
    assert total.predicted_tokens == pytest.approx(want, rel=1e-12)
    seconds = sum(n * ctl.step_seconds(k, typical=True) for k, n in steps.items())
    assert total.predicted_seconds == pytest.approx(seconds, rel=1e-12) and seconds > 0
    assert total.predicted_tokens_per_s == pytest.approx(want / seconds, rel=1e-12)


def test_metrics_properties_by_hand():
    """The derived metrics from their definitions, on numbers chosen so that each
    wrong denominator gives another value."""
    m = decoder.Metrics(tokens=10, draft_n=8, draft_n_accepted=6, t_total=5.0, t_prefill=3.0,
                        predicted_tokens=9.0, predicted_seconds=3.0)
    assert m.acceptance_rate == 6 / 8
    assert m.decode_tokens_per_s == 10 / 2.0 and m.tokens_per_s == 10 / 5.0
    assert m.predicted_tokens_per_s == 3.0
    m._count(4, 1)  # positions 0 and 1 verified, 0 passed
    m._count(3, 3)  # all three verified and passed
    m._count(2, 0)  # position 0 verified
    assert m.drafted_at == [3, 2, 1, 0] and m.accepted_at == [2, 1, 1, 0]


def test_controller_follows_the_rows_that_survive(target):
    """Row 0 accepts every draft and finishes first; row 1 never does and runs on.
    After row 0 leaves, row 1's acceptance statistics are its own: what the
    controller holds at the end is exactly what a run of row 1 alone leaves (they
    were the finished row's, which row 1 then kept updating)."""
    plans = {0: (3, 3), 1: (3, 0)}

    def plan(row, gen):
        return plans[row]

    prompts = [PROMPTS[0], PROMPTS[2]]
    dec, out = _scripted_run(target, prompts, 12, plan, k=3)
    assert out[0].metrics.target_steps < out[1].metrics.target_steps  # row 0 left early
    plans[0] = plans[1]  # the same plan as row 1's, for the run of row 1 alone
    alone, _ = _scripted_run(target, [prompts[1]], 12, plan, k=3)
    got, want = dec.controller._req, alone.controller._req
    assert len(got) == len(want) == 1
    assert got[0].stats == want[0].stats
    assert (got[0].hits, got[0].expected) == (want[0].hits, want[0].expected)
    assert dec.controller.acceptance(0)[0] < 0.2  # row 1 never accepted (row 0 always did)


def test_memory_report_estimate_from_its_definition(target, draft_model):
    """estimate = target + draft parameters + both KV caches for batch x context
    tokens (context: the longest prompt plus the new tokens) + overhead (float32
    logits of a step's max_k + 1 positions, twice, and 20% of the weights);
    measured total = parameters + KV peaks, the process' RSS reported beside it."""
    dec = SpeculativeDecoder(target, ModelDrafter(draft_model), k=3)
    dec.generate([PROMPTS[0], PROMPTS[2]], 6)  # prompts of 8 and 13 tokens
    rep = dec.memory_report()
    batch, context = 2, 13 + 6
    assert (rep["batch"], rep["context"]) == (batch, context)

    def weights(m):
        return sum(p.numel() * p.element_size() for p in m.model.parameters())

    def kv_per_token(m):  # K and V of every layer, float64
        cfg = m.model.config
        return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * \
            (cfg.hidden_size // cfg.num_attention_heads) * 8

    assert kv_per_token(target) == 2 * 2 * 2 * 8 * 8 and kv_per_token(draft_model) == 256
    t_params, d_params = weights(target), weights(draft_model)
    max_k = dec.controller.max_k
    assert max_k == 10  # a model drafter's ceiling (k=3 is below it)
    est = rep["estimate"]
    want = {"target_params": t_params, "draft_params": d_params,
            "target_kv": kv_per_token(target) * batch * context,
            "draft_kv": kv_per_token(draft_model) * batch * context,
            "overhead": batch * (max_k + 1) * target.vocab_size * 4 * 2
            + int(0.2 * (t_params + d_params))}
    assert est == dict(want, total=sum(want.values()))
    meas = rep["measured"]
    assert meas["target_kv_peak"] > 0 and meas["draft_kv_peak"] > 0
    assert meas["process_peak_rss"] > meas["target_params"]
    assert meas["total"] == (meas["target_params"] + meas["draft_params"]
                             + meas["target_kv_peak"] + meas["draft_kv_peak"])
    one = dec.memory_report(batch=1, context=7)["estimate"]
    assert one["target_kv"] == kv_per_token(target) * 7
    assert one["draft_kv"] == kv_per_token(draft_model) * 7
