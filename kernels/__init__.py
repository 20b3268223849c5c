"""Kvasir kernels: every op as a Triton kernel and a plain-torch reference with the same signature.

Import the ops from here: each one dispatches (see `kvasir.kernels.dispatch`) to Triton on CUDA
and to the reference elsewhere. `reference/` holds the references, `triton_ops/` the kernels and
their launch wrappers (imported only when used, so CPU-only installs never compile anything).
"""

from kvasir.kernels.activation import silu_and_mul
from kvasir.kernels.attention import paged_attention, rotary_store_kv, store_kv
from kvasir.kernels.norm import fused_add_rms_norm, rms_norm
from kvasir.kernels.rotary import apply_rotary
from kvasir.kernels.workspace import AttentionWorkspace

__all__ = [
    "AttentionWorkspace",
    "apply_rotary",
    "fused_add_rms_norm",
    "paged_attention",
    "rms_norm",
    "rotary_store_kv",
    "silu_and_mul",
    "store_kv",
]
