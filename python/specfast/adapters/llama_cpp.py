"""llama.cpp targets and drafters through llama-cpp-python (optional).

Imported lazily: ``import specfast`` never needs llama-cpp-python. One
llama.cpp context of the adapter's own holds one sequence per request
(sequence id = row) in a unified KV cache, evaluated with the low-level batch
API so all rows of a step run in one ``llama_decode``; rolling back is
``llama_memory_seq_rm`` past the verified prefix. Logits are requested for
every appended token.

Tested with llama-cpp-python 0.3.36 (``tests/test_llama_cpp.py``, which skips
where the package is not installed). Its batched forward rounds differently
from its one-token forward, so greedy text can change under speculation.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np

from .._api import _is_int


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class LlamaCppState:
    lengths: list = field(default_factory=list)
    epoch: int = 0  # the model's new_state count when made (see _live)


class LlamaCppModel:
    """A GGUF model run by llama.cpp (``pip install llama-cpp-python``).

    Parameters
    ----------
    path : str
        The .gguf file.
    n_ctx : int
        KV cache slots shared by all rows of a batch (prompt, generated and
        drafted tokens together): the decoder refuses a batch whose prompts and
        ``max_new_tokens`` could outgrow it before it starts.
    n_seq_max : int
        The most requests in one batch.
    n_threads : int or None
        llama.cpp's threads; None: its default.
    chat : bool
        Wrap prompts in the model's chat template.
    """

    def __init__(self, path: str, *, n_ctx: int = 4096, n_seq_max: int = 8, n_threads=None,
                 chat: bool = True):
        try:
            import llama_cpp
        except ImportError as exc:
            raise ImportError(f"LlamaCppModel needs llama-cpp-python: pip install "
                              f"llama-cpp-python ({exc})") from exc

        lc = self.llama_cpp = llama_cpp
        # The Llama object gives the weights, tokenizer and metadata; its own
        # context holds one sequence, so the batch runs in a context of ours
        # with n_seq_max sequences sharing one KV cache.
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=64, n_batch=64, n_threads=n_threads,
                                   verbose=False)
        params = lc.llama_context_default_params()
        params.n_ctx = params.n_batch = n_ctx
        params.n_seq_max = n_seq_max
        params.kv_unified = True
        if n_threads:
            params.n_threads = params.n_threads_batch = n_threads
        self.ctx = lc.llama_init_from_model(self.llm.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {path}")
        # the finalizer holds the Llama object, so the weights outlive the context
        weakref.finalize(self, _free_context, lc, self.ctx, self.llm)
        # llama.cpp's memory API, or None before it replaced the kv_cache calls
        self._mem = lc.llama_get_memory(self.ctx) if hasattr(lc, "llama_get_memory") else None
        self.n_seq_max = n_seq_max
        self._epoch = 0
        self.chat = chat
        self.name = path.rsplit("/", 1)[-1]
        self.vocab_size = self.llm.n_vocab()
        # every end-of-generation token (Llama 3's <|eot_id|> is not token_eos)
        vocab = lc.llama_model_get_vocab(self.llm.model)
        self.eos_token_ids = [t for t in range(self.vocab_size) if lc.llama_vocab_is_eog(vocab, t)]
        self.max_positions = n_ctx  # one row alone
        self.max_batch_positions = n_ctx  # the rows together: they share the n_ctx cells
        try:  # read once: kv_bytes runs every decoding step
            self._kv_per_token = _kv_bytes_per_token(self.llm.metadata)
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            self._kv_per_token = 0  # the metadata does not say (per-layer head counts)

    # -- text ---------------------------------------------------------------
    def encode(self, prompt) -> list:
        if isinstance(prompt, (list, tuple)) and all(_is_int(t) for t in prompt):
            return [int(t) for t in prompt]
        if not isinstance(prompt, str):  # chat messages
            # rendered as transformers renders templates (their whitespace
            # control, the special tokens they may name), so that both adapters
            # give a prompt the same ids; llama-cpp-python depends on jinja2
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            template = self.llm.metadata.get("tokenizer.chat_template")
            if not template:
                raise ValueError(f"{self.name} has no chat template: pass a string or token "
                                 "ids, not chat messages")

            def raise_exception(message):  # what templates call on messages they refuse
                raise jinja2.TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = raise_exception
            piece = lambda t: "" if t < 0 else \
                self.llm.detokenize([t], special=True).decode(errors="replace")
            try:
                prompt = env.from_string(template).render(
                    messages=prompt, add_generation_prompt=True,
                    bos_token=piece(self.llm.token_bos()), eos_token=piece(self.llm.token_eos()))
            except jinja2.TemplateError as e:
                raise ValueError(f"the chat template cannot render these messages: "
                                 f"{type(e).__name__}: {e}") from e
            return self.llm.tokenize(prompt.encode(), add_bos=False, special=True)
        if self.chat and self.llm.metadata.get("tokenizer.chat_template"):
            return self.encode([{"role": "user", "content": prompt}])
        return self.llm.tokenize(prompt.encode(), add_bos=True)

    def decode(self, ids) -> str:
        return self.llm.detokenize(list(ids)).decode("utf-8", errors="replace")

    # -- memory ---------------------------------------------------------------
    def param_bytes(self) -> int:
        return int(self.llama_cpp.llama_model_size(self.llm.model))

    def kv_bytes_per_token(self) -> int:
        """K and V bytes of one cached token, over all layers (f16 cache), from the
        GGUF metadata; 0 where it does not say."""
        return self._kv_per_token

    def kv_bytes(self, state) -> int:
        return self.kv_bytes_per_token() * sum(state.lengths)

    # -- the cache ----------------------------------------------------------
    def new_state(self, batch: int) -> LlamaCppState:
        if batch > self.n_seq_max:
            raise ValueError(f"batch {batch} > n_seq_max {self.n_seq_max}")
        if self._mem is not None:
            self.llama_cpp.llama_memory_clear(self._mem, True)
        else:
            self.llama_cpp.llama_kv_cache_clear(self.ctx)
        self._epoch += 1
        return LlamaCppState([0] * batch, self._epoch)

    def _live(self, state) -> None:
        """The model's one KV cache holds only its newest state: an older one
        (the same instance as target and draft model, or in two decoders at
        once) would read another generation's cells."""
        if state.epoch != self._epoch:
            raise RuntimeError(f"{self.name}: this state's cache was cleared by a newer "
                               "new_state; a LlamaCppModel runs one generation at a time "
                               "(load the draft model as another instance)")

    def forward(self, state, tokens, all_logits: bool = True):
        self._live(state)
        lc = self.llama_cpp
        total = sum(len(t) for t in tokens)
        outs = [np.empty((0, self.vocab_size), np.float32) for _ in tokens]
        if total == 0:
            return outs
        if sum(state.lengths) + total > self.max_batch_positions:  # llama.cpp would abort
            raise ValueError(f"{sum(state.lengths)} cached and {total} new tokens exceed the "
                             f"context of {self.max_batch_positions} (n_ctx) that the batch's "
                             "rows share")
        batch = lc.llama_batch_init(total, 0, 1)
        try:
            i = 0
            where = []
            for b, row in enumerate(tokens):
                for j, t in enumerate(row):
                    batch.token[i] = t
                    batch.pos[i] = state.lengths[b] + j
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = b
                    want = all_logits or j == len(row) - 1
                    batch.logits[i] = want
                    if want:
                        where.append((b, i))
                    i += 1
            batch.n_tokens = total
            if lc.llama_decode(self.ctx, batch) != 0:
                for b, n in enumerate(state.lengths):  # what a partial decode cached
                    self._seq_rm(b, n)
                raise RuntimeError("llama_decode failed")
            rows = {b: [] for b in range(len(tokens))}
            for b, i in where:
                ptr = lc.llama_get_logits_ith(self.ctx, i)
                rows[b].append(np.ctypeslib.as_array(ptr, shape=(self.vocab_size,)).copy())
            for b, r in rows.items():
                if r:
                    outs[b] = np.stack(r)
        finally:
            lc.llama_batch_free(batch)
        state.lengths = [n + len(t) for n, t in zip(state.lengths, tokens)]
        return outs

    def _seq_rm(self, seq: int, start: int) -> None:
        """Drops sequence seq's cells from position start on (-1: all)."""
        if self._mem is not None:
            self.llama_cpp.llama_memory_seq_rm(self._mem, seq, start, -1)
        else:
            self.llama_cpp.llama_kv_cache_seq_rm(self.ctx, seq, start, -1)

    def _seq_cp(self, src: int, dst: int) -> None:
        if self._mem is not None:
            self.llama_cpp.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
        else:
            self.llama_cpp.llama_kv_cache_seq_cp(self.ctx, src, dst, -1, -1)

    def truncate(self, state, lengths) -> None:
        self._live(state)
        for b, (have, keep) in enumerate(zip(state.lengths, lengths)):
            if keep < have:
                self._seq_rm(b, keep)
        state.lengths = [min(a, b) for a, b in zip(state.lengths, lengths)]

    def select(self, state, rows) -> None:
        """Keeps these rows, in ascending order (the decoder keeps the requests that
        go on): sequence ids are renumbered in place by moving their cells, which a
        reordering would merge."""
        self._live(state)
        rows = list(rows)
        if any(a >= b for a, b in zip(rows, rows[1:])):
            raise ValueError(f"select: rows must be ascending, got {rows}")
        for b in range(len(state.lengths)):
            if b not in rows:
                self._seq_rm(b, -1)
        for new, old in enumerate(rows):
            if new != old:
                self._seq_cp(old, new)
                self._seq_rm(old, -1)
        state.lengths = [state.lengths[r] for r in rows]


def _kv_bytes_per_token(md: dict) -> int:
    """2 bytes (f16) per K and V element of every layer's KV heads, from the GGUF metadata."""
    arch = md.get("general.architecture", "")
    get = lambda key, default=None: int(md[f"{arch}.{key}"] if default is None
                                        else md.get(f"{arch}.{key}", default))
    heads = get("attention.head_count")
    head_dim = get("embedding_length") // heads
    k, v = get("attention.key_length", head_dim), get("attention.value_length", head_dim)
    return 2 * get("block_count") * get("attention.head_count_kv", heads) * (k + v)


def _free_context(lc, ctx, llm) -> None:
    lc.llama_free(ctx)
