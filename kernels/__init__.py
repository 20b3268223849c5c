"""Kvasir kernels: every op as a Triton kernel and a plain-torch reference with the same signature.

Import the ops from here: each one dispatches (see `kvasir.kernels.dispatch`) to Triton on CUDA
and to the reference elsewhere. `reference/` holds the references, `triton_ops/` the kernels and
their launch wrappers (imported only when used, so CPU-only installs never compile anything).
"""

from kvasir.kernels.attention import paged_attention, store_kv
from kvasir.kernels.workspace import AttentionWorkspace

__all__ = ["AttentionWorkspace", "paged_attention", "store_kv"]
