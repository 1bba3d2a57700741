"""specfast: exact, fast verification and sampling for speculative decoding.

>>> import numpy as np, specfast
>>> logits = np.random.randn(3, 1000).astype(np.float32)  # one request, 2 drafts
>>> result = specfast.verify(logits, np.array([1, 2]), np.array([2]), seed=0)
"""

from ._api import (
    SparseProbs,
    VerifyResult,
    get_num_threads,
    probs,
    sample,
    set_num_threads,
    simd_level,
    verify,
)
from ._lib import RequestError
from ._lib import lib as _lib
from ._tree import kv_compact, kv_keep_slots, tree_mask

__version__ = "0.1.0"

# The driver loop and drafters need torch; they load on first use so that
# `import specfast` needs only numpy and cffi.
_LAZY = {
    "SpeculativeDecoder": "decoder", "Generation": "decoder", "Metrics": "decoder",
    "DraftLength": "decoder", "Drafter": "drafters", "Draft": "drafters",
    "NgramDrafter": "drafters", "ModelDrafter": "drafters",
}


def __getattr__(name):
    import importlib

    if name == "cuda":  # the module; its library loads with the first CUDA tensor
        return importlib.import_module(".cuda", __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'specfast' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)

_lib()  # fail at import, not at the first call, when the library is missing

__all__ = [
    *_LAZY,
    "RequestError",
    "SparseProbs",
    "VerifyResult",
    "get_num_threads",
    "kv_compact",
    "kv_keep_slots",
    "probs",
    "sample",
    "set_num_threads",
    "simd_level",
    "tree_mask",
    "verify",
]
