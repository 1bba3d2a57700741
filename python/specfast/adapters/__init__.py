"""Model adapters: what the decoder needs from a language model.

An adapter wraps one model and its tokenizer and runs forwards over a batch of
sequences whose KV caches it keeps. The decoder only calls:

- ``new_state(batch)`` -> a state holding the KV caches of ``batch`` sequences;
- ``forward(state, tokens, all_logits)``: append ``tokens[b]`` (a list of ids,
  possibly empty) to sequence b and return its logits, one row per appended
  token when ``all_logits`` else only the last, as a list of ``(n_b, V)``
  tensors;
- ``truncate(state, lengths)``: roll sequence b back to its first
  ``lengths[b]`` tokens (what the target rejected);
- for token trees, ``forward(..., trees=parents per row)`` (row b's tokens are
  a root and draft nodes, each seeing its ancestors only) and
  ``keep_paths(state, accepted_nodes, num_accepted)``, which leaves each row as
  if its accepted path had been a chain; adapters without them take chains only;
- ``encode(prompt)`` / ``decode(ids)`` / ``eos_token_ids`` / ``vocab_size``;
- ``param_bytes()`` and ``kv_bytes(state)`` / ``kv_bytes_per_token()`` for the
  memory report.

``hf.HFModel`` wraps transformers causal LMs (folders and GGUF files);
``llama_cpp.LlamaCppModel`` wraps llama-cpp-python when it is installed.
"""

from __future__ import annotations


def load(path: str, **kwargs):
    """An adapter for a model at ``path``: a folder or a ``.gguf`` file, loaded
    with transformers."""
    from .hf import HFModel

    return HFModel.from_pretrained(path, **kwargs)
