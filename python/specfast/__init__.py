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
from ._lib import lib as _lib
from ._tree import kv_compact, kv_keep_slots, tree_mask

__version__ = "0.1.0"

_lib()  # fail at import, not at the first call, when the library is missing

__all__ = [
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
