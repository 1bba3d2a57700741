"""The CUDA backend's entry points, for torch CUDA tensors.

:func:`specfast.verify`, :func:`specfast.sample` and :func:`specfast.probs` come here
when their logits are a CUDA tensor. Call these directly for the arguments that only
the device path takes: ``max_draft`` (the outputs' width, so that ``num_draft`` on the
device is not read back), ``out`` (preallocated outputs and workspace) and ``check``.
Errors found in device data (a NaN row, a bad draft token) stay on the device by
default: the request that fails gets ``num_accepted`` 0 and tokens -1, and its status
code lands in ``out["status"]``. ``check=True``, or ``SPECFAST_CUDA_CHECK=1``,
synchronises and raises what the CPU backend would raise. Importing this module does
not load the CUDA library; the first CUDA tensor does.
"""

from ._cuda import probs, sample, verify

__all__ = ["probs", "sample", "verify"]
